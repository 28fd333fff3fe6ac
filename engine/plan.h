// Plan: before anything is allocated, decide from a model and the machine's
// limits how the sliding window will run, and say why, or refuse with the
// number that would be needed. The engine allocates exactly what the plan
// counted (device buffers beyond ATen's own working memory, host arena), and
// the same numbers drive the cost-model simulator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/engine.h"
#include "engine/model_spec.h"

namespace strider {

enum class CheckpointPlace { kAuto, kDevice, kHost };

struct PlanLimits {
  uint64_t device_bytes = 0;     // the device budget
  uint64_t host_bytes = 0;       // pinned host RAM strider may use; 0: unlimited
  std::string nvme_dir;          // empty: no NVMe tier
  int64_t seq = 1024;
  int64_t micro_batch = 1;
  int64_t accumulation = 1;
  at::ScalarType dtype = at::kBFloat16;
  int64_t vocab_chunk = 8192;
  int64_t window = 0;            // 0: the largest that fits (at most kMaxAutoWindow)
  CheckpointPlace checkpoints = CheckpointPlace::kAuto;
  // Exact global-norm clipping keeps every gradient until the norm is known:
  // NVMe-tier blocks then spill theirs to NVMe (more NVMe space and traffic).
  double clip_norm = 1.0;
  int64_t grad_ring = 3;         // gradient staging slots of the NVMe-tier blocks
  int64_t token_tile = -1;       // tokens per tile in the head and the MLP; -1: the plan chooses, 0: untiled
  int64_t vocab_shard_rows = 0;  // 0: shards no larger than a layer (engine/shards.h)
  bool fp32_grad_transfer = false;  // gradients to the host in fp32 rather than the compute dtype
};

struct Plan {
  static constexpr int64_t kMaxAutoWindow = 4;

  bool feasible = false;
  std::string reason;            // why not, with the numbers (when !feasible)
  int64_t window = 0;            // K
  bool checkpoints_on_host = false;
  std::vector<int64_t> nvme_blocks;
  uint64_t unit_elems = 0, unit_bytes = 0;
  int64_t vocab_shards = 1, shard_rows = 0;  // the embedding's and LM head's vocabulary shards (engine/shards.h)
  int64_t token_tile = 0;                    // tokens per tile in the head and the MLP (0: untiled)
  uint64_t device_buffer_bytes = 0;  // what the engine allocates on the device (units, activations)
  uint64_t device_work_bytes = 0;    // ATen's working memory, estimated from the block costs
  uint64_t device_peak_bytes = 0;    // the two together
  uint64_t host_bytes = 0;           // the pinned arena
  uint64_t nvme_bytes = 0;
  std::vector<std::string> why;      // the decisions, one line each

  static Plan make(const ModelSpec& spec, const PlanLimits& limits);
  // The engine configuration this plan describes (optimizer settings left default).
  EngineConfig engine_config(const PlanLimits& limits) const;
  std::string explain() const;
  nlohmann::json to_json() const;
};

// "24GiB", "512MiB", "1.5GB", "123456" -> bytes; throws naming the text.
uint64_t parse_bytes(const std::string& text);
std::string format_bytes(uint64_t bytes);

}  // namespace strider
