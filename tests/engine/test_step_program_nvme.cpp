// The step program's compute copies on NVMe (engine/program/step_program.h, pass
// "nvme"): each visit of such a layer reads its copy one load ahead into a
// load staging slot; placement refuses what the tier does not hold.
#include "tests/engine/step_program_helpers.h"

#include <map>
#include <vector>

using namespace strider;
using namespace strider::test;

TEST_CASE("compute copies on NVMe: each visit of their layer reads them one load ahead, into the slots in turn",
          "[engine][program][nvme]") {
  const ModelSpec spec = tiny();
  for (int devices : {1, 2})
    for (int64_t window : {2, 3})
      for (double clip : {0.0, 1.0}) {
        INFO("devices " << devices << " K " << window << " clip " << clip);
        EngineConfig cfg = config(clip);
        cfg.devices = devices;
        cfg.window = window;
        cfg.nvme_blocks = {1, 2, 3};
        cfg.nvme_compute_blocks = {1, 3};
        const Placement pl = place(spec, cfg);
        const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
        check_order(prog);
        std::map<int64_t, int> load;  // per visit: its load
        std::vector<int> reads;       // the reads, in order
        for (size_t i = 0; i < prog.ops.size(); ++i) {
          if (prog.ops[i].kind == K::kLoad) load[prog.ops[i].visit] = int(i);
          if (prog.ops[i].kind == K::kReadCompute) reads.push_back(int(i));
        }
        // Layers 1 and 3, forward and backward: four reads, the slots in turn.
        REQUIRE(reads.size() == 4);
        for (size_t k = 0; k < reads.size(); ++k) {
          const StepOp& r = prog.ops[size_t(reads[k])];
          CHECK(fields(r).slot == int(k) % kComputeLoadSlots);
          CHECK((r.block == 1 || r.block == 3));
          CHECK(r.lane == Lane::kNvmeRead);
          // Its visit's load waits for it and takes its slot...
          const StepOp& l = prog.ops[size_t(load.at(r.visit))];
          CHECK(std::count(l.after.begin(), l.after.end(), reads[k]) == 1);
          CHECK(fields(l).slot == fields(r).slot);
          // ...issued right after the load of the read before it (the first:
          // after the step's first load), and the read waits for the
          // previous pass's update and write-back of its pieces.
          const int before = k > 0 ? load.at(prog.ops[size_t(reads[k - 1])].visit) : load.begin()->second;
          CHECK(reads[k] > before);
          CHECK(reads[k] < load.at(r.visit));
          CHECK(r.after_previous.size() == 2);
          CHECK(prog.ops[size_t(r.after_previous[0])].kind == K::kUpdated);
          CHECK(prog.ops[size_t(r.after_previous[1])].kind == K::kWriteState);
        }
        // Every other visit loads from the host's compute copy.
        for (const auto& [v, i] : load)
          if (prog.ops[size_t(i)].block != 1 && prog.ops[size_t(i)].block != 3) CHECK(fields(prog.ops[size_t(i)]).slot < 0);
        // The pieces' compute copies have extents of their own; a layer's sit in its staging slot.
        for (int64_t p = 0; p < pl.num_pieces(); ++p)
          CHECK(pl.at(p).compute_on_nvme == (pl.piece(p).block == 1 || pl.piece(p).block == 3));
        CHECK(pl.compute_load_slot_bytes >= spec.layout(1).total_elems() * 4);
      }
}

TEST_CASE("compute copies on NVMe: refused outside decoder layers, without their state, twice, or with LoRA",
          "[engine][program][nvme]") {
  const ModelSpec spec = tiny();
  EngineConfig cfg = config(0.0);
  cfg.nvme_blocks = {0, 1, 2};
  cfg.nvme_compute_blocks = {0};
  CHECK_THROWS_WITH(place(spec, cfg), Catch::Contains("nvme_compute_blocks: block 0 is not a decoder layer"));
  cfg.nvme_compute_blocks = {3};
  CHECK_THROWS_WITH(place(spec, cfg), Catch::Contains("block 3's optimizer state is in RAM"));
  cfg.nvme_compute_blocks = {1, 1};
  CHECK_THROWS_WITH(place(spec, cfg), Catch::Contains("block 1 listed twice"));
  cfg.nvme_compute_blocks = {1};
  cfg.state_shards = 2;
  CHECK_THROWS_WITH(place(spec, cfg), Catch::Contains("state_shards 2"));
}
