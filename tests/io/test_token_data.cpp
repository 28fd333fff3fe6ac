// Token data: the file format (writer, reader, validation), the label rule
// (shift by one, -100 for masked targets and document starts), determinism
// for a seed, resuming from state(), a file changed under a run (an Error,
// never a SIGBUS), and the fingerprint a checkpoint records.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "host/error.h"
#include "io/checksum.h"
#include "io/token_data.h"

namespace fs = std::filesystem;
using namespace strider;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "strider-tok-XXXXXX").string();
    path = ::mkdtemp(templ.data());
  }
  ~TempDir() { std::error_code ec; fs::remove_all(path, ec); }
};

using Batch = std::pair<std::vector<int64_t>, std::vector<int64_t>>;

Batch next_batch(TokenLoader& loader, size_t batch, size_t seq) {
  Batch b{std::vector<int64_t>(batch * seq), std::vector<int64_t>(batch * seq)};
  loader.next(b.first, b.second);
  return b;
}

// ids 0..n-1 (mod 1000), one document.
std::string write_counting(const fs::path& dir, uint32_t n, TokenWriterOptions opts = {}) {
  std::string path = (dir / "count.tok").string();
  std::vector<uint32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = i % 1000;
  TokenFileWriter w(path, opts);
  w.append(ids);
  w.finish();
  return path;
}

// Writes `bytes` at `offset` of `path` through a descriptor of its own, as
// another process would.
void overwrite(const std::string& path, uint64_t offset, std::vector<std::byte> bytes) {
  int fd = ::open(path.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, bytes.data(), bytes.size(), off_t(offset)) == ssize_t(bytes.size()));
  ::close(fd);
}

std::vector<std::byte> read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

}  // namespace

TEST_CASE("token data: writer and reader agree on ids, mask, documents and size", "[token_data]") {
  TempDir dir;
  const std::string path = (dir.path / "chat.tok").string();
  TokenWriterOptions opts;
  opts.token_bytes = 4;
  opts.with_mask = true;
  opts.with_docs = true;
  opts.vocab_size = 100000;
  TokenFileWriter w(path, opts);
  // Two chat documents: prompt tokens masked out, answers counted.
  w.append_document(std::vector<uint32_t>{1, 2, 3, 70001, 70002}, std::vector<uint8_t>{0, 0, 0, 1, 1});
  w.append_document(std::vector<uint32_t>{4, 99999, 6}, std::vector<uint8_t>{0, 1, 1});
  w.append(std::vector<uint32_t>{7});  // no mask given: counts
  CHECK_FALSE(fs::exists(path));       // only a temp file until finish()
  w.finish();

  TokenFile f(path);
  CHECK(f.size() == 9);
  CHECK(f.layout().token_bytes == 4);
  CHECK(f.layout().vocab_size == 100000);
  // 1024 + pad8(36) + pad8(9) + 2 * 8
  CHECK(fs::file_size(path) == 1024 + 40 + 16 + 16);
  std::vector<uint32_t> ids;
  for (uint64_t i = 0; i < f.size(); ++i) ids.push_back(f.token(i));
  CHECK(ids == std::vector<uint32_t>{1, 2, 3, 70001, 70002, 4, 99999, 6, 7});
  CHECK(f.mask() == std::vector<uint8_t>{0, 0, 0, 1, 1, 0, 1, 1, 1});
  CHECK(std::vector<uint64_t>(f.doc_starts().begin(), f.doc_starts().end()) ==
        std::vector<uint64_t>{0, 5});
  CHECK_THROWS_WITH(TokenFile(path, 70000), Catch::Contains("token 3") &&
                                                Catch::Contains("70001") && Catch::Contains(path));
}

TEST_CASE("token data: labels shift by one, -100 on masked targets and document starts",
          "[token_data]") {
  TempDir dir;
  const std::string path = (dir.path / "lab.tok").string();
  TokenWriterOptions opts;
  opts.with_mask = true;
  opts.with_docs = true;
  TokenFileWriter w(path, opts);
  w.append_document(std::vector<uint32_t>{10, 11, 12, 13, 14}, std::vector<uint8_t>{0, 0, 1, 1, 1});
  // Token 20 counts by its mask: only the document rule makes its label -100.
  w.append_document(std::vector<uint32_t>{20, 21, 22, 23, 24}, std::vector<uint8_t>{1, 1, 1, 0, 1});
  w.finish();
  TokenFile f(path);
  TokenLoader loader(f, {.batch = 2, .seq = 4, .seed = 0, .shuffle = false});
  CHECK(loader.num_windows() == 2);  // (10 - 1) / 4
  auto [in, lab] = next_batch(loader, 2, 4);
  CHECK(in == std::vector<int64_t>{10, 11, 12, 13, 14, 20, 21, 22});
  // window 0 targets 11(m0) 12 13 14; window 1 targets 20(doc start) 21 22 23(m0)
  CHECK(lab == std::vector<int64_t>{-100, 12, 13, 14, -100, 21, 22, -100});
}

TEST_CASE("token data: padding (mask byte 2) is no target and no input, and only ends a window", "[token_data]") {
  // Documents padded to windows of 4 (python -m strider.data --mode example),
  // one padding token past the last window.
  TempDir dir;
  const std::string path = (dir.path / "pad.tok").string();
  TokenWriterOptions opts;
  opts.with_mask = true;
  opts.with_docs = true;
  TokenFileWriter w(path, opts);
  w.append_document(std::vector<uint32_t>{10, 11, 0, 0}, std::vector<uint8_t>{1, 1, 2, 2});
  w.append_document(std::vector<uint32_t>{20, 21, 22, 23}, std::vector<uint8_t>{0, 1, 1, 1});
  w.append_document(std::vector<uint32_t>{30, 31, 32, 0, 0}, std::vector<uint8_t>{1, 1, 1, 2, 2});
  w.finish();
  TokenFile f(path);
  CHECK(f.mask()[2] == kMaskPadding);
  TokenLoader loader(f, {.batch = 3, .seq = 4, .seed = 0, .shuffle = false});
  std::vector<int64_t> in(12), lab(12), pos(12), att(12);
  CHECK(loader.next(in, lab, pos, att));
  CHECK(att == std::vector<int64_t>{1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0});
  CHECK(lab == std::vector<int64_t>{11, -100, -100, -100, 21, 22, 23, -100, 31, 32, -100, -100});
  // Without the attention output the labels are the same.
  TokenLoader plain(f, {.batch = 3, .seq = 4, .seed = 0, .shuffle = false});
  std::vector<int64_t> lab2(12);
  CHECK(plain.next(in, lab2));
  CHECK(lab2 == lab);
  // Windows of 3 put the first document's padding before the second's tokens.
  TokenLoader other(f, {.batch = 2, .seq = 3, .seed = 0, .shuffle = false});
  std::vector<int64_t> in3(6), lab3(6), att3(6);
  CHECK_THROWS_WITH(other.next(in3, lab3, {}, att3), Catch::Contains(path) && Catch::Contains("padding only ends a window"));
  CHECK(other.state().cursor == 0);  // the failed batch was not handed out
  CHECK_THROWS_WITH(other.next(in3, lab3), Catch::Contains("padding only ends a window"));  // mask or none
  // A file without padding has none.
  const std::string plain_path = (dir.path / "plain.tok").string();
  TokenFileWriter p(plain_path, opts);
  p.append_document(std::vector<uint32_t>{1, 2, 3, 4, 5}, std::vector<uint8_t>{0, 1, 1, 1, 1});
  p.finish();
  TokenFile pf(plain_path);
  TokenLoader pl(pf, {.batch = 1, .seq = 4, .seed = 0, .shuffle = false});
  std::vector<int64_t> in1(4), lab1(4), att1(4);
  CHECK_FALSE(pl.next(in1, lab1, {}, att1));
  CHECK(att1 == std::vector<int64_t>{1, 1, 1, 1});
}

TEST_CASE("token data: positions restart at each document start inside a window", "[token_data]") {
  TempDir dir;
  const std::string path = (dir.path / "docs.tok").string();
  TokenWriterOptions opts;
  opts.with_docs = true;
  TokenFileWriter w(path, opts);
  w.append_document(std::vector<uint32_t>{10, 11, 12});
  w.append_document(std::vector<uint32_t>{20, 21, 22, 23, 24, 25});
  w.append_document(std::vector<uint32_t>{30});
  w.append_document(std::vector<uint32_t>{40, 41, 42});
  w.finish();
  TokenFile f(path);
  TokenLoader loader(f, {.batch = 3, .seq = 4, .seed = 0, .shuffle = false});
  std::vector<int64_t> in(12), lab(12), pos(12);
  loader.next(in, lab, pos);
  CHECK(in == std::vector<int64_t>{10, 11, 12, 20, 21, 22, 23, 24, 25, 30, 40, 41});
  // Window 0: document 1 (3 tokens), then document 2 from 0; window 1 starts
  // inside document 2 (positions from the window's start); window 2 holds
  // document 2's end, document 3 (one token) and document 4's start.
  CHECK(pos == std::vector<int64_t>{0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 0, 1});
  CHECK(lab == std::vector<int64_t>{11, 12, -100, 21, 22, 23, 24, 25, -100, -100, 41, 42});
  // Without positions the same ids and labels.
  TokenLoader again(f, {.batch = 3, .seq = 4, .seed = 0, .shuffle = false});
  auto [in2, lab2] = next_batch(again, 3, 4);
  CHECK((in2 == in && lab2 == lab));
  std::vector<int64_t> short_pos(5);
  CHECK_THROWS_WITH(again.next(in, lab, short_pos), Catch::Contains("12, 12, 5 and 0"));
}

TEST_CASE("token data: same seed same batches and every epoch visits each window once",
          "[token_data]") {
  TempDir dir;
  TokenFile f(write_counting(dir.path, 1001));
  const TokenLoaderOptions opts{.batch = 3, .seq = 10, .seed = 42, .shuffle = true};
  TokenLoader a(f, opts), b(f, opts);
  auto other_opts = opts;
  other_opts.seed = 43;
  TokenLoader c(f, other_opts);
  REQUIRE(a.num_windows() == 100);
  std::vector<int64_t> starts;
  bool differs = false;
  for (int i = 0; i < 34; ++i) {  // 102 windows: one epoch and two more
    auto ba = next_batch(a, 3, 10), bb = next_batch(b, 3, 10), bc = next_batch(c, 3, 10);
    CHECK(ba == bb);
    differs |= ba != bc;
    for (int r = 0; r < 3; ++r) {
      starts.push_back(ba.first[r * 10]);
      // label[t] = token[s + t + 1], and ids count modulo 1000: the window at
      // 990 ends on token 1000, id 0, so its last label is 0, not 999 + 1.
      for (int t = 0; t < 10; ++t)
        CHECK(ba.second[r * 10 + t] == (ba.first[r * 10 + t] + 1) % 1000);
    }
  }
  CHECK(differs);
  std::set<int64_t> epoch0(starts.begin(), starts.begin() + 100);
  CHECK(epoch0.size() == 100);  // a permutation: no window twice
  CHECK(*epoch0.rbegin() == 990);
  CHECK(a.state().epoch == 1);
  CHECK(a.state().cursor == 2);
  // The order is not the identity, and epochs differ.
  CHECK(window_order(100, 42, 0) != window_order(100, 42, 1));
  auto order = window_order(100, 42, 0), sorted = order;
  std::sort(sorted.begin(), sorted.end());
  CHECK(order != sorted);
  CHECK(sorted.front() == 0);
  CHECK(sorted.back() == 99);
}

TEST_CASE("token data: restore(state) resumes exactly, across an epoch boundary",
          "[token_data]") {
  TempDir dir;
  TokenFile f(write_counting(dir.path, 501));
  const TokenLoaderOptions opts{.batch = 4, .seq = 10, .seed = 7, .shuffle = true};
  TokenLoader first(f, opts);  // 50 windows: epoch ends inside batch 13
  for (int i = 0; i < 11; ++i) next_batch(first, 4, 10);
  TokenLoaderState saved = first.state();
  std::vector<Batch> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(next_batch(first, 4, 10));

  TokenLoader resumed(f, opts);
  next_batch(resumed, 4, 10);  // its own position does not matter
  resumed.restore(saved);
  for (int i = 0; i < 5; ++i) CHECK(next_batch(resumed, 4, 10) == expected[i]);
  CHECK(resumed.state() == first.state());

  auto other = opts;
  other.seed = 8;
  TokenLoader wrong(f, other);
  CHECK_THROWS_WITH(wrong.restore(saved), Catch::Contains("seed 7") && Catch::Contains("seed 8"));
}

TEST_CASE("token data: the writer and loader refuse what they cannot represent", "[token_data]") {
  TempDir dir;
  const std::string path = (dir.path / "w.tok").string();
  {
    TokenFileWriter w(path);
    CHECK_THROWS_WITH(w.append(std::vector<uint32_t>{1, 65536}),
                      Catch::Contains("token 1") && Catch::Contains("65536"));
    CHECK_THROWS_WITH(w.append(std::vector<uint32_t>{1}, std::vector<uint8_t>{1}),
                      Catch::Contains("with_mask"));
  }
  CHECK_FALSE(fs::exists(path));
  TokenFile f(write_counting(dir.path, 10));
  CHECK_THROWS_WITH(TokenLoader(f, {.batch = 1, .seq = 10}), Catch::Contains("10 tokens") &&
                                                                 Catch::Contains("seq + 1 = 11"));
  TokenLoader l(f, {.batch = 2, .seq = 3});
  std::vector<int64_t> small(5);
  CHECK_THROWS_WITH(l.next(small, small), Catch::Contains("batch * seq = 6"));
}

TEST_CASE("token data: each malformed corpus file gives a clear error", "[token_data]") {
  const fs::path corpus = fs::path(STRIDER_IO_CORPUS_DIR) / "tokens";
  struct Case { const char* file; std::vector<const char*> says; };
  const std::vector<Case> cases = {
      {"bad_magic", {"'magic'", "STRDTOKN"}},
      {"bad_version", {"'version' is 7", "version 1"}},
      {"bad_token_bytes", {"'token_bytes' is 3"}},
      {"bad_count", {"'num_tokens' 1000", "implies a file of 3024 bytes", "has 1048"}},
      {"bad_count_huge", {"'num_tokens' 9223372036854775808", "more than"}},
      {"bad_truncated", {"'num_tokens' 9", "has 1046", "truncated"}},
      {"bad_vocab", {"token 4", "id 9", "vocab size 8", "'vocab_size'"}},
      {"bad_docs_order", {"doc start 2 is 2", "increase strictly"}},
      {"bad_mask_value", {"loss mask of token 2 is 3"}},
      {"bad_short_header", {"100 bytes", "1024-byte"}},
      {"bad_reserved", {"reserved header word 100"}},
  };
  for (const auto& c : cases) {
    const std::string path = (corpus / (std::string(c.file) + ".tok")).string();
    INFO(path);
    REQUIRE(fs::exists(path));
    try {
      TokenFile f(path);
      FAIL("opened without error");
    } catch (const Error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find(path) != std::string::npos);
      for (const char* s : c.says) CHECK(what.find(s) != std::string::npos);
    }
  }
  TokenFile ok((corpus / "valid_u32_mask_docs.tok").string());
  CHECK(ok.token(0) == 70000);
  CHECK_THROWS_WITH(TokenFile((corpus / "valid_u16.tok").string(), 9),
                    Catch::Contains("token 4") && Catch::Contains("vocab size 9 (given)"));
}

TEST_CASE("token data: a file truncated while a run reads it is an Error naming it, not a SIGBUS",
          "[token_data]") {
  TempDir dir;
  const std::string path = write_counting(dir.path, 100001);
  TokenFile f(path);
  TokenLoader loader(f, {.batch = 4, .seq = 64, .seed = 1});
  next_batch(loader, 4, 64);
  int fd = ::open(path.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 4096) == 0);
  ::close(fd);
  const TokenLoaderState before = loader.state();
  CHECK_THROWS_WITH(next_batch(loader, 4, 64),
                    Catch::Contains(path) && Catch::Contains("changed while in use") &&
                        Catch::Contains("4096 bytes") && Catch::Contains("201032 bytes"));
  CHECK(loader.state() == before);  // the batch that failed is not counted as handed out
  // A read that lands past the new end (as one racing the size check would)
  // fails by its byte count.
  CHECK_THROWS_WITH(f.token(50000), Catch::Contains(path) && Catch::Contains("its size now: 4096 bytes") &&
                                        Catch::Contains("truncated while in use"));
  CHECK_THROWS_WITH(f.fingerprint(), Catch::Contains(path) && Catch::Contains("changed while in use"));
}

TEST_CASE("token data: a file rewritten in place while a run reads it is refused", "[token_data]") {
  TempDir dir;
  const std::string path = write_counting(dir.path, 1001);
  TokenFile f(path);
  TokenLoader loader(f, {.batch = 2, .seq = 10, .seed = 1});
  next_batch(loader, 2, 10);
  // Past the file system's timestamp granularity (a few ms), so the
  // modification time moves.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  overwrite(path, kTokenHeaderBytes, std::vector<std::byte>(2, std::byte{7}));
  CHECK_THROWS_WITH(next_batch(loader, 2, 10), Catch::Contains(path) && Catch::Contains("changed while in use"));
}

TEST_CASE("token data: the fingerprint is the file's size and XXH3 of its bytes, and tells content apart",
          "[token_data]") {
  TempDir dir;
  // Over 4 MiB: the hash is fed in several chunks.
  const std::string path = write_counting(dir.path, 3'000'001);
  TokenFileFingerprint before;
  {
    TokenFile f(path);
    before = f.fingerprint();
    CHECK(f.fingerprint() == before);
    CHECK(before.bytes == fs::file_size(path));
    CHECK(before.xxh3 == checksum64(read_whole(path)));
  }
  // The same bytes in another file: the same fingerprint.
  const std::string copy = (dir.path / "copy.tok").string();
  fs::copy_file(path, copy);
  CHECK(TokenFile(copy).fingerprint() == before);
  // One id changed, the size unchanged (id 10 becomes 11, still a valid file).
  overwrite(path, kTokenHeaderBytes + 2 * 10, {std::byte{11}, std::byte{0}});
  TokenFile g(path);
  CHECK(g.token(10) == 11);
  const TokenFileFingerprint after = g.fingerprint();
  CHECK(after.bytes == before.bytes);
  CHECK(after.xxh3 != before.xxh3);
  CHECK_FALSE(after == before);
}

TEST_CASE("token data: a preference file is read in pairs, each group of rows its pairs' chosen then rejected",
          "[token_data]") {
  // Three pairs in windows of 4 (python -m strider.data --mode preference):
  // window 2i pair i's chosen sequence (first id 10 + i), 2i + 1 its rejected (20 + i).
  TempDir dir;
  const std::string path = (dir.path / "pairs.tok").string();
  TokenWriterOptions opts;
  opts.with_mask = true;
  opts.with_docs = true;
  TokenFileWriter w(path, opts);
  for (uint32_t i = 0; i < 3; ++i) {
    w.append_document(std::vector<uint32_t>{10 + i, 5, 6, 0}, std::vector<uint8_t>{0, 1, 1, 2});
    w.append_document(std::vector<uint32_t>{20 + i, 7, 0, 0}, std::vector<uint8_t>{0, 1, 2, 2});
  }
  w.append(std::vector<uint32_t>{0}, std::vector<uint8_t>{2});
  w.finish();
  auto word = [](uint64_t v) {
    std::vector<std::byte> b(8);
    std::memcpy(b.data(), &v, 8);
    return b;
  };
  overwrite(path, 7 * 8, word(4));  // example_seq
  overwrite(path, 8 * 8, word(1));  // pairs
  TokenFile f(path);
  CHECK(f.layout().pairs);
  CHECK_THROWS_WITH(TokenLoader(f, {.batch = 4, .seq = 4}), Catch::Contains("a preference file") &&
                                                                 Catch::Contains("--objective dpo, simpo or orpo"));
  CHECK_THROWS_WITH(TokenLoader(f, {.batch = 4, .seq = 4, .pair_rows = 3}), Catch::Contains("must be even"));
  CHECK_THROWS_WITH(TokenLoader(f, {.batch = 4, .seq = 8, .pair_rows = 4}), Catch::Contains("--mode example --seq 4"));

  // Two ranks of 2 rows: each rank's rows are one pair's chosen, then its rejected.
  TokenLoader loader(f, {.batch = 4, .seq = 4, .seed = 5, .pair_rows = 2});
  CHECK(loader.num_windows() == 3);  // pairs
  const std::vector<uint64_t> order = window_order(3, 5, 0);
  std::vector<int64_t> in(16), lab(16), att(16);
  loader.next(in, lab, {}, att);
  for (uint64_t g = 0; g < 2; ++g) {
    const uint64_t pair = order[g];
    CHECK(loader.last_windows()[2 * g] == 2 * pair);
    CHECK(loader.last_windows()[2 * g + 1] == 2 * pair + 1);
    CHECK(in[(2 * g) * 4] == int64_t(10 + pair));      // chosen
    CHECK(in[(2 * g + 1) * 4] == int64_t(20 + pair));  // rejected
    CHECK(std::vector<int64_t>(lab.begin() + int64_t(2 * g) * 4, lab.begin() + int64_t(2 * g + 1) * 4) ==
          std::vector<int64_t>{5, 6, -100, -100});
    CHECK(std::vector<int64_t>(att.begin() + int64_t(2 * g + 1) * 4, att.begin() + int64_t(2 * g + 2) * 4) ==
          std::vector<int64_t>{1, 1, 0, 0});
  }
  // The epoch's third pair, then the next epoch's first: every pair once an epoch, resumable.
  const TokenLoaderState at = loader.state();
  loader.next(in, lab, {}, att);
  CHECK(loader.last_windows()[0] == 2 * order[2]);
  CHECK(loader.last_windows()[2] == 2 * window_order(3, 5, 1)[0]);
  const std::vector<int64_t> after = in;
  loader.restore(at);
  loader.next(in, lab, {}, att);
  CHECK(in == after);

  // A file of windows is not read as pairs, and a header saying pairs of a packed stream is refused.
  const std::string plain = write_counting(dir.path, 64);
  TokenFile pf(plain);
  CHECK_THROWS_WITH(TokenLoader(pf, {.batch = 2, .seq = 4, .pair_rows = 2}),
                    Catch::Contains("not a preference file") && Catch::Contains("--mode preference"));
  overwrite(plain, 8 * 8, word(1));
  CHECK_THROWS_WITH(TokenFile(plain), Catch::Contains("field 'pairs' is 1"));
}
