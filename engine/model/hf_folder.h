// Hugging Face checkpoints in and out, one block at a time.
//
// HfCheckpointReader opens a checkpoint (model.safetensors, or shards with
// model.safetensors.index.json) and checks it against a ModelSpec before the
// caller touches any state: every tensor the spec's blocks need is present,
// with exactly the layout's shape and a dtype we convert (F32, BF16, F16), and
// nothing unexpected is there (a checkpoint of another model must not load
// silently). Then read_block() fills one block's flat fp32 buffer, into host
// memory or into a staging buffer bound for NVMe.
//
// A mixture-of-experts layer's experts are one fused tensor each in strider's
// layout, as transformers holds them in memory (mlp.experts.gate_up_proj
// [E, 2I, H], mlp.experts.down_proj [E, H, I]); on the Hub, and in what
// save_pretrained writes, they are a tensor per expert and projection
// (Qwen3-MoE: mlp.experts.<e>.gate_proj/up_proj/down_proj.weight; Mixtral:
// block_sparse_moe.experts.<e>.w1/w3/w2.weight and block_sparse_moe.gate.weight).
// The reader takes either; the writer writes the Hub's (hub_parts).
//
// HfCheckpointWriter streams blocks, in any order, into a checkpoint that
// transformers' from_pretrained loads: tensors in state_dict order, bf16 or
// fp32, sharded like save_pretrained's max_shard_size, config.json last.
// Nothing appears under a final name before finish().
//
// Plain C++ over host/ and io/: no torch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model/model_spec.h"
#include "host/dtype.h"
#include "host/param_layout.h"
#include "io/safetensors.h"

namespace strider {

class ParamStore;

// IEEE binary16 bits -> float, exact (every half is a float): subnormals
// kept, Inf stays Inf, NaN keeps its sign and payload.
float f16_to_float(uint16_t h);

// One tensor of a checkpoint file that holds part of a layout slot: its
// name, shape, and first element within the slot.
struct FilePart {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset_elems = 0;
};
// How the Hub's checkpoints hold slot `slot` of `spec`'s layouts: the slot
// itself, or a mixture-of-experts tensor's parts per expert.
std::vector<FilePart> hub_parts(const ModelSpec& spec, const TensorSlot& slot);

class HfCheckpointReader {
 public:
  // `path`: a checkpoint directory, a .safetensors file or an *.index.json.
  // Throws Error listing every problem (missing, mis-shaped, unsupported
  // dtype, unknown tensor), each naming the tensor and the checkpoint.
  HfCheckpointReader(const std::string& path, const ModelSpec& spec);

  int64_t num_blocks() const { return static_cast<int64_t>(layouts_.size()); }
  const ParamLayout& layout(int64_t block) const;

  // Fills `master` (layout(block).total_elems() floats) with the block's
  // tensors at the layout's offsets, converted to fp32; padding is zeroed.
  // Each tensor's file pages leave this process's RSS once read (a second
  // read maps them again), so a load holds one tensor of the file at a time,
  // not the whole file.
  void read_block(int64_t block, std::span<float> master) const;

  // For host-resident stores: every block's master from the checkpoint, then
  // its compute copy. Throws, before writing anything, when the store's
  // layouts differ from the spec's or a block's state is not on the host.
  void load_into(ParamStore& store) const;

  const std::string& path() const { return path_; }
  // The dtype most of the model's tensors are stored in (F32, BF16 or F16):
  // what a saved copy keeps unless asked otherwise.
  DType dtype() const;
  // Tensors in the checkpoint that were accepted and not loaded (a tied
  // lm_head.weight, rotary inv_freq buffers).
  const std::vector<std::string>& ignored() const { return ignored_; }
  size_t num_tensors() const { return checkpoint_.size(); }

 private:
  std::string path_;
  SafetensorsCheckpoint checkpoint_;
  std::vector<ParamLayout> layouts_;
  struct Part {
    size_t offset_elems;  // within the slot
    TensorView view;
  };
  std::vector<std::vector<std::vector<Part>>> views_;  // per block, per layout slot: the tensors it reads
  std::vector<std::string> ignored_;
};

struct HfWriteOptions {
  DType dtype = DType::kBF16;    // of every tensor written: kBF16 or kF32
  uint64_t max_shard_bytes = 0;  // 0: one model.safetensors; else shards + index
};

class HfCheckpointWriter {
 public:
  // `config_json`: the config.json text to publish (normally the original's);
  // "dtype" (and "torch_dtype" where present) are set to match options.dtype.
  // Throws when it is not a JSON object or describes another model than
  // `spec`. Creates `out_dir` if needed.
  HfCheckpointWriter(std::string out_dir, const ModelSpec& spec, std::string_view config_json,
                     HfWriteOptions options = {});

  // Writes block `block`'s tensors from its flat fp32 buffer; each block
  // exactly once, in any order. fp32 -> bf16 rounds to nearest even.
  void write_block(int64_t block, std::span<const float> master);

  // Makes the tensor files durable and renames them into place (index last),
  // removes stale shards or index of an earlier save into the same directory,
  // then writes config.json. Throws naming a block never written.
  void finish();

  // Final file names (relative to the output directory), config.json last.
  std::vector<std::string> file_names() const;
  // The files of an earlier save that finish() removed (their names).
  const std::vector<std::string>& removed() const { return removed_; }

 private:
  std::string out_dir_;
  HfWriteOptions options_;
  std::string config_text_;
  std::vector<ParamLayout> layouts_;
  std::vector<std::string> block_names_;
  std::vector<bool> written_;
  std::vector<std::vector<std::vector<FilePart>>> parts_;  // per block, per slot: the tensors it writes (hub_parts)
  std::optional<SafetensorsWriter> writer_;
  std::vector<std::string> removed_;
  bool finished_ = false;
};

// The model files of a transformers checkpoint in `dir` (model.safetensors,
// its shards model-NNNNN-of-NNNNN.safetensors and their index), sorted; none
// when `dir` does not exist.
std::vector<std::string> model_files_in(const std::string& dir);

// `model` as a local path: itself when it exists; a Hugging Face Hub id
// ("org/name") as the snapshot the local cache holds ($HF_HUB_CACHE, else
// $HF_HOME/hub, else ~/.cache/huggingface/hub: models--org--name/, the
// snapshot refs/main names, else the only one). Throws, naming where it
// looked and how to download it, when neither. `what` names the option.
std::string resolve_model_path(const std::string& model, std::string_view what = "--model");

}  // namespace strider
