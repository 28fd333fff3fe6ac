// ckpt_tool: the C++ side of tests/python/test_hf_checkpoint.py.
//
//   ckpt_tool roundtrip <in_dir> <out_dir> [--dtype bf16|f32] [--shard-bytes N]
//       Loads the checkpoint in <in_dir> (config.json + safetensors) into a
//       real PinnedArena + ParamStore, block by block, and writes it back to
//       <out_dir> with the original config.json. Prints one JSON line.
//   ckpt_tool check <dir>
//       Validates the checkpoint against its config.json only; prints the
//       model summary, or the error on stderr and exits 1.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/model/hf_folder.h"
#include "engine/model/model_spec.h"
#include "host/error.h"
#include "host/param_store.h"
#include "host/pinned_arena.h"

using namespace strider;
namespace fs = std::filesystem;

namespace {

int usage() {
  std::fputs("usage: ckpt_tool roundtrip <in_dir> <out_dir> [--dtype bf16|f32] [--shard-bytes N]\n"
             "       ckpt_tool check <dir>\n", stderr);
  return 2;
}

// The directory holding config.json: the checkpoint path itself, or the
// directory of a .safetensors / index file.
fs::path model_dir(const fs::path& p) { return fs::is_directory(p) ? p : p.parent_path(); }

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  STRIDER_CHECK(in.good(), "cannot open {}", p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int check(const std::string& path) {
  ModelSpec spec = ModelSpec::from_file(model_dir(path));
  HfCheckpointReader reader(path, spec);
  fmt::print("{}\n{} tensors checked, {} ignored{}\n", spec.summary(), reader.num_tensors(),
             reader.ignored().size(),
             reader.ignored().empty() ? "" : fmt::format(" ({})", fmt::join(reader.ignored(), ", ")));
  return 0;
}

int roundtrip(const std::string& in, const std::string& out, const HfWriteOptions& options) {
  const fs::path dir = model_dir(in);
  const std::string config_text = read_text(dir / "config.json");
  ModelSpec spec = ModelSpec::from_file(dir);
  HfCheckpointReader reader(in, spec);

  std::vector<BlockSpec> blocks;
  for (int64_t i = 0; i < spec.num_blocks(); ++i) blocks.push_back(BlockSpec{spec.layout(i), true});
  StoreOptions store_options;
  ArenaOptions arena_options;
  arena_options.lock = LockPolicy::kPrefer;
  arena_options.name = "ckpt_tool arena";
  PinnedArena arena(ParamStore::bytes_needed(blocks, store_options), arena_options);
  ParamStore store(std::move(blocks), store_options, arena);
  reader.load_into(store);

  HfCheckpointWriter writer(out, spec, config_text, options);
  // Reverse order: the writer must not depend on the order blocks arrive in.
  for (int64_t i = spec.num_blocks() - 1; i >= 0; --i)
    writer.write_block(i, store.block(static_cast<size_t>(i)).master);
  writer.finish();
  fmt::print("{{\"params\": {}, \"blocks\": {}, \"files\": [\"{}\"], \"arena_locked\": {}}}\n",
             store.param_elems(), spec.num_blocks(), fmt::join(writer.file_names(), "\", \""),
             arena.locked());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 2 && args[0] == "check") return check(args[1]);
    if (args.size() >= 3 && args[0] == "roundtrip") {
      HfWriteOptions options;
      for (size_t i = 3; i < args.size(); ++i) {
        if (args[i] == "--dtype" && i + 1 < args.size()) {
          const std::string& d = args[++i];
          STRIDER_CHECK(d == "bf16" || d == "f32", "--dtype must be bf16 or f32, got '{}'", d);
          options.dtype = d == "bf16" ? DType::kBF16 : DType::kF32;
        } else if (args[i] == "--shard-bytes" && i + 1 < args.size()) {
          options.max_shard_bytes = std::stoull(args[++i]);
        } else {
          return usage();
        }
      }
      return roundtrip(args[1], args[2], options);
    }
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_tool: %s\n", e.what());
    return 1;
  }
}
