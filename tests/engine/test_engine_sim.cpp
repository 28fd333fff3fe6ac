// The unchanged engine schedule on SimDevice: predictions that respect their
// own lower bound and move to the lane the cost model makes critical.
#include "tests/catch_torch.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "engine/model/builtin.h"
#include "engine/model/model_presets.h"
#include "engine/run/engine.h"
#include "gpu/blocks/blocks.h"  // layer_saved_elems
#include "gpu/device/sim_device.h"  // CostModel

using namespace strider;

namespace {

StepReport predict(const ModelSpec& spec, const std::string& machine, double clip, int64_t window = 2) {
  EngineConfig cfg;
  cfg.seq = 64;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.window = window;
  cfg.clip_norm = clip;
  Engine e(spec, cfg, make_device({.spec = machine, .budget_bytes = 1ull << 30, .record_spans = true}));
  REQUIRE(e.simulated());
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
  StepReport r;
  for (int i = 0; i < 3; ++i) r = e.step(ids.data(), labels.data());
  CHECK(std::isnan(r.loss));
  std::vector<float> buf(spec.layout(0).total_elems());
  CHECK_THROWS_WITH(e.read_state(0, ExtentKind::kMaster, buf), Catch::Contains("simulated"));
  return r;
}

double busiest(const StepReport& r) {
  double m = 0;
  for (const auto& l : r.stats.lanes) m = std::max(m, l.busy_s);
  return m;
}

}  // namespace

TEST_CASE("a predicted AdamW runs at its format's rate: the cores' or the memory bus's", "[engine][sim]") {
  // The optimizer lane's AdamW spans add up to the parameters over
  // CostModel::adam_params_per_s of the run's format: on the workstation's 16
  // cores both formats are memory-bound and q8, moving 12.125 bytes per
  // parameter to fp32's 28, takes 0.43 of the time; on 1 core its slower
  // kernel makes it the longer one.
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  auto adamw_s = [&](const std::string& machine, StateFormat state) {  // the last step's AdamW time
    EngineConfig cfg;
    cfg.seq = 64;
    cfg.micro_batch = 2;
    cfg.window = 2;
    cfg.optimizer_state = state;
    Engine e(spec, cfg, make_device({.spec = "sim:" + machine, .budget_bytes = 1ull << 30, .record_spans = true}));
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    for (int i = 0; i < 2; ++i) e.step(ids.data(), labels.data());
    double s = 0;
    for (const Span& sp : e.timeline().spans())
      if (sp.step == 2 && sp.lane == Lane::kOptimizer && sp.name == "adamw") s += (sp.end_us - sp.begin_us) * 1e-6;
    return s;
  };
  const double params = double(spec.param_count());
  for (const char* machine : {"rtx4090", "rtx4090,cpu_cores=1"}) {
    const CostModel cm = CostModel::parse(machine);
    const double fp32 = adamw_s(machine, StateFormat::kFp32), q8 = adamw_s(machine, StateFormat::kQ8);
    INFO(machine << ": fp32 " << fp32 << " s, q8 " << q8 << " s");
    CHECK(fp32 == Approx(params / cm.adam_params_per_s(StateFormat::kFp32)).epsilon(0.02));
    CHECK(q8 == Approx(params / cm.adam_params_per_s(StateFormat::kQ8)).epsilon(0.02));
    if (cm.cpu_cores > 1) CHECK(q8 / fp32 == Approx(12.125 / 28).epsilon(0.02));
    else CHECK(q8 > fp32);
  }
}

TEST_CASE("a predicted step takes at least the cost model's time for its copies and its FLOPs", "[engine][sim]") {
  // Each lane runs its operations one at a time, so a step lasts at least
  // its H2D bytes at the link's rate, its D2H bytes likewise, and its FLOPs
  // at the sustained rate, whatever overlaps. (Not the busiest lane's busy
  // time: Timeline::stats clips spans to the step, so that bound holds by
  // construction.) A simulator that ran two copies of a lane at once, or
  // priced an op below its bytes or FLOPs, fails here.
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  for (const char* machine : {"rtx4090", "h200"})
    for (double clip : {0.0, 1.0}) {
      INFO(machine << " clip " << clip);
      const CostModel cm = CostModel::preset(machine);
      StepReport r = predict(spec, std::string("sim:") + machine, clip);
      REQUIRE(r.h2d_bytes > 0);
      REQUIRE(r.d2h_bytes > 0);
      REQUIRE(r.stats.flops > 0);
      CHECK(r.step_s >= double(r.h2d_bytes) / (cm.h2d_gbps * 1e9));
      CHECK(r.step_s >= double(r.d2h_bytes) / (cm.d2h_gbps * 1e9));
      CHECK(r.step_s >= r.stats.flops / (cm.sustained_tflops() * 1e12));
      CHECK(busiest(r) <= r.step_s * (1 + 1e-9));
      CHECK(r.tokens_per_s == Approx(double(r.tokens) / r.step_s));
    }
}

TEST_CASE("the critical lane follows the cost model", "[engine][sim]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  // PCIe at 10 MB/s: every step waits on the H2D of 8 blocks twice.
  StepReport pcie = predict(spec, "sim:rtx4090,h2d_gbps=0.01", 0.0);
  CHECK(pcie.stats.critical == Lane::kH2D);
  CHECK(pcie.stats.overlap_efficiency > 0.9);
  // An optimizer at 1M parameters/s: 5.8 s of AdamW per step.
  StepReport opt = predict(spec, "sim:rtx4090,cpu_adam_params_per_s=1e6", 1.0);
  CHECK(opt.stats.critical == Lane::kOptimizer);
  CHECK(opt.step_s > 5.0);
  // A faster bus never makes the step slower.
  CHECK(predict(spec, "sim:rtx4090,h2d_gbps=0.02", 0.0).step_s <= pcie.step_s);
}

TEST_CASE("Llama-3.1-8B on the RTX 4090 preset is compute-bound at batch 8", "[engine][sim]") {
  ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  EngineConfig cfg;
  cfg.seq = 1024;
  cfg.accumulation = 8;
  cfg.window = 2;
  cfg.clip_norm = 0;
  Engine e(spec, cfg, make_device({.spec = "sim:rtx4090", .budget_bytes = 24ull << 30, .record_spans = true}));
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
  StepReport r;
  for (int i = 0; i < 3; ++i) r = e.step(ids.data(), labels.data());
  CHECK(r.stats.critical == Lane::kCompute);
  // 6 * 8.03e9 params * 8192 tokens, x 4/3 for the recompute, at 165 TFLOP/s * 0.5:
  // about 6.4 s of compute; the step is at least that and within 1.5x of it.
  const double compute_s = r.stats.lanes[size_t(Lane::kCompute)].busy_s;
  CHECK(compute_s == Approx(6.3).epsilon(0.1));
  CHECK(r.step_s >= compute_s);
  CHECK(r.step_s < 1.5 * compute_s);
}

TEST_CASE("a gradient ring slot is reused only once its gradients are consumed", "[engine][sim]") {
  // Every block's state on NVMe, a drive at 20 MB/s. With clipping each
  // block's gradients are spilled before their ring slot takes the next
  // block's, so a ring of one slot holds the backward pass behind the spills
  // (and the norm behind the backward), while a slot per block lets it run
  // ahead. Without clipping a slot waits for its block's update, which is
  // pipelined one block behind anyway: a smaller ring is never faster.
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  struct Predicted {
    StepReport report;
    double read_bytes = 0, write_bytes = 0;
  };
  auto run = [&](int64_t ring, double clip) {
    EngineConfig cfg;
    cfg.seq = 64;
    cfg.micro_batch = 2;
    cfg.window = 2;
    cfg.clip_norm = clip;
    cfg.grad_ring = ring;
    for (int64_t b = 0; b < spec.num_blocks(); ++b) cfg.nvme_blocks.push_back(b);
    Engine e(spec, cfg, make_device({.spec = "sim:rtx4090,nvme_write_gbps=0.02,nvme_read_gbps=0.02",
                                     .budget_bytes = 1ull << 30, .record_spans = true}));
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    Predicted p;
    for (int i = 0; i < 2; ++i) p.report = e.step(ids.data(), labels.data());
    for (const Span& sp : e.timeline().spans())  // what step 2's updates moved
      if (sp.step == 2 && sp.lane == Lane::kNvmeRead) p.read_bytes += double(sp.bytes);
      else if (sp.step == 2 && sp.lane == Lane::kNvmeWrite) p.write_bytes += double(sp.bytes);
    return p;
  };
  const int64_t blocks = spec.num_blocks();
  auto busy = [](const Predicted& p, Lane l) { return p.report.stats.lanes[size_t(l)].busy_s; };
  Predicted clip_one = run(1, 1.0), clip_all = run(blocks, 1.0);
  CHECK(busy(clip_one, Lane::kD2H) == Approx(busy(clip_all, Lane::kD2H)));
  CHECK(clip_one.report.step_s > clip_all.report.step_s);
  Predicted plain_one = run(1, 0.0), plain_all = run(blocks, 0.0);
  CHECK(plain_one.report.step_s >= plain_all.report.step_s * (1 - 1e-12));
  // The spill is bf16 gradients, 2 bytes per parameter on top of master, m
  // and v (12): written once and read back once per step.
  CHECK(plain_all.write_bytes == Approx(12.0 * double(spec.param_count())).epsilon(0.02));
  CHECK(plain_all.read_bytes == Approx(plain_all.write_bytes));
  CHECK(clip_all.write_bytes / plain_all.write_bytes == Approx(14.0 / 12.0));
  CHECK(clip_all.read_bytes / plain_all.read_bytes == Approx(14.0 / 12.0));
}

TEST_CASE("compute copies on NVMe: read before each visit of their layer, written back with the state", "[engine][sim]") {
  // Every block's state on NVMe, and the layers' compute copies too: a step
  // reads each layer's copy twice (forward, backward: 2 bytes per parameter
  // each) and writes it once with its state; the drive's reads of the
  // copies and of the state share its time, so a slow drive slows the step.
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  struct Predicted {
    StepReport report;
    double read_bytes = 0, write_bytes = 0, compute_read_bytes = 0;
  };
  auto run = [&](bool compute, const std::string& machine) {
    EngineConfig cfg;
    cfg.seq = 64;
    cfg.micro_batch = 2;
    cfg.window = 3;
    cfg.clip_norm = 1.0;
    for (int64_t b = 0; b < spec.num_blocks(); ++b) cfg.nvme_blocks.push_back(b);
    if (compute)
      for (int64_t b = 1; b <= spec.layers; ++b) cfg.nvme_compute_blocks.push_back(b);
    Engine e(spec, cfg, make_device({.spec = machine, .budget_bytes = 1ull << 30, .record_spans = true}));
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    Predicted p;
    for (int i = 0; i < 3; ++i) p.report = e.step(ids.data(), labels.data());
    for (const Span& sp : e.timeline().spans()) {
      if (sp.step != 2) continue;
      if (sp.lane == Lane::kNvmeRead) p.read_bytes += double(sp.bytes);
      if (sp.lane == Lane::kNvmeWrite) p.write_bytes += double(sp.bytes);
      if (sp.name == std::string("nvme read compute")) p.compute_read_bytes += double(sp.bytes);
    }
    return p;
  };
  double layer_params = 0;
  for (int64_t b = 1; b <= spec.layers; ++b) layer_params += double(spec.layout(b).total_elems());
  const Predicted ram = run(false, "sim:rtx4090"), nvme = run(true, "sim:rtx4090");
  CHECK(ram.compute_read_bytes == 0);
  CHECK(nvme.compute_read_bytes == Approx(2 * 2 * layer_params));
  CHECK(nvme.read_bytes - ram.read_bytes == Approx(2 * 2 * layer_params));
  CHECK(nvme.write_bytes - ram.write_bytes == Approx(2 * layer_params));
  CHECK(nvme.report.step_s >= ram.report.step_s * (1 - 1e-12));
  const Predicted slow_ram = run(false, "sim:rtx4090,nvme_read_gbps=0.05");
  const Predicted slow_nvme = run(true, "sim:rtx4090,nvme_read_gbps=0.05");
  // The drive reads 18 bytes per layer parameter a step instead of 14 (the
  // state and the spilled gradients): the step is read-bound, and slower.
  CHECK(slow_nvme.report.step_s > slow_ram.report.step_s * 1.05);
  CHECK(slow_nvme.report.stats.critical == Lane::kNvmeRead);
}

TEST_CASE("the simulator prices kept activations: less compute, their bytes on both links", "[engine][sim]") {
  // Llama-3.1-8B at batch 8 on the RTX 4090 preset: every layer keeping its
  // projections' outputs spares the recompute of its matmuls (about a
  // quarter of the layers' compute), and moves 78 KB per token and layer out
  // in forward and back in backward, which the links price.
  ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  auto run = [&](bool keep, const std::string& machine) {
    EngineConfig cfg;
    cfg.seq = 1024;
    cfg.accumulation = 8;
    cfg.window = 2;
    cfg.clip_norm = 0;
    cfg.checkpoints_on_host = true;
    if (keep)
      for (int64_t b = 1; b <= spec.layers; ++b) cfg.saved_blocks.push_back(b);
    Engine e(spec, cfg, make_device({.spec = machine, .budget_bytes = 24ull << 30, .record_spans = true}));
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    StepReport r;
    for (int i = 0; i < 3; ++i) r = e.step(ids.data(), labels.data());
    return r;
  };
  const StepReport recompute = run(false, "sim:rtx4090"), kept = run(true, "sim:rtx4090");
  const uint64_t moved = uint64_t(layer_saved_elems(spec.dims, 1024, 2)) * 2 * 8 * uint64_t(spec.layers);
  CHECK(kept.d2h_bytes == recompute.d2h_bytes + moved);
  CHECK(kept.h2d_bytes == recompute.h2d_bytes + moved);
  const double c_re = recompute.stats.lanes[size_t(Lane::kCompute)].busy_s;
  const double c_kept = kept.stats.lanes[size_t(Lane::kCompute)].busy_s;
  CHECK(c_kept < 0.85 * c_re);
  CHECK(kept.stats.lanes[size_t(Lane::kD2H)].busy_s > recompute.stats.lanes[size_t(Lane::kD2H)].busy_s);
  CHECK(kept.step_s < recompute.step_s);
  // On a link at 2 GB/s the same copies make keeping the slower choice.
  const StepReport slow_re = run(false, "sim:rtx4090,h2d_gbps=2,d2h_gbps=2");
  const StepReport slow_kept = run(true, "sim:rtx4090,h2d_gbps=2,d2h_gbps=2");
  CHECK(slow_kept.step_s > slow_re.step_s);
}

TEST_CASE("the host's memory bus fills the time left free before and after what it carries", "[engine][sim][pool]") {
  SimHostMemory bus(10);  // 10 GB/s: 1 MB takes 100 us
  CHECK(bus.reserve(0, 100) == Approx(100));
  CHECK(bus.reserve(200, 50) == Approx(250));
  // Priced later but starting earlier: it takes the gap before [200, 250) and what it needs after.
  CHECK(bus.reserve(50, 200) == Approx(350));  // 100..200 is free (100 us), then 250..350
  CHECK(bus.reserve(0, 10) == Approx(360));    // all of 0..350 is taken: it queues after
}

TEST_CASE("on the host's memory bus a copy goes first, and the optimizer pays for the copies inside its time",
          "[engine][sim][pool]") {
  SimHostMemory bus(10);  // 10 GB/s: 1 MB takes 100 us
  CHECK(bus.reserve_bulk(0, 10000000) == Approx(1000));  // the optimizer holds [0, 1000)
  // A copy inside that time does not queue behind it (a DMA asks for a small
  // part of the bus); a second copy queues behind the first.
  CHECK(bus.reserve_copy(200, 1000000) == Approx(300));
  CHECK(bus.reserve_copy(250, 1000000) == Approx(400));
  CHECK(bus.busy_us() == Approx(1200));  // the 200 us the copies took inside it are owed
  // The optimizer's next job pays them, after its own 100 us.
  CHECK(bus.reserve_bulk(1000, 1000000) == Approx(1300));
  CHECK(bus.busy_us() == Approx(1300));
  // A copy in free time takes it from the optimizer's next job, which fills the gaps around it.
  CHECK(bus.reserve_copy(1500, 1000000) == Approx(1600));
  CHECK(bus.reserve_bulk(1400, 2000000) == Approx(1700));
  CHECK(bus.busy_us() == Approx(1600));
}

TEST_CASE("a simulated pool: its devices' compute overlaps, and the shared host bus slows their copies",
          "[engine][sim][pool]") {
  // Llama-3.1-8B on the rtx4090 preset, the same per-device batch (8
  // micro-batches of one sequence each): a pool of N runs N times the
  // micro-batches. Its devices pipeline them (block b on device b % N,
  // micro-batch by micro-batch), so more devices predict more tokens per
  // second. Their copies share the host's memory bus: on a host with a slow
  // one (cpu_mem_gbps=20) a pool's copies take longer, one device's (its
  // link is its limit; one device has no shared bus) as long as before.
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  auto predict_pool = [&](int n, const std::string& machine) {
    EngineConfig cfg;
    cfg.seq = 1024;
    cfg.micro_batch = 1;
    cfg.accumulation = 8 * n;
    cfg.window = 3;
    cfg.checkpoints_on_host = true;
    cfg.clip_norm = 1.0;
    Engine e(spec, cfg, make_devices({.spec = machine, .budget_bytes = 24ull << 30, .record_spans = true},
                                     std::to_string(n)));
    REQUIRE(e.devices() == n);
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    StepReport r;
    for (int i = 0; i < 3; ++i) r = e.step(ids.data(), labels.data());
    return r;
  };
  const StepReport r_one = predict_pool(1, "sim:rtx4090"), r_four = predict_pool(4, "sim:rtx4090");
  const double one = r_one.tokens_per_s, two = predict_pool(2, "sim:rtx4090").tokens_per_s, four = r_four.tokens_per_s;
  INFO("tokens/s: 1 device " << one << ", 2 " << two << ", 4 " << four);
  CHECK(two > 1.2 * one);
  CHECK(four > 1.2 * two);
  // Never past linear in compute: each of the four devices computes as much
  // per step as the one device does. (Past linear in tokens/s it may be: one
  // device waits for the optimizer at each step's start, and a pool's step,
  // four times the tokens, hides the same optimizer work better.)
  const double one_compute_bound = double(8 * 1024) / r_one.stats.lanes[size_t(Lane::kCompute)].busy_s;
  CHECK(four < 4.0 * one_compute_bound);
  const StepReport slow_one = predict_pool(1, "sim:rtx4090,cpu_mem_gbps=20");
  const StepReport slow_four = predict_pool(4, "sim:rtx4090,cpu_mem_gbps=20");
  auto h2d = [](const StepReport& r) { return r.stats.lanes[size_t(Lane::kH2D)].busy_s; };
  CHECK(h2d(slow_one) == Approx(h2d(r_one)).epsilon(0.01));
  CHECK(h2d(slow_four) > 1.5 * h2d(r_four));
}

TEST_CASE("a simulated pool's host bus carries the optimizer's bytes as well as the copies", "[engine][sim][pool]") {
  // Llama-3.1-8B on 2 rtx4090s: one step's AdamW moves 26 bytes per
  // parameter (fp32 state read and written, bf16 gradients read) and the norm
  // reads each gradient once, all through host memory, which the devices' copies cross too. The
  // bus's busy time is then at least all of them at its 70 GB/s; the copies
  // alone are several times less.
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  EngineConfig cfg;
  cfg.seq = 1024;
  cfg.micro_batch = 1;
  cfg.accumulation = 16;
  cfg.window = 3;
  cfg.checkpoints_on_host = true;
  cfg.clip_norm = 1.0;
  Engine e(spec, cfg, make_devices({.spec = "sim:rtx4090", .budget_bytes = 24ull << 30, .record_spans = true}, "2"));
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
  const StepReport r = e.step(ids.data(), labels.data());
  const SimHostMemory* bus = static_cast<SimDevice&>(e.device(0)).host_memory();
  REQUIRE(bus != nullptr);
  uint64_t optimizer_bytes = 0;
  for (const Span& s : e.timeline().spans())
    if (s.lane == Lane::kOptimizer) optimizer_bytes += s.bytes;
  const double params = double(spec.param_count());
  CHECK(double(optimizer_bytes) >= 28.0 * params);  // AdamW's 26 bytes (state read and written, the gradient read), the norm's 2
  const double copies_us = double(r.h2d_bytes + r.d2h_bytes) / 70e3, optimizer_us = double(optimizer_bytes) / 70e3;
  INFO("bus busy " << bus->busy_us() << " us; copies " << copies_us << " us, optimizer " << optimizer_us << " us");
  CHECK(bus->busy_us() >= 0.999 * (copies_us + optimizer_us));
  CHECK(optimizer_us > 2 * copies_us);
}

