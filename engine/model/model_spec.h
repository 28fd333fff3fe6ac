// ModelSpec: a Hugging Face causal LM's architecture, parsed from config.json,
// and what follows from it: the blocks strider slides over (embedding, decoder
// layer i, final norm + LM head), each block's ParamLayout under the
// checkpoint's tensor names, and each block's FLOPs and working memory for a
// micro-batch (used by the planner and the simulator).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/model/lora.h"
#include "gpu/blocks/block_dims.h"
#include "gpu/memory/work_calibration.h"  // WorkCoefficients
#include "host/param_layout.h"

namespace strider {

enum class Arch { kLlama, kQwen2, kQwen3, kMistral, kGranite, kPhi3, kOlmo2, kGemma2, kGemma3, kQwen3Moe, kMixtral, kQwen2Moe };

enum class BlockKind { kEmbedding, kLayer, kHead };

struct BlockRef {
  BlockKind kind;
  int64_t layer = -1;  // for kLayer
};

// Per micro-batch of `batch` sequences of `seq` tokens.
struct BlockCost {
  double forward_flops = 0;        // matmuls and attention, multiply-add = 2
  double backward_flops = 0;       // input and weight gradients (2x forward)
  // Forward work the backward does again even where the layer keeps its
  // activations: a layer with experts recomputes its MLP (gpu/blocks/moe.h), one
  // with soft-capped attention its attention core (gpu/blocks/attention.h). Not in
  // backward_flops: a recomputing backward counts it in forward_flops.
  double backward_recompute_flops = 0;
  int64_t forward_work_bytes = 0;  // peak transient device bytes, no autograd
  int64_t backward_work_bytes = 0; // recompute with autograd + backward
  int64_t output_bytes = 0;        // the block's output (next block's checkpoint)
};

// Whether AdamW's weight decay applies to the tensor `name` (a checkpoint
// name): transformers' Trainer exempts biases and norms by name
// (Trainer.get_decay_parameter_names: "bias", "layernorm", "rmsnorm", a "norm"
// or "*_norm" component), and so does strider unless told otherwise
// (EngineConfig::decay_norms_and_biases).
bool weight_decays(std::string_view name);

// A tensor's values before training, as a model trained from scratch (and a
// new adapter) starts: N(0, 0.02) weights, ones for norms (zeros for
// Gemma's, whose weight is 1 + w: `norm`), zero biases; a
// LoRA adapter as PEFT's default init (init_lora_weights=True): lora_A
// uniform on +-1/sqrt(in) (kaiming_uniform with a = sqrt(5)), lora_B zero,
// so the adapted model starts as the base. One generator per tensor, seeded
// by `seed` and its name: the values do not depend on the block layout or on
// the order tensors are initialised in. Fills `out` (t.numel floats).
void initial_values(const TensorSlot& t, uint64_t seed, std::span<float> out, NormKind norm = NormKind::kLlama);

struct ModelSpec {
  Arch arch = Arch::kLlama;
  std::string arch_name;          // "LlamaForCausalLM", ...
  int64_t layers = 0;
  int64_t max_position = 0;
  bool tie_embeddings = false;
  BlockDims dims;
  // Layers of two kinds (Gemma 3): sliding_layers[l] != 0 where layer l
  // attends within dims.sliding_window with the RoPE `local_rope`; the
  // others attend to every earlier position with dims.rope. Empty: every
  // layer as dims says.
  std::vector<uint8_t> sliding_layers;
  RopeDims local_rope;
  bool slides(int64_t layer) const { return !sliding_layers.empty() && sliding_layers[size_t(layer)] != 0; }
  // Mixture of experts (dims.moe.experts > 0): dense_layers[l] != 0 where
  // layer l's MLP is dense all the same (Qwen3-MoE's mlp_only_layers and
  // decoder_sparse_step), with dims.intermediate; the others route over
  // dims.moe's experts. Empty: every layer as dims says.
  std::vector<uint8_t> dense_layers;
  bool sparse(int64_t layer) const {
    return dims.moe.sparse() && (dense_layers.empty() || dense_layers[size_t(layer)] == 0);
  }
  int64_t sparse_layer_count() const;
  // The block of a layer with the most parameters (layers of one kind hold
  // the same tensors): block 1 unless some layers are sparse and some dense.
  int64_t largest_layer_block() const;
  // The BlockDims whose kept activations (gpu/blocks/blocks.h, LayerSaved) are the
  // largest of its layers': a dense layer's where it has one.
  BlockDims saved_dims() const {
    BlockDims d = dims;
    if (!dense_layers.empty()) d.moe = MoeDims{};
    return d;
  }
  // The load-balancing loss's weight: router_aux_loss_coef where the
  // config's output_router_logits is set (transformers adds the loss then),
  // else 0 (docs/moe.md, "How the engine runs them").
  double router_aux_coef = 0;
  // Layer `layer`'s BlockDims: dims, with its kind's window and RoPE, and
  // no experts where its MLP is dense.
  BlockDims layer_dims(int64_t layer) const;
  // LoRA adapters over a frozen base (engine/model/lora.h); none by default. Set
  // by with_lora, which also gives the blocks their scale (dims.lora_scale).
  LoraSpec lora;
  // This model with the adapters `lora` (LoraSpec::parse's text; empty:
  // none): what an engine configured with EngineConfig::lora trains. Throws
  // naming `source` on bad text, or on train= with tied embeddings.
  ModelSpec with_lora(std::string_view lora, std::string_view source) const;
  // Every member: what a checkpoint's model must match (spec_differences
  // names the fields; this catches one added later that it does not name).
  bool operator==(const ModelSpec&) const = default;

  // Parses a config.json's JSON; `source` names the file in errors.
  static ModelSpec from_json(const nlohmann::json& config, std::string_view source);
  // Reads and parses `path` (a config.json or a directory holding one).
  static ModelSpec from_file(const std::filesystem::path& path);

  // Blocks in forward order: embedding, layers 0..L-1, head.
  int64_t num_blocks() const { return layers + 2; }
  BlockRef block(int64_t i) const;
  std::string block_name(int64_t i) const;  // "embedding", "layer.3", "head"

  // The block's tensors under the checkpoint's names, in a fixed order. With
  // tied embeddings the head holds no weight of its own: it reads the
  // embedding's (the engine keeps that one parameter in both places).
  // Its tensors' decay flags follow weight_decays(). With LoRA a layer's
  // adapters follow its base tensors, and only the adapters (and the
  // modules lora.train names) are trainable.
  ParamLayout layout(int64_t i) const;

  // Throws if batch x seq is past kMaxTokens or a byte count past kMaxBytes.
  // token_tile: the decoder layers' MLP tile in tokens (ComputeOptions), 0 untiled.
  // `work`: the kernel-dependent terms of a layer's working memory, measured
  // on the device that runs it (gpu/memory/work_calibration.h), or the analytic ones.
  // `packed`: the rows pack documents (EngineConfig::packed_documents), each
  // layer's attention masked per row.
  BlockCost cost(int64_t i, int64_t batch, int64_t seq, int64_t vocab_chunk, int dtype_bytes,
                 int64_t token_tile = 0, const WorkCoefficients& work = WorkCoefficients::analytic(),
                 bool packed = false) const;
  // FLOPs of decoder layer `layer`'s attention core (QK^T and PV) for
  // `batch` sequences of `seq`, over the query-key pairs its kernel
  // computes: half the square for causal attention alone (in query tiles
  // too: a tile's earlier keys and its own causal square); where SDPA reads
  // a mask (a window below seq, or `packed` documents), which skips no
  // block, each query tile (gpu/blocks/attention.h, attention_query_tile under
  // `token_tile`; untiled, one) by all the keys it reads, from a window
  // before its first query (or the start) to its last: the whole square
  // untiled; soft-capped attention (gpu/blocks/softcap_attention.h) likewise, in its
  // own tiles. What cost() counts in forward_flops.
  double attention_flops(int64_t layer, int64_t batch, int64_t seq, bool packed = false,
                         int64_t token_tile = 0) const;
  static constexpr int64_t kMaxTokens = int64_t{1} << 40;  // per micro-batch: 8 TiB of ids alone
  static constexpr int64_t kMaxBytes = int64_t{1} << 62;   // any one size: past every machine

  // All parameters, counted once (tied weights once). O(1) in the layers.
  int64_t param_count() const;

  // More parameters than this is no model a machine holds: 1e14 parameters
  // need 1.6 PB of fp32 master weights and Adam state.
  static constexpr int64_t kMaxParams = 100'000'000'000'000;
  // Throws an Error naming `source` unless every dimension is within the
  // bounds from_json enforces and the model has at most kMaxParams
  // parameters. O(1): callers run it before anything loops over the blocks or
  // sizes a buffer (from_json and Plan::make do).
  void check_size(std::string_view source) const;

  // A short human-readable line: "Qwen3ForCausalLM: 2 layers, hidden 64, ...".
  std::string summary() const;
};

}  // namespace strider
