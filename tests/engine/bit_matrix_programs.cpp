// The step programs' half of bit_matrix: per configuration, one hash of the
// whole compiled program (every field of every operation, the visits'
// layouts, the landing and update indices), training and evaluation. A
// program is a pure function of the placement and the inputs, so these lines
// hold on any machine; a restructuring of the compiler (engine/program/) must
// change none of them, which pins the order of operations the executors and
// the simulator see, not only the trained bits.
#include "tests/engine/bit_matrix_programs.h"

#include <xxhash.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/placement/placement.h"
#include "engine/program/step_program.h"
#include "tests/engine/tiny_model.h"

namespace strider {

namespace {

// The program as text, every field by name: a change of StepOp's
// representation that keeps what it says keeps the text.
std::string dump(const StepProgram& prog) {
  std::string s = fmt::format("visits {} norm {}\n", prog.visits, prog.norm);
  for (const StepOp& o : prog.ops) {
    const OpFields f = fields(o);
    s += fmt::format("{} {} p{} b{} v{} m{} s{} d{} peer{} hand{} slot{} fv{} keep{} rc{} f{} l{} ring{} d2h{} g{} "
                     "os{} sc{} gate{} clip{} us{} ub{} pk{} after",
                     op_name(o.kind), int(o.lane), o.piece, o.block, o.visit, o.micro_batch, o.shard, o.device, f.peer,
                     int(f.hand), f.slot, o.first_of_visit, f.keep, f.recompute, f.first, f.last, f.wait_ring, f.d2h,
                     f.grads, f.over_slices, f.shared_copy, f.gate, f.clip, f.unscale, f.updated_before, f.packed);
    for (int32_t a : o.after) s += fmt::format(" {}", a);
    s += " prev";
    for (int32_t a : o.after_previous) s += fmt::format(" {}", a);
    s += "\n";
  }
  for (const auto& layout : prog.layouts) {
    s += "layout";
    for (const UnitRun& u : layout)
      s += fmt::format(" {}@{}:{}/{}/{}/{}", u.piece, u.unit_at, u.run.at, u.run.block, u.run.n, u.run.range);
    s += "\n";
  }
  s += "landed";
  for (int32_t i : prog.landed) s += fmt::format(" {}", i);
  s += "\nupdated";
  for (int32_t i : prog.updated) s += fmt::format(" {}", i);
  return s + "\n";
}

nlohmann::json mixtral() {
  nlohmann::json c = test::tiny_config(false, 4);
  c["architectures"] = {"MixtralForCausalLM"};
  c.update({{"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"intermediate_size", 24}});
  return c;
}

}  // namespace

ModelSpec ProgramCase::spec() const {
  ModelSpec s = ModelSpec::from_json(model, "tiny");
  return config.lora.empty() ? s : s.with_lora(config.lora, "tiny");
}

std::vector<ProgramCase> program_cases() {
  std::vector<ProgramCase> out;
  auto add = [&](std::string name, const std::function<void(EngineConfig&)>& edit, nlohmann::json model = {},
                 int world = 1) {
    EngineConfig c;
    c.seq = 16;
    c.micro_batch = 1;
    c.accumulation = 2;
    c.compute.dtype = at::kFloat;
    c.nvme_dir = "/nonexistent";  // placement only: nothing is opened
    edit(c);
    out.push_back({std::move(name), model.is_null() ? test::tiny_config(false, 4) : model, c, world});
  };
  for (int64_t K : {2, 3, 4})
    for (int64_t M : {1, 3})
      for (double clip : {0.0, 1.0}) {
        const std::string kmc = fmt::format("K{}-M{}-clip{}", K, M, clip);
        auto base = [=](EngineConfig& c) {
          c.window = K;
          c.accumulation = M;
          c.clip_norm = clip;
        };
        add("plain-" + kmc, base);
        add("shards-tied-" + kmc, [=](EngineConfig& c) { base(c); c.vocab_shard_rows = 40; },
            test::tiny_config(true, 4));
        add("host-kept-logits-" + kmc, [=](EngineConfig& c) {
          base(c);
          c.checkpoints_on_host = true;
          c.saved_blocks = {1, 3};
          c.keep_logits = true;
        });
        add("nvme-" + kmc, [=](EngineConfig& c) {
          base(c);
          c.nvme_blocks = {0, 2, 3, 5};
          c.nvme_compute_blocks = {2, 3};
          c.grad_ring = 1;
        });
        for (int devices : {2, 3}) {
          add(fmt::format("pool{}-", devices) + kmc, [=](EngineConfig& c) {
            base(c);
            c.devices = devices;
            c.vocab_shard_rows = 40;
            c.saved_blocks = {2};
          }, test::tiny_config(true, 4));
          add(fmt::format("pool{}-host-", devices) + kmc, [=](EngineConfig& c) {
            base(c);
            c.devices = devices;
            c.checkpoints_on_host = true;
            c.vocab_shard_rows = 40;
          });
        }
        add("sub-layer-" + kmc, [=](EngineConfig& c) {
          base(c);
          c.mlp_pieces = 3;
          c.checkpoints_on_host = K == 3;
        });
        add("moe-pieces-" + kmc, [=](EngineConfig& c) { base(c); c.mlp_pieces = 2; c.saved_blocks = {2}; }, mixtral());
        add("lora-nf4-" + kmc, [=](EngineConfig& c) {
          base(c);
          c.lora = "r=4,alpha=8,targets=q_proj+v_proj";
          c.base_format = BaseFormat::kNf4;
        });
        add("lora-all-pool2-" + kmc, [=](EngineConfig& c) {
          base(c);
          c.lora = "r=4,alpha=8,targets=all-linear";
          c.devices = 2;
        });
        add("fp16-" + kmc, [=](EngineConfig& c) { base(c); c.compute.dtype = at::kHalf; });
        add("packed-" + kmc, [=](EngineConfig& c) { base(c); c.packed_documents = true; });
        add("2ranks-" + kmc, base, {}, 2);
        add("2ranks-sharded-" + kmc, [=](EngineConfig& c) { base(c); c.state_shards = 2; c.state_shard = 1; }, {}, 2);
        add("2ranks-shared-q8-nvme-" + kmc, [=](EngineConfig& c) {
          base(c);
          c.state_shards = 2;
          c.optimizer_state = StateFormat::kQ8;
          c.compute.dtype = at::kBFloat16;
          c.shared_compute_file = "/dev/shm/unused";
          c.nvme_blocks = {1, 4};
        }, {}, 2);
      }
  return out;
}

int print_programs() {
  int rc = 0;
  for (const ProgramCase& k : program_cases()) {
    try {
      const ModelSpec spec = k.spec();
      const Placement pl = place(spec, k.config);
      const ProgramInputs in = program_inputs(k.config, k.world);
      const std::string text = dump(compile_step(pl, in)) + "eval\n" + dump(compile_eval(pl, in));
      std::printf("program %-40s %016llx\n", k.name.c_str(),
                  static_cast<unsigned long long>(XXH64(text.data(), text.size(), 0)));
      if (const char* dir = std::getenv("STRIDER_PROGRAM_DUMPS")) {  // the texts, to diff a change that moved something
        if (FILE* f = std::fopen((std::string(dir) + "/" + k.name + ".txt").c_str(), "w")) {
          std::fputs(text.c_str(), f);
          std::fclose(f);
        }
      }
    } catch (const std::exception& ex) {
      std::printf("program %-40s error: %s\n", k.name.c_str(), ex.what());
      rc = 1;
    }
  }
  return rc;
}

}  // namespace strider
