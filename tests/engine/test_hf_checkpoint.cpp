// engine/model/hf_folder: Hugging Face checkpoints into flat fp32 blocks and
// back. Checkpoints are real files written by io's SafetensorsWriter; the
// store is a real PinnedArena + ParamStore.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model/hf_folder.h"
#include "engine/model/model_spec.h"
#include "host/bf16.h"
#include "host/error.h"
#include "host/param_store.h"
#include "host/pinned_arena.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace strider;
using Catch::Matchers::Contains;
using nlohmann::json;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "strider-hfck-XXXXXX").string();
    path = ::mkdtemp(templ.data());
  }
  ~TempDir() { std::error_code ec; fs::remove_all(path, ec); }
  std::string str() const { return path.string(); }
};

// Tiny configs: Llama with biases and an untied head (sizes that are not
// multiples of the 128-element alignment, so every block has padding), and
// Qwen3 with q/k norms and tied embeddings.
const char* kLlamaConfig = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 24,
  "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "vocab_size": 37, "attention_bias": true, "mlp_bias": true,
  "tie_word_embeddings": false, "torch_dtype": "float32", "rms_norm_eps": 1e-05})";
const char* kQwen3Config = R"({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 16,
  "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
  "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 29, "tie_word_embeddings": true})";

ModelSpec spec_of(const char* config) { return ModelSpec::from_json(json::parse(config), "test"); }

// A block's slots by value: ModelSpec::layout() returns a temporary, and a
// range-for over its slots() would dangle.
std::vector<TensorSlot> layout_slots(const ModelSpec& spec, int64_t b) { return spec.layout(b).slots(); }

// One tensor's contents as raw bytes of its dtype.
struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

// Every parameter of `spec`, random, stored as `dtype`. F32 values include
// subnormals and negative zero, so "bit-exact" means something.
std::vector<Tensor> random_model(const ModelSpec& spec, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Tensor> out;
  for (int64_t b = 0; b < spec.num_blocks(); ++b)
    for (const TensorSlot& s : layout_slots(spec, b)) {
      Tensor t{s.name, dtype, s.shape, std::vector<std::byte>(s.numel * dtype_size(dtype))};
      for (size_t i = 0; i < s.numel; ++i) {
        if (dtype == DType::kF32) {
          uint32_t u = rng();
          if ((u & 0x7f800000u) == 0x7f800000u) u &= 0x3fffffffu;  // no Inf/NaN
          if (i == 1) u = 0x80000000u;                             // -0
          if (i == 2) u = 0x00000123u;                             // subnormal
          std::memcpy(t.bytes.data() + 4 * i, &u, 4);
        } else {
          uint16_t h = static_cast<uint16_t>(rng());
          const uint16_t exp_mask = dtype == DType::kBF16 ? 0x7f80 : 0x7c00;
          if ((h & exp_mask) == exp_mask) h &= 0x3fff;
          std::memcpy(t.bytes.data() + 2 * i, &h, 2);
        }
      }
      out.push_back(std::move(t));
    }
  return out;
}

void write_checkpoint(const std::string& dir, const std::vector<Tensor>& tensors,
                      uint64_t max_shard_bytes = 0) {
  std::vector<TensorData> data;
  for (const auto& t : tensors) data.push_back(TensorData{t.name, t.dtype, t.shape, t.bytes});
  SafetensorsWriteOptions o;
  o.max_shard_bytes = max_shard_bytes;
  write_safetensors(dir, data, o);
}

float to_float(DType dtype, const std::byte* p) {
  if (dtype == DType::kF32) { float f; std::memcpy(&f, p, 4); return f; }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

std::vector<Tensor> without(std::vector<Tensor> ts, const std::string& name) {
  std::erase_if(ts, [&](const Tensor& t) { return t.name == name; });
  return ts;
}

// Every block read through `reader`, one flat buffer per block.
std::vector<std::vector<float>> read_all(const HfCheckpointReader& reader) {
  std::vector<std::vector<float>> out;
  for (int64_t b = 0; b < reader.num_blocks(); ++b) {
    out.emplace_back(reader.layout(b).total_elems(), 42.0f);  // sentinel: padding must be zeroed
    reader.read_block(b, out.back());
  }
  return out;
}

// Checks that `blocks` hold exactly `tensors` (converted to fp32) at the
// layout's offsets and zeros everywhere else.
void check_blocks(const ModelSpec& spec, const std::vector<std::vector<float>>& blocks,
                  const std::vector<Tensor>& tensors) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    std::vector<bool> covered(l.total_elems(), false);
    for (const TensorSlot& s : l.slots()) {
      const Tensor& t = *by_name.at(s.name);
      for (size_t i = 0; i < s.numel; ++i) {
        covered[s.offset_elems + i] = true;
        const float want = to_float(t.dtype, t.bytes.data() + i * dtype_size(t.dtype));
        if (!same_bits(blocks[b][s.offset_elems + i], want))
          FAIL(s.name << "[" << i << "] = " << blocks[b][s.offset_elems + i] << ", want " << want);
      }
    }
    for (size_t i = 0; i < l.total_elems(); ++i)
      if (!covered[i] && !same_bits(blocks[b][i], 0.0f)) FAIL(l.block_name() << " padding " << i << " not zero");
  }
}

HfCheckpointReader open(const std::string& path, const ModelSpec& spec) {
  return HfCheckpointReader(path, spec);
}

}  // namespace

TEST_CASE("f16_to_float is exact for all 65536 halves", "[engine][ckpt]") {
  CHECK(f16_to_float(0x3c00) == 1.0f);
  CHECK(f16_to_float(0xc000) == -2.0f);
  CHECK(f16_to_float(0x7bff) == 65504.0f);
  CHECK(f16_to_float(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(std::isinf(f16_to_float(0xfc00)));
  CHECK(std::signbit(f16_to_float(0x8000)));
  CHECK(std::isnan(f16_to_float(0x7e01)));
#ifdef __FLT16_MAX__
  // The compiler's own conversion as the reference.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    _Float16 x;
    const uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&x, &bits, 2);
    const float want = static_cast<float>(x), got = f16_to_float(bits);
    if (std::isnan(want) ? !std::isnan(got) : !same_bits(got, want))
      FAIL("half 0x" << std::hex << h << ": got " << got << ", want " << want);
  }
#endif
}

TEST_CASE("an F32 checkpoint round-trips bit-exactly, sharded, blocks in any order", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  const auto tensors = random_model(spec, DType::kF32, 1);
  TempDir in, out;
  write_checkpoint(in.str(), tensors);
  HfCheckpointReader reader(in.str(), spec);
  const auto blocks = read_all(reader);
  check_blocks(spec, blocks, tensors);

  HfWriteOptions o;
  o.dtype = DType::kF32;
  o.max_shard_bytes = 8000;  // several shards
  HfCheckpointWriter writer(out.str(), spec, kLlamaConfig, o);
  for (int64_t b : {2, 0, 3, 1}) writer.write_block(b, blocks[b]);
  writer.finish();

  SafetensorsCheckpoint written(out.str());
  REQUIRE(written.files().size() > 1);
  REQUIRE(written.size() == tensors.size());
  for (const auto& t : tensors) {
    TensorView v = written.get(t.name);
    CHECK(v.dtype == DType::kF32);
    CHECK(std::vector<int64_t>(v.shape.begin(), v.shape.end()) == t.shape);
    CHECK(std::memcmp(v.bytes.data(), t.bytes.data(), t.bytes.size()) == 0);
  }
  // transformers' state_dict order inside a layer: attention, MLP, norms.
  const auto& names = written.names();
  auto pos = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  CHECK(pos("model.embed_tokens.weight") == 0);
  CHECK(pos("model.layers.0.self_attn.q_proj.weight") < pos("model.layers.0.self_attn.q_proj.bias"));
  CHECK(pos("model.layers.0.self_attn.o_proj.bias") < pos("model.layers.0.mlp.gate_proj.weight"));
  CHECK(pos("model.layers.0.mlp.down_proj.bias") < pos("model.layers.0.input_layernorm.weight"));
  CHECK(pos("model.layers.0.post_attention_layernorm.weight") < pos("model.layers.1.self_attn.q_proj.weight"));
  CHECK(names.back() == "lm_head.weight");

  json config = json::parse(std::ifstream(out.path / "config.json"));
  CHECK(config["dtype"] == "float32");
  CHECK(config["torch_dtype"] == "float32");
  CHECK(config["vocab_size"] == 37);
}

TEST_CASE("BF16 output is float_to_bf16 of the master, and config.json says bfloat16", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  const auto tensors = random_model(spec, DType::kF32, 2);
  TempDir in, out;
  write_checkpoint(in.str(), tensors);
  const auto blocks = read_all(HfCheckpointReader(in.str(), spec));

  HfCheckpointWriter writer(out.str(), spec, kLlamaConfig);  // defaults: BF16, one file
  for (int64_t b = 0; b < spec.num_blocks(); ++b) writer.write_block(b, blocks[b]);
  writer.finish();
  CHECK(fs::exists(out.path / "model.safetensors"));
  CHECK_FALSE(fs::exists(out.path / "model.safetensors.index.json"));
  SafetensorsCheckpoint written(out.str());
  for (int64_t b = 0; b < spec.num_blocks(); ++b)
    for (const TensorSlot& s : layout_slots(spec, b)) {
      TensorView v = written.get(s.name);
      REQUIRE(v.dtype == DType::kBF16);
      for (size_t i = 0; i < s.numel; ++i) {
        uint16_t got;
        std::memcpy(&got, v.bytes.data() + 2 * i, 2);
        if (got != float_to_bf16(blocks[b][s.offset_elems + i])) FAIL(s.name << "[" << i << "]");
      }
    }
  json config = json::parse(std::ifstream(out.path / "config.json"));
  CHECK(config["dtype"] == "bfloat16");
  CHECK(config["torch_dtype"] == "bfloat16");  // present in the original, so overwritten
}

TEST_CASE("BF16 and F16 checkpoints, sharded, load exactly into fp32", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const auto tensors = random_model(spec, dtype, 3);
    TempDir in;
    write_checkpoint(in.str(), tensors, 3000);
    REQUIRE(fs::exists(in.path / "model.safetensors.index.json"));
    check_blocks(spec, read_all(HfCheckpointReader(in.str(), spec)), tensors);
  }
}

TEST_CASE("load_into fills master and the bf16 compute copy of a real ParamStore", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kQwen3Config);
  const auto tensors = random_model(spec, DType::kF32, 4);
  TempDir in;
  write_checkpoint(in.str(), tensors);
  HfCheckpointReader reader(in.str(), spec);

  std::vector<BlockSpec> bs;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) bs.push_back(BlockSpec{spec.layout(b), true});
  PinnedArena arena(ParamStore::bytes_needed(bs, {}), ArenaOptions{LockPolicy::kNone, false, true, "test"});
  ParamStore store(bs, {}, arena);
  reader.load_into(store);
  std::vector<std::vector<float>> masters;
  for (size_t b = 0; b < store.num_blocks(); ++b) {
    masters.emplace_back(store.block(b).master.begin(), store.block(b).master.end());
    for (size_t i = 0; i < masters.back().size(); ++i)
      REQUIRE(store.block(b).compute[i] == float_to_bf16(masters.back()[i]));
  }
  check_blocks(spec, masters, tensors);
}

TEST_CASE("tied embeddings: a stored lm_head and inv_freq buffers are ignored, none is written",
          "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kQwen3Config);
  REQUIRE(spec.tie_embeddings);
  auto tensors = random_model(spec, DType::kBF16, 5);
  tensors.push_back(Tensor{"lm_head.weight", DType::kBF16, {29, 16}, std::vector<std::byte>(29 * 16 * 2)});
  tensors.push_back(Tensor{"model.layers.0.self_attn.rotary_emb.inv_freq", DType::kF32, {4},
                           std::vector<std::byte>(16)});
  TempDir in, out;
  write_checkpoint(in.str(), tensors);
  HfCheckpointReader reader(in.str(), spec);
  CHECK(reader.ignored().size() == 2);
  const auto blocks = read_all(reader);

  HfCheckpointWriter writer(out.str(), spec, kQwen3Config);
  for (int64_t b = 0; b < spec.num_blocks(); ++b) writer.write_block(b, blocks[b]);
  writer.finish();
  SafetensorsCheckpoint written(out.str());
  CHECK(written.size() == tensors.size() - 2);
  CHECK_FALSE(written.find("lm_head.weight").has_value());
  json config = json::parse(std::ifstream(out.path / "config.json"));
  CHECK(config["dtype"] == "bfloat16");
  CHECK_FALSE(config.contains("torch_dtype"));  // not in the original: not added
}

TEST_CASE("a checkpoint that does not match the spec fails on open, naming the tensor", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  const auto good = random_model(spec, DType::kBF16, 6);
  TempDir dir;
  const std::string q = "model.layers.1.self_attn.q_proj.weight";

  SECTION("missing tensor") {
    write_checkpoint(dir.str(), without(good, q));
    CHECK_THROWS_WITH(open(dir.str(), spec), Contains(q) && Contains("missing") && Contains(dir.str()));
  }
  SECTION("wrong shape names both shapes") {
    auto ts = good;
    for (auto& t : ts)
      if (t.name == q) t.shape = {12, 48};  // same bytes, other shape
    write_checkpoint(dir.str(), ts);
    CHECK_THROWS_WITH(open(dir.str(), spec),
                      Contains(q) && Contains("[12, 48]") && Contains("[24, 24]") && Contains(dir.str()));
  }
  SECTION("unsupported dtype") {
    auto ts = good;
    for (auto& t : ts)
      if (t.name == q) { t.dtype = DType::kI16; }
    write_checkpoint(dir.str(), ts);
    CHECK_THROWS_WITH(open(dir.str(), spec), Contains(q) && Contains("I16") && Contains(dir.str()));
  }
  SECTION("unknown tensor") {
    auto ts = good;
    ts.push_back(Tensor{"model.layers.2.mlp.up_proj.weight", DType::kBF16, {2}, std::vector<std::byte>(4)});
    write_checkpoint(dir.str(), ts);
    CHECK_THROWS_WITH(open(dir.str(), spec),
                      Contains("model.layers.2.mlp.up_proj.weight") && Contains("not a parameter"));
  }
  SECTION("an untied model needs its lm_head") {
    write_checkpoint(dir.str(), without(good, "lm_head.weight"));
    CHECK_THROWS_WITH(open(dir.str(), spec), Contains("lm_head.weight") && Contains("missing"));
  }
}

TEST_CASE("validation is up front: a bad last block leaves the store untouched", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  auto tensors = random_model(spec, DType::kF32, 7);
  for (auto& t : tensors)
    if (t.name == "lm_head.weight") t.shape = {1, 37 * 24};  // the head is read last
  TempDir dir;
  write_checkpoint(dir.str(), tensors);

  std::vector<BlockSpec> bs;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) bs.push_back(BlockSpec{spec.layout(b), true});
  PinnedArena arena(ParamStore::bytes_needed(bs, {}), ArenaOptions{LockPolicy::kNone, false, true, "test"});
  ParamStore store(bs, {}, arena);
  std::vector<float> staging(spec.layout(0).total_elems(), 7.0f);
  for (size_t b = 0; b < store.num_blocks(); ++b) std::fill(store.block(b).master.begin(), store.block(b).master.end(), 7.0f);

  auto load = [&] {
    HfCheckpointReader reader(dir.str(), spec);
    reader.read_block(0, staging);
    reader.load_into(store);
  };
  CHECK_THROWS_WITH(load(), Contains("lm_head.weight") && Contains("[1, 888]") && Contains("[37, 24]"));
  CHECK(std::all_of(staging.begin(), staging.end(), [](float x) { return x == 7.0f; }));
  for (size_t b = 0; b < store.num_blocks(); ++b)
    CHECK(std::all_of(store.block(b).master.begin(), store.block(b).master.end(), [](float x) { return x == 7.0f; }));
}

TEST_CASE("the writer publishes nothing before finish() and replaces an earlier save", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  const auto blocks = [&] {
    TempDir in;
    write_checkpoint(in.str(), random_model(spec, DType::kF32, 8));
    return read_all(HfCheckpointReader(in.str(), spec));
  }();
  TempDir out;
  auto visible = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out.path))
      if (e.path().filename().string()[0] != '.') names.push_back(e.path().filename().string());
    return names;
  };

  {  // sharded first
    HfWriteOptions o;
    o.max_shard_bytes = 4000;
    HfCheckpointWriter w(out.str(), spec, kLlamaConfig, o);
    for (int64_t b = 0; b < spec.num_blocks(); ++b) w.write_block(b, blocks[b]);
    CHECK(visible().empty());
    CHECK_THROWS_WITH(w.write_block(1, blocks[1]), Contains("layer.0") && Contains("twice"));
    w.finish();
    CHECK(fs::exists(out.path / "model.safetensors.index.json"));
  }
  {  // then one file into the same directory: the stale index and shards go
    HfCheckpointWriter w(out.str(), spec, kLlamaConfig);
    for (int64_t b = 0; b < spec.num_blocks() - 1; ++b) w.write_block(b, blocks[b]);
    CHECK_THROWS_WITH(w.finish(), Contains("'head'") && Contains("never written"));
  }
  CHECK(fs::exists(out.path / "model.safetensors.index.json"));  // the failed save changed nothing
  {
    HfCheckpointWriter w(out.str(), spec, kLlamaConfig);
    for (int64_t b = 0; b < spec.num_blocks(); ++b) w.write_block(b, blocks[b]);
    w.finish();
  }
  auto names = visible();
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"config.json", "model.safetensors"});
  check_blocks(spec, read_all(HfCheckpointReader(out.str(), spec)),
               [&] {  // what was written: bf16 of the masters
                 std::vector<Tensor> ts;
                 for (int64_t b = 0; b < spec.num_blocks(); ++b)
                   for (const TensorSlot& s : layout_slots(spec, b)) {
                     Tensor t{s.name, DType::kBF16, s.shape, std::vector<std::byte>(2 * s.numel)};
                     for (size_t i = 0; i < s.numel; ++i) {
                       uint16_t h = float_to_bf16(blocks[b][s.offset_elems + i]);
                       std::memcpy(t.bytes.data() + 2 * i, &h, 2);
                     }
                     ts.push_back(std::move(t));
                   }
                 return ts;
               }());
}

TEST_CASE("the writer refuses a config of another model before creating files", "[engine][ckpt]") {
  const ModelSpec spec = spec_of(kLlamaConfig);
  TempDir out;
  CHECK_THROWS_WITH(HfCheckpointWriter(out.str(), spec, kQwen3Config), Contains("Qwen3ForCausalLM"));
  CHECK_THROWS_WITH(HfCheckpointWriter(out.str(), spec, "[1, 2]"), Contains("not a JSON object"));
  CHECK(fs::is_empty(out.path));
}
