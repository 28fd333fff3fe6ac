// safetensors read/write: round trips through real files, sharding with an
// index, streaming chunked writes, atomicity, and the error each malformed
// file in tests/io/corpus/safetensors gives.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "host/error.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace strider;

namespace {

// A fresh directory per test, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "strider-st-XXXXXX").string();
    path = ::mkdtemp(templ.data());
  }
  ~TempDir() { std::error_code ec; fs::remove_all(path, ec); }
  std::string str() const { return path.string(); }
};

std::vector<std::byte> iota_bytes(size_t n, int start) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((start + i * 7) & 0xff);
  return v;
}

bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Four tensors of different dtypes, including a scalar and an empty one.
struct Sample {
  std::vector<std::byte> w = iota_bytes(2 * 3 * 4, 1), h = iota_bytes(5 * 2, 50),
                         s = iota_bytes(8, 99), e;
  std::vector<TensorData> tensors() const {
    return {{"model.w", DType::kF32, {2, 3}, w},
            {"model.h", DType::kBF16, {5}, h},
            {"step", DType::kI64, {}, s},
            {"empty", DType::kU8, {0, 4}, e}};
  }
};

}  // namespace

TEST_CASE("safetensors: one file round-trips dtype, shape, bytes and metadata, zero-copy",
          "[safetensors]") {
  TempDir dir;
  Sample sample;
  SafetensorsWriteOptions opts;
  opts.metadata = {{"format", "pt"}, {"note", "hello"}};
  write_safetensors(dir.str(), sample.tensors(), opts);
  REQUIRE(listing(dir.path) == std::vector<std::string>{"model.safetensors"});

  SafetensorsFile f((dir.path / "model.safetensors").string());
  CHECK(f.metadata() == opts.metadata);
  REQUIRE(f.size() == 4);
  // Data order is the caller's order, and the header is padded to 8 bytes.
  CHECK(f.header().data_offset_bytes % 8 == 0);
  for (size_t i = 0; i < 4; ++i) CHECK(f.tensor(i).name == sample.tensors()[i].name);
  for (const auto& t : sample.tensors()) {
    TensorView v = f.get(t.name);
    CHECK(v.dtype == t.dtype);
    CHECK(std::vector<int64_t>(v.shape.begin(), v.shape.end()) == t.shape);
    CHECK(same_bytes(v.bytes, t.bytes));
  }
  CHECK(f.get("step").numel() == 1);
  CHECK(f.get("empty").numel() == 0);
  // Zero copy: views are consecutive pointers into one mapping, not copies.
  CHECK(f.tensor(1).bytes.data() == f.tensor(0).bytes.data() + f.tensor(0).bytes.size());
  CHECK_FALSE(f.find("missing").has_value());
  CHECK_THROWS_WITH(f.get("missing"), Catch::Contains("missing") && Catch::Contains("model.safetensors"));
}

TEST_CASE("safetensors: sharded write gives numbered shards and an index and lookup spans shards",
          "[safetensors]") {
  TempDir dir;
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorData> tensors;
  for (int i = 0; i < 5; ++i) data.push_back(iota_bytes(400, i));
  for (int i = 0; i < 5; ++i)
    tensors.push_back({"layers." + std::to_string(i) + ".weight", DType::kF32, {10, 10}, data[i]});
  SafetensorsWriteOptions opts;
  opts.max_shard_bytes = 900;  // two 400-byte tensors per shard: 3 shards
  write_safetensors(dir.str(), tensors, opts);
  CHECK(listing(dir.path) == std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                      "model-00002-of-00003.safetensors",
                                                      "model-00003-of-00003.safetensors",
                                                      "model.safetensors.index.json"});
  auto index = nlohmann::json::parse(read_text(dir.path / "model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 2000);
  CHECK(index["weight_map"]["layers.4.weight"] == "model-00003-of-00003.safetensors");

  SafetensorsCheckpoint ckpt(dir.str());
  CHECK(ckpt.files().size() == 3);
  REQUIRE(ckpt.size() == 5);
  for (int i = 0; i < 5; ++i) {
    CHECK(ckpt.names()[i] == tensors[i].name);
    CHECK(same_bytes(ckpt.get(tensors[i].name).bytes, data[i]));
  }
  CHECK(std::string(ckpt.get("layers.2.weight").file).ends_with("model-00002-of-00003.safetensors"));
  CHECK_THROWS_WITH(ckpt.get("nope"), Catch::Contains("nope") && Catch::Contains("index.json"));

  SECTION("a tensor listed in the index but missing from its shard names both") {
    auto idx = index;
    idx["weight_map"]["ghost"] = "model-00002-of-00003.safetensors";
    std::ofstream(dir.path / "model.safetensors.index.json") << idx.dump();
    CHECK_THROWS_WITH(SafetensorsCheckpoint(dir.str()),
                      Catch::Contains("'ghost'") && Catch::Contains("model-00002-of-00003"));
  }
  SECTION("a shard the index names that does not exist") {
    auto idx = index;
    idx["weight_map"]["layers.0.weight"] = "model-00009-of-00009.safetensors";
    std::ofstream(dir.path / "model.safetensors.index.json") << idx.dump();
    CHECK_THROWS_WITH(SafetensorsCheckpoint(dir.str()), Catch::Contains("model-00009-of-00009"));
  }
  SECTION("a tensor in two shards") {
    fs::copy_file(dir.path / "model-00001-of-00003.safetensors",
                  dir.path / "model-00002-of-00003.safetensors",
                  fs::copy_options::overwrite_existing);
    auto idx = index;
    idx["weight_map"].erase("layers.2.weight");
    idx["weight_map"].erase("layers.3.weight");
    idx["weight_map"]["layers.1.weight"] = "model-00002-of-00003.safetensors";
    std::ofstream(dir.path / "model.safetensors.index.json") << idx.dump();
    CHECK_THROWS_WITH(SafetensorsCheckpoint(dir.str()),
                      Catch::Contains("'layers.0.weight'") && Catch::Contains("in both"));
  }
}

TEST_CASE("safetensors: a plan that fits one shard is written as one file without index",
          "[safetensors]") {
  TempDir dir;
  Sample sample;
  SafetensorsWriteOptions opts;
  opts.max_shard_bytes = 1 << 20;
  write_safetensors(dir.str(), sample.tensors(), opts);
  CHECK(listing(dir.path) == std::vector<std::string>{"model.safetensors"});
  CHECK(SafetensorsCheckpoint(dir.str()).size() == 4);
}

TEST_CASE("safetensors: the writer streams chunks in any order and nothing appears before finish",
          "[safetensors]") {
  TempDir dir;
  auto big = iota_bytes(4096, 3), small = iota_bytes(6, 9);
  {
    SafetensorsWriter w(dir.str(), {{"big", DType::kF32, {1024}}, {"small", DType::kBF16, {3}}});
    w.write("small", small);
    for (size_t chunk = 4; chunk-- > 0;)  // back to front, 1 KiB at a time
      w.write("big", std::span(big).subspan(chunk * 1024, 1024), chunk * 1024);
    // Only temp files so far: a crash here leaves no model.safetensors.
    for (const auto& name : listing(dir.path)) CHECK(name.starts_with(".model.safetensors.tmp-"));
    CHECK_THROWS_WITH(w.write("big", std::span(big).subspan(0, 8), 4092),
                      Catch::Contains("'big'") && Catch::Contains("4096 bytes"));
    w.finish();
  }
  CHECK(listing(dir.path) == std::vector<std::string>{"model.safetensors"});
  SafetensorsFile f((dir.path / "model.safetensors").string());
  CHECK(same_bytes(f.get("big").bytes, big));
  CHECK(same_bytes(f.get("small").bytes, small));
}

TEST_CASE("safetensors: an abandoned or incomplete write leaves the old file untouched",
          "[safetensors]") {
  TempDir dir;
  Sample sample;
  write_safetensors(dir.str(), sample.tensors());
  std::string before = read_text(dir.path / "model.safetensors");
  auto other = iota_bytes(64, 0);
  {
    SafetensorsWriter w(dir.str(), {{"x", DType::kF32, {16}}, {"y", DType::kF32, {16}}});
    w.write("x", other);
    CHECK_THROWS_WITH(w.finish(), Catch::Contains("'y'") && Catch::Contains("0 of its 64 bytes"));
  }  // destroyed unfinished
  {
    SafetensorsWriter w(dir.str(), {{"x", DType::kF32, {16}}});
    w.write("x", other);
  }  // destroyed before finish()
  CHECK(listing(dir.path) == std::vector<std::string>{"model.safetensors"});
  CHECK(read_text(dir.path / "model.safetensors") == before);
}

TEST_CASE("safetensors: the writer refuses bad specs before writing anything", "[safetensors]") {
  TempDir dir;
  using Specs = std::vector<TensorSpec>;
  CHECK_THROWS_WITH(SafetensorsWriter(dir.str(), Specs{{"a", DType::kF32, {2}}, {"a", DType::kF32, {2}}}),
                    Catch::Contains("'a' given twice"));
  CHECK_THROWS_WITH(SafetensorsWriter(dir.str(), Specs{{"n", DType::kF32, {2, -1}}}),
                    Catch::Contains("'n'") && Catch::Contains("negative"));
  CHECK_THROWS_WITH(SafetensorsWriter(dir.str(), Specs{{"o", DType::kF64, {int64_t{1} << 61, 4}}}),
                    Catch::Contains("'o'") && Catch::Contains("overflows"));
  CHECK_THROWS_WITH(SafetensorsWriter(dir.str(), Specs{{"__metadata__", DType::kU8, {1}}}),
                    Catch::Contains("reserved"));
  CHECK_THROWS_WITH(SafetensorsWriter((dir.path / "nowhere").string(), Specs{}),
                    Catch::Contains("nowhere") && Catch::Contains("does not exist"));
  CHECK(listing(dir.path).empty());
}

TEST_CASE("safetensors: each malformed corpus file gives a clear error", "[safetensors]") {
  const fs::path corpus = fs::path(STRIDER_IO_CORPUS_DIR) / "safetensors";
  struct Case { const char* file; std::vector<const char*> says; };
  const std::vector<Case> cases = {
      {"bad_truncated", {"data_offsets", "past the data area", "truncated"}},
      {"bad_overlap", {"'b'", "overlap", "'a'"}},
      {"bad_lying_dtype", {"'x'", "F64", "need 16 bytes", "spans 8"}},
      {"bad_unknown_dtype", {"'x'", "'dtype'", "F33"}},
      {"bad_huge_header", {"header length 200000000", "limit of 100000000"}},
      {"bad_header_past_eof", {"header length 4096", "past the end", "16 bytes"}},
      {"bad_not_json", {"not valid JSON"}},
      {"bad_not_object", {"does not start with '{'"}},
      {"bad_negative_shape", {"'neg'", "'shape'", "negative", "-2"}},
      {"bad_offset_out_of_range", {"'far'", "data_offsets", "[8, 24]", "16 bytes"}},
      {"bad_gap", {"'b'", "no gaps", "begin at 8"}},
      {"bad_trailing_bytes", {"end at data offset 8", "data area is 16 bytes"}},
      {"bad_shape_overflow", {"'big'", "overflows"}},
      {"bad_metadata_value", {"__metadata__", "'k'", "must be a string"}},
      {"bad_too_small", {"3 bytes", "too small"}},
  };
  for (const auto& c : cases) {
    const std::string path = (corpus / (std::string(c.file) + ".safetensors")).string();
    INFO(path);
    REQUIRE(fs::exists(path));
    try {
      SafetensorsFile f(path);
      FAIL("opened without error");
    } catch (const Error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find(path) != std::string::npos);  // names the file
      for (const char* s : c.says) CHECK(what.find(s) != std::string::npos);
    }
  }
  CHECK(SafetensorsFile((corpus / "valid_small.safetensors").string()).size() == 4);
  CHECK(SafetensorsFile((corpus / "valid_empty.safetensors").string()).size() == 0);
}

namespace {
// This process's resident memory (VmRSS), in bytes.
uint64_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}
}  // namespace

TEST_CASE("safetensors: a read tensor's pages leave the process's memory and read back the same",
          "[safetensors]") {
  TempDir dir;
  constexpr size_t kBytes = size_t{64} << 20;  // 64 MiB: far above the noise of the rest of the process
  const std::vector<std::byte> big = iota_bytes(kBytes, 3), small = iota_bytes(100, 5);
  const std::vector<TensorData> tensors{{"big", DType::kU8, {int64_t(kBytes)}, big},
                                        {"small", DType::kU8, {100}, small}};
  write_safetensors(dir.str(), tensors);
  SafetensorsCheckpoint ck(dir.str());
  const TensorView v = ck.get("big");
  const uint64_t before = rss_bytes();
  CHECK(same_bytes(v.bytes, big));  // touches every page of the tensor
  const uint64_t read = rss_bytes();
  CHECK(read >= before + kBytes * 9 / 10);
  ck.release_pages(v);
  CHECK(rss_bytes() <= before + kBytes / 10);
  CHECK(same_bytes(v.bytes, big));  // read again from the file: unchanged
  CHECK(same_bytes(ck.get("small").bytes, small));  // a neighbour sharing a released page too
  // A range outside the mapping is refused, not advised.
  CHECK_FALSE(ck.files()[0]->release_pages(TensorView{.bytes = std::span<const std::byte>(big)}));
}
