// st_tool: drives io/safetensors and io/token_data from the command line, so
// pytest can check them against the safetensors / numpy reference.
//
//   st_tool dump <file|index.json|dir> [--raw DIR]   JSON: tensors (dtype, shape,
//            bytes, xxh3, file; with --raw, DIR/<i>.bin holds tensor i's bytes)
//   st_tool copy <src> <dst_dir> [--shard-bytes N] [--base NAME]
//            read through SafetensorsCheckpoint, write through SafetensorsWriter
//            (1 MiB chunks, last chunk first)
//   st_tool tok-info <file> [--vocab V]               JSON: the layout
//   st_tool tok-batches <file> --batch B --seq T [--seed S] [--steps N]
//            [--no-shuffle] [--epoch E --cursor C]    one JSON line per batch:
//            inputs, labels, and the state after it
//   st_tool tok-copy <src> <dst>   read, then rewrite through TokenFileWriter
//
// Errors: the message on stderr, exit status 1.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "host/error.h"
#include "io/safetensors.h"
#include "io/token_data.h"

using namespace strider;
using json = nlohmann::ordered_json;

namespace {

// Positional arguments and --key value options (--flag alone gets "1").
struct Args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;
  Args(int argc, char** argv) {
    for (int i = 2; i < argc; ++i) {
      std::string a = argv[i];
      if (a.starts_with("--")) {
        bool has_value = i + 1 < argc && !std::string(argv[i + 1]).starts_with("--");
        opt[a.substr(2)] = has_value ? argv[++i] : "1";
      } else {
        pos.push_back(a);
      }
    }
  }
  const std::string& at(size_t i, const char* what) const {
    STRIDER_CHECK(i < pos.size(), "st_tool: missing argument <{}>", what);
    return pos[i];
  }
  uint64_t num(const std::string& key, uint64_t fallback) const {
    auto it = opt.find(key);
    return it == opt.end() ? fallback : std::stoull(it->second);
  }
};

int dump(const Args& a) {
  SafetensorsCheckpoint ckpt(a.at(0, "path"));
  json out;
  out["files"] = json::array();
  for (const auto& f : ckpt.files()) out["files"].push_back(f->path());
  out["metadata"] = ckpt.files().front()->metadata();
  out["tensors"] = json::object();
  auto raw = a.opt.find("raw");
  for (size_t i = 0; i < ckpt.names().size(); ++i) {
    TensorView v = ckpt.get(ckpt.names()[i]);
    json t;
    t["dtype"] = std::string(dtype_name(v.dtype));
    t["shape"] = std::vector<int64_t>(v.shape.begin(), v.shape.end());
    t["bytes"] = v.bytes.size();
    t["xxh3"] = fmt::format("{:016x}", XXH3_64bits(v.bytes.data(), v.bytes.size()));
    t["file"] = std::filesystem::path(v.file).filename().string();
    if (raw != a.opt.end()) {
      std::string p = (std::filesystem::path(raw->second) / (std::to_string(i) + ".bin")).string();
      std::ofstream(p, std::ios::binary)
          .write(reinterpret_cast<const char*>(v.bytes.data()), static_cast<std::streamsize>(v.bytes.size()));
      t["raw"] = p;
    }
    out["tensors"][std::string(v.name)] = t;
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int copy(const Args& a) {
  SafetensorsCheckpoint src(a.at(0, "src"));
  SafetensorsWriteOptions opts;
  opts.max_shard_bytes = a.num("shard-bytes", 0);
  if (a.opt.count("base")) opts.base_name = a.opt.at("base");
  opts.metadata = src.files().front()->metadata();
  std::vector<TensorSpec> specs;
  for (const auto& name : src.names()) {
    TensorView v = src.get(name);
    specs.push_back({name, v.dtype, std::vector<int64_t>(v.shape.begin(), v.shape.end())});
  }
  SafetensorsWriter w(a.at(1, "dst_dir"), specs, opts);
  constexpr uint64_t kChunk = 1 << 20;
  for (size_t i = 0; i < specs.size(); ++i) {
    auto bytes = src.get(specs[i].name).bytes;
    uint64_t chunks = (bytes.size() + kChunk - 1) / kChunk;
    for (uint64_t c = chunks; c-- > 0;) {
      uint64_t off = c * kChunk;
      w.write(i, bytes.subspan(off, std::min<uint64_t>(kChunk, bytes.size() - off)), off);
    }
  }
  w.finish();
  std::printf("%s\n", json(w.file_names()).dump().c_str());
  return 0;
}

int tok_info(const Args& a) {
  TokenFile f(a.at(0, "file"), a.num("vocab", 0));
  const auto& l = f.layout();
  json out = {{"token_bytes", l.token_bytes}, {"num_tokens", l.num_tokens}, {"flags", l.flags},
              {"num_docs", l.num_docs}, {"vocab_size", l.vocab_size}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int tok_batches(const Args& a) {
  TokenFile f(a.at(0, "file"), a.num("vocab", 0));
  TokenLoaderOptions o;
  o.batch = a.num("batch", 1);
  o.seq = a.num("seq", 8);
  o.seed = a.num("seed", 0);
  o.shuffle = a.opt.count("no-shuffle") == 0;
  TokenLoader loader(f, o);
  if (a.opt.count("epoch") || a.opt.count("cursor"))
    loader.restore({a.num("epoch", 0), a.num("cursor", 0), o.seed, loader.num_windows(), o.seq});
  std::vector<int64_t> in(o.batch * o.seq), lab(o.batch * o.seq), pos(o.batch * o.seq), att(o.batch * o.seq);
  for (uint64_t s = 0, n = a.num("steps", 1); s < n; ++s) {
    const bool padded = loader.next(in, lab, pos, att);
    auto st = loader.state();
    json line = {{"inputs", in}, {"labels", lab}, {"positions", pos}, {"attention", att}, {"padded", padded},
                 {"epoch", st.epoch}, {"cursor", st.cursor}};
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}

int tok_copy(const Args& a) {
  TokenFile f(a.at(0, "src"));
  const auto& l = f.layout();
  TokenWriterOptions o{l.token_bytes, f.has_mask(), l.num_docs > 0 || (l.flags & kTokenFlagDocs),
                       l.vocab_size};
  TokenFileWriter w(a.at(1, "dst"), o);
  auto docs = f.doc_starts();
  const std::vector<uint8_t> mask = f.mask();
  // Pieces between consecutive boundaries; a piece is a document if the file
  // says one starts at its first token.
  std::vector<uint64_t> cuts(docs.begin(), docs.end());
  cuts.push_back(0);
  cuts.push_back(f.size());
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    std::vector<uint32_t> ids;
    for (uint64_t t = cuts[i]; t < cuts[i + 1]; ++t) ids.push_back(f.token(t));
    std::span<const uint8_t> m(mask);
    if (!m.empty()) m = m.subspan(cuts[i], ids.size());
    if (std::binary_search(docs.begin(), docs.end(), cuts[i])) w.append_document(ids, m);
    else w.append(ids, m);
  }
  w.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: st_tool dump|copy|tok-info|tok-batches|tok-copy ...\n");
    return 2;
  }
  const std::string cmd = argv[1];
  try {
    Args a(argc, argv);
    if (cmd == "dump") return dump(a);
    if (cmd == "copy") return copy(a);
    if (cmd == "tok-info") return tok_info(a);
    if (cmd == "tok-batches") return tok_batches(a);
    if (cmd == "tok-copy") return tok_copy(a);
    std::fprintf(stderr, "st_tool: unknown command '%s'\n", cmd.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
