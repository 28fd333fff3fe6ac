// CostModel: one machine as prices (the GPU, its PCIe link, the host lanes
// that feed it, NVMe, the ranks' collectives), its named presets and their
// key=value overrides. SimDevice (gpu/device/sim_device.h) places each op at
// these prices on a virtual clock; the plan and the engine's simulated host
// lanes price with the same model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "host/state_format.h"

namespace strider {

// One machine: the GPU, its PCIe link and the host lanes that feed it.
// Units: GB/s are 1e9 bytes per second; TFLOP/s are 1e12 FLOP per second.
struct CostModel {
  std::string name = "custom";  // preset name plus overrides, for messages

  // ---- the GPU ----
  double peak_tflops = 100;  // dense bf16 (and fp16) tensor-core peak with fp32 accumulation (datasheet)
  // Dense fp16 peak with fp16 accumulation (--matmul-accumulate fp16): a
  // GeForce part's is twice its fp32-accumulate rate, a data-centre part's
  // the same. 0: peak_tflops.
  double fp16_accumulate_tflops = 0;
  // This machine with its GEMMs accumulating fp16 in fp16: peak_tflops at that rate.
  CostModel with_fp16_accumulate() const;
  double mfu = 0.5;          // sustained fraction of peak for our block forward/backward ops
  double compute_latency_us = 0;  // fixed cost per launched op (host enqueue, launch gaps)
  size_t device_memory_bytes = size_t{16} << 30;  // usable device memory: the default budget

  // ---- PCIe ----
  double h2d_gbps = 25;          // sustained pinned host -> device
  double d2h_gbps = 25;          // sustained device -> pinned host
  double copy_latency_us = 0;    // fixed cost per copy (cudaMemcpyAsync setup, DMA start)
  // PCIe is full duplex: each direction has its own lanes, so an H2D and a D2H
  // overlap at full rate (false). true models one shared, half-duplex bus:
  // every copy, either way, waits for the previous one.
  bool shared_bus = false;

  // ---- the host (priced by the engine, not by SimDevice) ----
  // The CPU AdamW: each format's kernel runs at its rate per core on
  // cpu_cores cores, or as fast as the memory bus moves its bytes, whichever
  // is slower (adam_params_per_s).
  std::string cpu = "unnamed";            // what the preset assumes, for messages
  double cpu_cores = 16;                  // cores the optimizer's threads run on
  double cpu_mem_gbps = 70;               // sustained memory bandwidth (STREAM triad)
  // The kernels' rates on one core, data in cache so that memory does not
  // bound them: measured on an AMD EPYC core of the Zen 4 design (AVX-512),
  // the rtx4090 preset's Ryzen's, by build/bench/bench_adam --sizes 0.03
  // --threads 1 --reps 20: fp32 2057-2073 M parameters/s, q8 1247-1273 with
  // the VBMI kernel (with --sizes 0.25: 2050-2053 and 1240-1249; the kernel
  // before VBMI's byte permutations printed 1212-1219). An Intel Xeon core
  // (the machine of earlier sessions) gave fp32 1797 and q8 1100, q8 with
  // the kernel before its AVX-512 encode was rewritten. Every preset keeps
  // them.
  // Assumption: its cores run them as fast (a different clock or core
  // scales both).
  double cpu_adam_core_params_per_s = 2.05e9;
  double cpu_q8_core_params_per_s = 1.25e9;
  double nvme_read_gbps = 7;             // optimizer state read back from the NVMe tier
  double nvme_write_gbps = 5;            // optimizer state written to the NVMe tier

  // ---- between data-parallel ranks (priced by the engine) ----
  // What one rank's part of a collective moves per second (its share of a
  // gradient's reduce-scatter; with a compute copy per rank, of the
  // all-gather), and the fixed cost of each collective. On one machine the
  // ranks' collectives go through host memory (Gloo over loopback); between
  // machines, through the network (`strider plan --link` sets them).
  // Assumption for one machine: Gloo over loopback TCP moves ~5-10 GB/s per
  // stream on a current CPU; 6. Override it with a measurement.
  double collective_gbps = 6;
  double collective_latency_us = 50;
  // The host's memory bandwidth: what N GPUs' copies on one machine share.
  double host_memory_gbps() const { return cpu_mem_gbps; }

  // Bytes of memory traffic per parameter of one AdamW step with bf16
  // gradients. fp32: read w, m, v and the gradient; write w, m, v and the bf16
  // compute copy (12+2+12+2). q8: read and write the compute copy, the
  // master's extension byte, m's and v's codes (2 x 5), their groups' scales
  // (2 x 8 bytes per 128), and read the gradient (2).
  static constexpr double kAdamBytesPerParam = 28;
  static constexpr double kQ8AdamBytesPerParam = 12.125;
  static double adam_bytes_per_param(StateFormat format) {
    return format == StateFormat::kQ8 ? kQ8AdamBytesPerParam : kAdamBytesPerParam;
  }
  // The AdamW rate for a format's kernel: min(cores x its rate per core,
  // memory bandwidth / its bytes per parameter).
  double adam_params_per_s(StateFormat format) const;
  // Sets the fp32 rate to a measured figure: the memory bus to what it
  // implies, the cores to not bound it (the q8 rate follows the same bus).
  void set_adam_params_per_s(double fp32_params_per_s);

  // A named machine: "rtx4090", "h200". Unknown names throw, listing the known ones.
  static CostModel preset(std::string_view name);
  static std::vector<std::string> preset_names();
  // "<preset>[,key=value...]", e.g. "h200,h2d_gbps=12,mfu=0.35".
  static CostModel parse(std::string_view spec);
  // Sets one field from "key=value"; an unknown key or a bad value throws naming it.
  void apply_override(std::string_view key_value);
  // The keys apply_override knows, each with a line of help.
  static std::vector<std::pair<std::string, std::string>> override_keys();
  // Throws naming the first field that is not a usable rate (<= 0, NaN) or latency (< 0).
  void validate() const;
  // One line per field, for a plan's printout.
  std::string describe() const;

  // Prices, in microseconds.
  double sustained_tflops() const { return peak_tflops * mfu; }
  double compute_us(double flops) const;
  double h2d_us(uint64_t bytes) const;
  double d2h_us(uint64_t bytes) const;
  double adam_us(uint64_t params, StateFormat format = StateFormat::kFp32) const;
  double host_memory_us(uint64_t bytes) const;  // one pass over host memory (the bus, no compute)
  double nvme_read_us(uint64_t bytes) const;
  double nvme_write_us(uint64_t bytes) const;
  double collective_us(uint64_t bytes) const;
};

}  // namespace strider
