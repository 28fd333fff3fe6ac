#include "gpu/device/cost_model.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>

#include "host/error.h"

namespace strider {
namespace {

constexpr double kGiB = double(size_t{1} << 30);

// ---- presets ------------------------------------------------------------------
// Each number says where it comes from. "Assumption" marks a judgement that a
// measurement on the real machine should replace (override it with key=value).

CostModel rtx4090() {
  CostModel m;
  m.name = "rtx4090";
  // NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: 165.2 TFLOP/s peak
  // BF16 tensor with FP32 accumulate, dense (330.4 with sparsity).
  m.peak_tflops = 165.2;
  // The same whitepaper: 330.3 TFLOP/s FP16 tensor with FP16 accumulate, dense.
  m.fp16_accumulate_tflops = 330.3;
  // Assumption: big bf16 GEMMs sustain ~75-85% of peak on Ada, but a block's
  // forward/backward also runs attention, norms, RoPE and elementwise kernels;
  // single-GPU fine-tuning reports land at 40-55% MFU. We take 0.5.
  m.mfu = 0.5;
  // Assumption: an op is one block's closure (tens of kernels) enqueued ahead of
  // the GPU; what remains visible is a few kernel-boundary gaps, ~10 µs per op.
  m.compute_latency_us = 10;
  // 24 GiB board (nvidia-smi: 24564 MiB) less ~0.5 GiB for the CUDA context
  // and cuBLAS workspace.
  m.device_memory_bytes = (size_t{47} << 30) / 2;  // 23.5 GiB
  // PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s raw per direction;
  // packet overheads leave ~26; CUDA bandwidthTest with pinned memory reports
  // 24-26 GB/s on 4090 boards. Full duplex.
  m.h2d_gbps = 25;
  m.d2h_gbps = 25;
  // Assumption: cudaMemcpyAsync from pinned memory takes ~5-10 µs to its first
  // byte (the flat part of a bandwidthTest size sweep).
  m.copy_latency_us = 10;
  m.shared_bus = false;
  // A workstation CPU: a 16-core desktop part (AMD Ryzen 9 7950X class, AVX-512)
  // on dual-channel DDR5-5600 = 89.6 GB/s theoretical, ~70 GB/s sustained
  // (STREAM triad).
  m.cpu = "16-core workstation CPU (Ryzen 9 7950X class), dual-channel DDR5-5600";
  m.cpu_cores = 16;
  m.cpu_mem_gbps = 70;
  // One PCIe 4.0 x4 NVMe (e.g. Samsung 990 PRO datasheet: 7.45 GB/s read,
  // 6.9 GB/s write sequential). Writes past the SLC cache sustain less: 5.
  m.nvme_read_gbps = 7;
  m.nvme_write_gbps = 5;
  return m;
}

CostModel h200() {
  CostModel m;
  m.name = "h200";
  // NVIDIA H200 datasheet (SXM): 1,979 TFLOP/s BF16 tensor "with sparsity", so
  // 989 dense.
  m.peak_tflops = 989;
  // Assumption: tuned large-scale H100/H200 training reports 38-45% BF16 MFU
  // (e.g. the Llama 3 paper); one block at a time with small micro-batches
  // fills the larger GPU less easily than a 4090. We take 0.4.
  m.mfu = 0.4;
  m.compute_latency_us = 10;  // assumption, as for the 4090
  // 141 GB HBM3e (nvidia-smi: 143771 MiB = 140.4 GiB) less the CUDA context:
  // about 139 GiB free at start-up, as measured on this project's H200.
  m.device_memory_bytes = size_t{139} << 30;
  // PCIe 5.0 x16: 32 GT/s x 16 x 128/130 = 63 GB/s raw per direction; pinned
  // copies measure ~50-55 GB/s. Full duplex.
  m.h2d_gbps = 50;
  m.d2h_gbps = 50;
  m.copy_latency_us = 10;  // assumption, as for the 4090
  m.shared_bus = false;
  // A server CPU socket: 48 cores (Xeon Platinum 8468 class), 8-12 channels
  // DDR5-4800 = 307-461 GB/s theoretical; assume ~280 GB/s sustained with
  // NUMA-local pinned memory.
  m.cpu = "48-core server socket (Xeon Platinum 8468 class), 8-12 channels DDR5-4800";
  m.cpu_cores = 48;
  m.cpu_mem_gbps = 280;
  // One PCIe 5.0 x4 enterprise NVMe: datasheets list ~14 GB/s read, ~10 GB/s
  // write sequential; assume ~85% of that for our O_DIRECT I/O: 12 / 8.
  m.nvme_read_gbps = 12;
  m.nvme_write_gbps = 8;
  return m;
}

// The other GPUs people fine-tune on: each its vendor's published dense BF16
// tensor rate (FP32 accumulate), its memory, its PCIe generation; the host
// around it as rtx4090's workstation (consumer boards) or h200's server
// (data-centre boards), with the same assumptions named there.
CostModel like(CostModel (*host)(), const char* name, double peak_tflops, double board_gib, int pcie_gen) {
  CostModel m = host();
  m.name = name;
  m.peak_tflops = peak_tflops;
  m.fp16_accumulate_tflops = 0;  // the data-centre parts: one rate (a GeForce part sets its own)
  // The board's memory less ~0.5 GiB for the CUDA context and cuBLAS workspace (assumption, as for the 4090).
  m.device_memory_bytes = size_t((board_gib - 0.5) * kGiB);
  // Pinned copies over x16: ~25 GB/s per direction on PCIe 4.0, ~50 on 5.0 (as measured for the 4090 and H200).
  m.h2d_gbps = m.d2h_gbps = pcie_gen >= 5 ? 50 : 25;
  return m;
}
// NVIDIA Ampere GA102 whitepaper: RTX 3090, 71 TFLOP/s FP16/BF16 tensor with
// FP32 accumulate, dense (142 sparse); 24 GB GDDR6X; PCIe 4.0.
// With FP16 accumulate: 142 dense (the same whitepaper).
CostModel rtx3090() {
  CostModel m = like(rtx4090, "rtx3090", 71, 24, 4);
  m.fp16_accumulate_tflops = 142;
  return m;
}
// NVIDIA RTX Blackwell whitepaper: RTX 5090, 209.5 TFLOP/s FP16/BF16 tensor
// with FP32 accumulate, dense (419 sparse); 32 GB GDDR7; PCIe 5.0.
// Assumption: FP16 accumulate at twice that, 419 dense, as the Ampere and
// Ada GeForce whitepapers give their parts.
CostModel rtx5090() {
  CostModel m = like(rtx4090, "rtx5090", 209.5, 32, 5);
  m.fp16_accumulate_tflops = 419;
  return m;
}
// NVIDIA A100 datasheet: 312 TFLOP/s BF16 tensor dense (624 sparse); 40 or
// 80 GB HBM2(e); PCIe 4.0 to the host (SXM4 boards too).
CostModel a100_40gb() {
  CostModel m = like(h200, "a100-40gb", 312, 40, 4);
  m.mfu = 0.45;  // assumption: between the 4090's 0.5 and the H200's 0.4 (a smaller GPU to fill)
  return m;
}
CostModel a100_80gb() {
  CostModel m = a100_40gb();
  m.name = "a100-80gb";
  m.device_memory_bytes = size_t((80 - 0.5) * kGiB);
  return m;
}
// NVIDIA L40S datasheet: 362.05 TFLOP/s BF16 tensor dense (733 sparse); 48 GB
// GDDR6; PCIe 4.0.
CostModel l40s() {
  CostModel m = like(h200, "l40s", 362.05, 48, 4);
  m.mfu = 0.45;  // assumption, as for the A100
  return m;
}
// NVIDIA H100 datasheet (SXM): 1,979 TFLOP/s BF16 tensor with sparsity, 989
// dense; 80 GB HBM3; PCIe 5.0 to the host.
CostModel h100() { return like(h200, "h100", 989, 80, 5); }

struct Preset {
  const char* name;
  CostModel (*make)();
};
constexpr Preset kPresets[] = {{"rtx3090", rtx3090},     {"rtx4090", rtx4090},     {"rtx5090", rtx5090},
                               {"a100-40gb", a100_40gb}, {"a100-80gb", a100_80gb}, {"l40s", l40s},
                               {"h100", h100},           {"h200", h200}};

std::string preset_list() {
  std::string s;
  for (const Preset& p : kPresets) s += fmt::format("{}\"{}\"", s.empty() ? "" : ", ", p.name);
  return s;
}

// ---- overrides ----------------------------------------------------------------

enum class ValueKind { kRate, kLatency, kFraction, kBool, kCount };

// What a machine can physically be, per key: a rate of 1e-30 GB/s or 1e30
// TFLOP/s is a typo, and a prediction from it ("0 tokens/s, 3e31 s/step") a
// nonsense answer, so an override outside is refused by name. Generous on
// both sides: a slow disk's 0.01 GB/s and a cluster's collective both fit.
struct Range {
  double lo, hi;
};
constexpr Range kTflops{1e-4, 1e5}, kGbps{1e-4, 1e5}, kMicros{0, 1e8} /* up to 100 s */, kParamsPerS{1e3, 1e13},
    kGib{1e-4, 1e6}, kCores{1, 1e5}, kFraction{0, 1} /* and above 0, by its kind */, kBool{0, 1};

struct Key {
  const char* name;
  ValueKind kind;
  Range range;
  const char* help;
  void (*set)(CostModel&, double);
};

constexpr Key kKeys[] = {
    {"peak_tflops", ValueKind::kRate, kTflops, "dense bf16 peak TFLOP/s", [](CostModel& m, double v) { m.peak_tflops = v; }},
    {"fp16_accumulate_tflops", ValueKind::kRate, kTflops, "dense fp16 peak TFLOP/s with fp16 accumulation (--matmul-accumulate fp16)",
     [](CostModel& m, double v) { m.fp16_accumulate_tflops = v; }},
    {"mfu", ValueKind::kFraction, kFraction, "sustained fraction of peak (0, 1]", [](CostModel& m, double v) { m.mfu = v; }},
    {"compute_latency_us", ValueKind::kLatency, kMicros, "fixed µs per launched op",
     [](CostModel& m, double v) { m.compute_latency_us = v; }},
    {"memory_gib", ValueKind::kRate, kGib, "usable device memory, GiB (the default budget)",
     [](CostModel& m, double v) { m.device_memory_bytes = static_cast<size_t>(v * kGiB); }},
    {"h2d_gbps", ValueKind::kRate, kGbps, "host -> device GB/s", [](CostModel& m, double v) { m.h2d_gbps = v; }},
    {"d2h_gbps", ValueKind::kRate, kGbps, "device -> host GB/s", [](CostModel& m, double v) { m.d2h_gbps = v; }},
    {"copy_latency_us", ValueKind::kLatency, kMicros, "fixed µs per copy", [](CostModel& m, double v) { m.copy_latency_us = v; }},
    {"shared_bus", ValueKind::kBool, kBool, "1: H2D and D2H share one half-duplex bus; 0: full duplex (PCIe)",
     [](CostModel& m, double v) { m.shared_bus = v != 0; }},
    {"cpu_cores", ValueKind::kCount, kCores, "cores the CPU AdamW runs on", [](CostModel& m, double v) { m.cpu_cores = v; }},
    {"cpu_mem_gbps", ValueKind::kRate, kGbps, "host memory GB/s (sustained): bounds the CPU AdamW and what GPUs' copies share",
     [](CostModel& m, double v) { m.cpu_mem_gbps = v; }},
    {"cpu_adam_core_params_per_s", ValueKind::kRate, kParamsPerS, "the fp32 AdamW kernel's parameters/s on one core",
     [](CostModel& m, double v) { m.cpu_adam_core_params_per_s = v; }},
    {"cpu_q8_core_params_per_s", ValueKind::kRate, kParamsPerS, "the q8 AdamW kernel's parameters/s on one core",
     [](CostModel& m, double v) { m.cpu_q8_core_params_per_s = v; }},
    {"cpu_adam_params_per_s", ValueKind::kRate, kParamsPerS,
     "sets the fp32 AdamW's parameters/s: cpu_mem_gbps to 28 bytes each, cores unbounded",
     [](CostModel& m, double v) { m.set_adam_params_per_s(v); }},
    {"nvme_read_gbps", ValueKind::kRate, kGbps, "NVMe read GB/s", [](CostModel& m, double v) { m.nvme_read_gbps = v; }},
    {"nvme_write_gbps", ValueKind::kRate, kGbps, "NVMe write GB/s", [](CostModel& m, double v) { m.nvme_write_gbps = v; }},
    {"collective_gbps", ValueKind::kRate, kGbps, "GB/s of one data-parallel rank's part of a collective",
     [](CostModel& m, double v) { m.collective_gbps = v; }},
    {"collective_latency_us", ValueKind::kLatency, kMicros, "fixed µs per collective between ranks",
     [](CostModel& m, double v) { m.collective_latency_us = v; }},
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

double parse_value(const Key& key, std::string_view text) {
  if (key.kind == ValueKind::kBool) {
    if (text == "1" || text == "true") return 1;
    if (text == "0" || text == "false") return 0;
    throw Error(fmt::format("cost model: {}={} is not a boolean; use 0, 1, true or false", key.name, text));
  }
  double v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  STRIDER_CHECK(ec == std::errc() && ptr == text.data() + text.size() && std::isfinite(v),
                "cost model: {}={} is not a number ({})", key.name, text, key.help);
  switch (key.kind) {
    case ValueKind::kRate:
      STRIDER_CHECK(v > 0, "cost model: {}={} must be > 0 ({})", key.name, text, key.help);
      break;
    case ValueKind::kLatency:
      STRIDER_CHECK(v >= 0, "cost model: {}={} must be >= 0 ({})", key.name, text, key.help);
      break;
    case ValueKind::kFraction:
      STRIDER_CHECK(v > 0 && v <= 1, "cost model: {}={} must be in (0, 1] ({})", key.name, text, key.help);
      break;
    case ValueKind::kCount:
      STRIDER_CHECK(v >= 1 && v == std::floor(v), "cost model: {}={} must be a whole number >= 1 ({})", key.name,
                    text, key.help);
      break;
    case ValueKind::kBool:
      break;
  }
  STRIDER_CHECK(v >= key.range.lo && v <= key.range.hi,
                "cost model: {}={} is outside [{:g}, {:g}], what a machine can be ({})", key.name, text,
                key.range.lo, key.range.hi, key.help);
  return v;
}
}  // namespace


// ---- CostModel --------------------------------------------------------------------

CostModel CostModel::preset(std::string_view name) {
  for (const Preset& p : kPresets)
    if (name == p.name) return p.make();
  throw Error(fmt::format("cost model: no preset \"{}\"; known presets: {}", name, preset_list()));
}

std::vector<std::string> CostModel::preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

std::vector<std::pair<std::string, std::string>> CostModel::override_keys() {
  std::vector<std::pair<std::string, std::string>> keys;
  for (const Key& k : kKeys) keys.emplace_back(k.name, k.help);
  return keys;
}

void CostModel::apply_override(std::string_view key_value) {
  const size_t eq = key_value.find('=');
  STRIDER_CHECK(eq != std::string_view::npos, "cost model: override \"{}\" is not key=value", key_value);
  const std::string_view key = trim(key_value.substr(0, eq));
  const std::string_view text = trim(key_value.substr(eq + 1));
  for (const Key& k : kKeys) {
    if (key != k.name) continue;
    k.set(*this, parse_value(k, text));
    name += fmt::format(",{}={}", key, text);
    return;
  }
  std::string known;
  for (const Key& k : kKeys) known += fmt::format("{}{}", known.empty() ? "" : ", ", k.name);
  throw Error(fmt::format("cost model: unknown key \"{}\" in \"{}\"; known keys: {}", key, key_value, known));
}

CostModel CostModel::parse(std::string_view spec) {
  const size_t comma = spec.find(',');
  const std::string_view head = trim(spec.substr(0, comma));
  STRIDER_CHECK(!head.empty(), "cost model \"{}\": expected <preset>[,key=value...] with a preset from {}", spec,
                preset_list());
  CostModel m = preset(head);
  std::string_view rest = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
  while (!rest.empty()) {
    const size_t next = rest.find(',');
    const std::string_view item = trim(rest.substr(0, next));
    if (!item.empty()) m.apply_override(item);
    rest = next == std::string_view::npos ? std::string_view{} : rest.substr(next + 1);
  }
  return m;
}

void CostModel::validate() const {
  auto positive = [&](const char* field, double v) {
    STRIDER_CHECK(std::isfinite(v) && v > 0, "cost model \"{}\": {} = {} must be a finite number > 0", name, field,
                  v);
  };
  auto latency = [&](const char* field, double v) {
    STRIDER_CHECK(std::isfinite(v) && v >= 0, "cost model \"{}\": {} = {} must be a finite number >= 0", name, field,
                  v);
  };
  positive("peak_tflops", peak_tflops);
  STRIDER_CHECK(std::isfinite(fp16_accumulate_tflops) && fp16_accumulate_tflops >= 0,
                "cost model \"{}\": fp16_accumulate_tflops = {} must be a finite number >= 0 (0: peak_tflops)", name,
                fp16_accumulate_tflops);
  STRIDER_CHECK(std::isfinite(mfu) && mfu > 0 && mfu <= 1, "cost model \"{}\": mfu = {} must be in (0, 1]", name,
                mfu);
  latency("compute_latency_us", compute_latency_us);
  STRIDER_CHECK(device_memory_bytes > 0, "cost model \"{}\": device_memory_bytes must be > 0", name);
  positive("h2d_gbps", h2d_gbps);
  positive("d2h_gbps", d2h_gbps);
  latency("copy_latency_us", copy_latency_us);
  STRIDER_CHECK(std::isfinite(cpu_cores) && cpu_cores >= 1, "cost model \"{}\": cpu_cores = {} must be >= 1", name,
                cpu_cores);
  positive("cpu_mem_gbps", cpu_mem_gbps);
  positive("cpu_adam_core_params_per_s", cpu_adam_core_params_per_s);
  positive("cpu_q8_core_params_per_s", cpu_q8_core_params_per_s);
  positive("nvme_read_gbps", nvme_read_gbps);
  positive("nvme_write_gbps", nvme_write_gbps);
  positive("collective_gbps", collective_gbps);
  latency("collective_latency_us", collective_latency_us);
}

std::string CostModel::describe() const {
  return fmt::format(
      "cost model {}:\n"
      "  compute  {:.1f} TFLOP/s peak x {:.2f} = {:.1f} TFLOP/s sustained, +{} us per op\n"
      "  memory   {:.1f} GiB usable\n"
      "  PCIe     h2d {} GB/s, d2h {} GB/s, +{} us per copy, {}\n"
      "  host     {}: {:g} cores, memory {:g} GB/s; AdamW fp32 {:.3g} params/s, q8 {:.3g}\n"
      "  NVMe     read {} GB/s, write {} GB/s\n"
      "  ranks    collectives {} GB/s per rank, +{} us each",
      name, peak_tflops, mfu, sustained_tflops(), compute_latency_us, device_memory_bytes / kGiB, h2d_gbps,
      d2h_gbps, copy_latency_us, shared_bus ? "one shared bus" : "full duplex", cpu, cpu_cores, cpu_mem_gbps,
      adam_params_per_s(StateFormat::kFp32), adam_params_per_s(StateFormat::kQ8), nvme_read_gbps, nvme_write_gbps, collective_gbps, collective_latency_us);
}

CostModel CostModel::with_fp16_accumulate() const {
  CostModel m = *this;
  if (fp16_accumulate_tflops > 0) m.peak_tflops = fp16_accumulate_tflops;
  m.fp16_accumulate_tflops = 0;
  m.name += ",fp16-accumulate";
  return m;
}

// 1 TFLOP/s = 1e6 FLOP per µs; 1 GB/s = 1e3 bytes per µs.
double CostModel::compute_us(double flops) const { return compute_latency_us + flops / (sustained_tflops() * 1e6); }
double CostModel::h2d_us(uint64_t bytes) const { return copy_latency_us + static_cast<double>(bytes) / (h2d_gbps * 1e3); }
double CostModel::d2h_us(uint64_t bytes) const { return copy_latency_us + static_cast<double>(bytes) / (d2h_gbps * 1e3); }
double CostModel::adam_params_per_s(StateFormat format) const {
  const double core = format == StateFormat::kQ8 ? cpu_q8_core_params_per_s : cpu_adam_core_params_per_s;
  return std::min(cpu_cores * core, cpu_mem_gbps * 1e9 / adam_bytes_per_param(format));
}
void CostModel::set_adam_params_per_s(double fp32_params_per_s) {
  cpu_mem_gbps = fp32_params_per_s * kAdamBytesPerParam / 1e9;
  cpu_cores = std::max(cpu_cores, std::ceil(fp32_params_per_s / cpu_adam_core_params_per_s));
}
double CostModel::adam_us(uint64_t params, StateFormat format) const {
  return static_cast<double>(params) / adam_params_per_s(format) * 1e6;
}
double CostModel::host_memory_us(uint64_t bytes) const { return static_cast<double>(bytes) / (cpu_mem_gbps * 1e3); }
double CostModel::nvme_read_us(uint64_t bytes) const { return static_cast<double>(bytes) / (nvme_read_gbps * 1e3); }
double CostModel::nvme_write_us(uint64_t bytes) const { return static_cast<double>(bytes) / (nvme_write_gbps * 1e3); }
double CostModel::collective_us(uint64_t bytes) const {
  return collective_latency_us + static_cast<double>(bytes) / (collective_gbps * 1e3);
}

}  // namespace strider
