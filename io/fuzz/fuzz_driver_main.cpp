// A deterministic stand-in for libFuzzer's main, so every test build runs the
// fuzz entry points briefly: each corpus file, then seeded random mutations of
// them (bit flips, interesting bytes, truncation, insertion, splices, lying
// 8-byte lengths). Same seed, same inputs. A run stops early, without failing,
// at --max-seconds, so a slow machine never turns it red.
//
//   fuzz_driver [--iterations N] [--seed S] [--max-seconds T] FILE_OR_DIR...
//
// Exit 0 when every input was handled; 1 (and the input saved as
// fuzz-failure-<k>.bin in the working directory) when one escaped with an
// exception other than strider::Error.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::vector<uint8_t>;

Bytes read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void mutate(Bytes& b, const std::vector<Bytes>& corpus, std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return n == 0 ? uint64_t{0} : rng() % n; };
  static constexpr uint8_t kInteresting[] = {0, 1, 0x7f, 0x80, 0xff, '{', '}', '"', '[', ']',
                                             ',', ':', '-', '0', '9', 'e', ' '};
  switch (rng() % 9) {
    case 0:  // flip a bit
      if (!b.empty()) b[pick(b.size())] ^= static_cast<uint8_t>(1u << (rng() % 8));
      break;
    case 1:  // an interesting byte
      if (!b.empty()) b[pick(b.size())] = kInteresting[pick(std::size(kInteresting))];
      break;
    case 2:  // truncate
      b.resize(pick(b.size() + 1));
      break;
    case 3: {  // erase a range
      if (b.empty()) break;
      size_t at = pick(b.size()), n = 1 + pick(std::min<size_t>(16, b.size() - at));
      b.erase(b.begin() + at, b.begin() + at + n);
      break;
    }
    case 4: {  // insert random bytes
      size_t at = pick(b.size() + 1), n = 1 + pick(16);
      Bytes ins(n);
      for (auto& x : ins) x = static_cast<uint8_t>(rng());
      b.insert(b.begin() + at, ins.begin(), ins.end());
      break;
    }
    case 5: {  // duplicate a range
      if (b.empty()) break;
      size_t at = pick(b.size()), n = 1 + pick(std::min<size_t>(32, b.size() - at));
      Bytes copy(b.begin() + at, b.begin() + at + n);
      b.insert(b.begin() + pick(b.size() + 1), copy.begin(), copy.end());
      break;
    }
    case 6: {  // splice the tail of another input
      const Bytes& other = corpus[pick(corpus.size())];
      size_t at = pick(b.size() + 1), from = pick(other.size() + 1);
      b.resize(at);
      b.insert(b.end(), other.begin() + from, other.end());
      break;
    }
    case 7: {  // a lying little-endian word at an 8-byte boundary (lengths, counts)
      if (b.size() < 8) break;
      size_t at = 8 * pick(std::min<size_t>(b.size() / 8, 8));
      const uint64_t values[] = {0, 1, b.size(), b.size() - 8, b.size() - 7, UINT64_MAX,
                                 uint64_t{1} << 63, 100'000'000, 100'000'001, rng()};
      uint64_t v = values[pick(std::size(values))];
      std::memcpy(b.data() + at, &v, 8);
      break;
    }
    default: {  // change a decimal digit (offsets, shapes)
      std::vector<size_t> digits;
      for (size_t i = 0; i < b.size(); ++i)
        if (b[i] >= '0' && b[i] <= '9') digits.push_back(i);
      if (!digits.empty()) b[digits[pick(digits.size())]] = static_cast<uint8_t>('0' + rng() % 10);
      break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t iterations = 5000, seed = 1;
  double max_seconds = 20;
  std::vector<Bytes> corpus;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--iterations" && i + 1 < argc) { iterations = std::stoull(argv[++i]); continue; }
    if (a == "--seed" && i + 1 < argc) { seed = std::stoull(argv[++i]); continue; }
    if (a == "--max-seconds" && i + 1 < argc) { max_seconds = std::stod(argv[++i]); continue; }
    std::filesystem::path p(a);
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());  // directory order is not deterministic
    } else {
      files.push_back(p);
    }
    for (const auto& f : files) corpus.push_back(read_all(f));
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "fuzz driver: no corpus files given\n");
    return 2;
  }

  int failures = 0;
  auto run = [&](const Bytes& input) {
    try {
      LLVMFuzzerTestOneInput(input.data(), input.size());
    } catch (const std::exception& e) {
      std::string name = "fuzz-failure-" + std::to_string(failures++) + ".bin";
      std::ofstream(name, std::ios::binary).write(reinterpret_cast<const char*>(input.data()),
                                                  static_cast<std::streamsize>(input.size()));
      std::fprintf(stderr, "fuzz driver: input of %zu bytes escaped with: %s (saved as %s)\n",
                   input.size(), e.what(), name.c_str());
    }
  };
  for (const auto& c : corpus) run(c);

  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0;
  for (; done < iterations; ++done) {
    if ((done & 255) == 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > max_seconds)
      break;
    Bytes b = corpus[rng() % corpus.size()];
    for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) mutate(b, corpus, rng);
    run(b);
  }
  std::printf("fuzz driver: %zu corpus inputs, %llu mutations (seed %llu), %d failures\n",
              corpus.size(), static_cast<unsigned long long>(done),
              static_cast<unsigned long long>(seed), failures);
  return failures == 0 ? 0 : 1;
}
