// The step program (engine/program/step_program.h): the shape each pass gives it,
// and the engine running it (the updates in the program's order).
#include <filesystem>
#include <map>
#include <set>

#include "tests/engine/bit_matrix_programs.h"
#include "tests/engine/step_program_helpers.h"

using namespace strider;
using namespace strider::test;

TEST_CASE("every piece lands, is updated and released once, in order", "[engine][program]") {
  const ModelSpec spec = tiny();
  for (double clip : {0.0, 1.0}) {
    const Placement pl = place(spec, config(clip));
    const StepProgram prog = compile_step(pl, {.window = 2, .clip_norm = clip});
    check_order(prog);
    REQUIRE(pl.num_pieces() > 5);  // 3 embedding shards, 3 layers, the norm, 3 LM-head shards
    for (int64_t p = 0; p < pl.num_pieces(); ++p) {
      const int land = index_of(prog, K::kLand, p), sq = index_of(prog, K::kSumSquares, p);
      const int adam = index_of(prog, K::kAdamW, p), up = index_of(prog, K::kUpdated, p);
      REQUIRE(land >= 0);
      CHECK((land < sq && sq < adam && adam < up));
      CHECK(prog.landed[size_t(p)] == land);
      CHECK(prog.updated[size_t(p)] == up);
      CHECK(index_of(prog, K::kSumRanks, p) < 0);  // one process: no collectives
      CHECK(index_of(prog, K::kGather, p) < 0);
    }
    CHECK(count(prog, K::kCheckLoss) == 1);
    CHECK(count(prog, K::kNorm) == 1);
    CHECK(count(prog, K::kReadState) == 0);
    // Every visit: one load, then its operations, the first waiting for the load, the last its release.
    std::map<int64_t, int> load, first, release;
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      const StepOp& o = prog.ops[i];
      if (o.kind == K::kLoad) CHECK(load.emplace(o.visit, int(i)).second);
      if (o.first_of_visit) CHECK(first.emplace(o.visit, int(i)).second);
      if (o.kind == K::kRelease) CHECK(release.emplace(o.visit, int(i)).second);
    }
    REQUIRE(int64_t(load.size()) == prog.visits);
    REQUIRE(first.size() == load.size());
    REQUIRE(release.size() == load.size());
    for (int64_t v = 0; v < prog.visits; ++v) CHECK((load[v] < first[v] && first[v] < release[v]));
  }
}

TEST_CASE("with clipping every AdamW comes after the norm in forward order, and without it each right after its checks",
          "[engine][program]") {
  const ModelSpec spec = tiny();
  SECTION("clipping") {
    const Placement pl = place(spec, config(1.0));
    const StepProgram prog = compile_step(pl, {.window = 2, .clip_norm = 1.0});
    const StepOp& norm = prog.ops[size_t(prog.norm)];
    CHECK(fields(norm).gate);
    CHECK(fields(norm).clip == 1.0);
    int64_t expect = 0;
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      if (prog.ops[i].kind == K::kLand) CHECK(int(i) < prog.norm);
      if (prog.ops[i].kind != K::kAdamW) continue;
      CHECK(int(i) > prog.norm);
      CHECK(prog.ops[i].piece == expect++);  // forward order
    }
    CHECK(expect == pl.num_pieces());
    CHECK(count(prog, K::kCheckGrad) == 0);
  }
  SECTION("no clipping") {
    const Placement pl = place(spec, config(0.0));
    const StepProgram prog = compile_step(pl, {.window = 2});
    CHECK_FALSE(fields(prog.ops[size_t(prog.norm)]).gate);
    CHECK(prog.norm == int(prog.ops.size()) - 1);  // published once every piece is updated
    std::vector<int64_t> order;
    for (const StepOp& o : prog.ops)
      if (o.kind == K::kAdamW) order.push_back(o.piece);
    CHECK(order == pl.landing);
    // Each piece's update follows its own check, before the next piece lands.
    for (size_t i = 0; i + 1 < pl.landing.size(); ++i) {
      const int64_t p = pl.landing[i], next = pl.landing[i + 1];
      CHECK(index_of(prog, K::kCheckGrad, p) < index_of(prog, K::kAdamW, p));
      CHECK(index_of(prog, K::kAdamW, p) < index_of(prog, K::kLand, next));
      CHECK(fields(prog.ops[size_t(index_of(prog, K::kCheckGrad, p))]).updated_before == int64_t(i));
    }
    // The loss is checked once, after the first piece lands and before any update.
    int loss = -1;
    for (size_t i = 0; i < prog.ops.size(); ++i)
      if (prog.ops[i].kind == K::kCheckLoss) loss = int(i);
    CHECK(loss > index_of(prog, K::kLand, pl.landing[0]));
    CHECK(loss < index_of(prog, K::kAdamW, pl.landing[0]));
  }
}

TEST_CASE("a visit's load is issued K-2 visits ahead, into the unit visit - K released", "[engine][program]") {
  const ModelSpec spec = tiny();
  for (int64_t window : {2, 3, 5}) {
    EngineConfig cfg = config(1.0);
    cfg.window = window;
    const StepProgram prog = compile_step(place(spec, cfg), program_inputs(cfg, 1));
    std::map<int64_t, int> load, first, release;
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      const StepOp& o = prog.ops[i];
      if (o.kind == K::kLoad) load[o.visit] = int(i);
      if (o.first_of_visit) first[o.visit] = int(i);
      if (o.kind == K::kRelease) release[o.visit] = int(i);
    }
    REQUIRE(int64_t(first.size()) == prog.visits);
    for (int64_t v = 0; v < prog.visits; ++v) {
      // After visit v - (K - 1) starts (its copies in go first on the h2d
      // stream), before visit v - (K - 2).
      if (v >= window - 2) CHECK(load[v] < first[v - (window - 2)]);
      if (v >= window - 1) CHECK(load[v] > first[v - (window - 1)]);
      if (v >= window) {
        CHECK(load[v] > release[v - window]);
        const StepOp& l = prog.ops[size_t(load[v])];
        CHECK(l.after == std::vector<int32_t>{release[v - window]});
      }
    }
    // Each load waits, in the previous pass, for its pieces' release.
    for (const StepOp& o : prog.ops)
      if (o.kind == K::kLoad) CHECK_FALSE(o.after_previous.empty());
  }
}

TEST_CASE("every visit runs each micro-batch once: forward, head passes, backward", "[engine][program]") {
  const ModelSpec spec = tiny();
  EngineConfig cfg = config(1.0);
  cfg.accumulation = 3;
  const Placement pl = place(spec, cfg);
  const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
  const int64_t M = 3, shards = pl.shards().shards, body = pl.shards().first_of(pl.head);
  CHECK(count(prog, K::kForward) == body * M);
  CHECK(count(prog, K::kBackward) == body * M);
  CHECK(count(prog, K::kHeadLse) == shards * M);
  CHECK(count(prog, K::kHeadGrad) == shards * M);
  CHECK(count(prog, K::kHeadNormBackward) == M);
  CHECK(count(prog, K::kLossOut) == 1);
  CHECK(count(prog, K::kGradsOut) == pl.num_pieces());  // untied: every piece's gradients leave once
  CHECK(count(prog, K::kCheckpointOut) == 0);
  CHECK(count(prog, K::kSaveOut) == 0);
  // The evaluation pass: forward and pass 1 only, nothing leaves but the loss.
  const StepProgram eval = compile_eval(pl, program_inputs(cfg, 1));
  CHECK(count(eval, K::kForward) == body * M);
  CHECK(count(eval, K::kHeadLse) == shards * M);
  CHECK(count(eval, K::kBackward) + count(eval, K::kHeadGrad) + count(eval, K::kGradsOut) == 0);
  CHECK(count(eval, K::kLand) == 0);
  // Tied: the head's share of each embedding shard leaves in fp32 and comes back into its backward.
  const ModelSpec tied = tiny(true);
  const Placement tp = place(tied, cfg);
  const StepProgram tprog = compile_step(tp, program_inputs(cfg, 1));
  CHECK(count(tprog, K::kTiedGradOut) == tp.shards().shards);
  CHECK(count(tprog, K::kTiedGradIn) == tp.shards().shards);
  CHECK(count(tprog, K::kGradsOut) == tp.num_pieces());
}

TEST_CASE("a layer cut into pieces is one visit in its block's layout, and its pieces' gradients leave and land apart",
          "[engine][program]") {
  const ModelSpec spec = tiny();
  EngineConfig cfg = config(1.0);
  const Placement whole = place(spec, cfg);
  cfg.layer_pieces = "layernorm,self_attn+mlp";
  const Placement pl = place(spec, cfg);
  const int64_t layers = spec.num_blocks() - 2;
  REQUIRE(pl.num_pieces() == whole.num_pieces() + layers);
  for (int64_t b = 1; b <= layers; ++b) {
    const std::vector<int64_t> visit = pl.shards().visit_pieces(pl.shards().first_of(b), -1);
    CHECK(visit.size() == 2);
    // The unit holds the block's layout: each range at its own offset, the whole block covered.
    size_t covered = 0;
    for (const UnitRun& u : pl.shards().unit_layout(visit)) {
      CHECK(u.unit_at == u.run.block);
      covered += u.run.n;
    }
    CHECK(covered == pl.layouts[size_t(b)].total_elems());
    // Its gradients: its pieces back to back in the block's own staging.
    CHECK(pl.at(visit[0]).staging_at == 0);
    CHECK(pl.at(visit[1]).staging_at == pl.piece(visit[0]).elems());
  }
  for (const bool clip : {true, false}) {
    cfg.clip_norm = clip ? 1.0 : 0.0;
    const Placement a = place(spec, cfg);
    const StepProgram prog = compile_step(a, program_inputs(cfg, 1));
    check_order(prog);
    EngineConfig one = cfg;
    one.layer_pieces = "";
    const StepProgram base = compile_step(place(spec, one), program_inputs(one, 1));
    // The same visits, computing as often; one more gradient copy, landing, check and update per layer.
    CHECK(prog.visits == base.visits);
    for (K k : {K::kLoad, K::kForward, K::kBackward, K::kGradsToSend, K::kRelease})
      CHECK(count(prog, k) == count(base, k));
    for (K k : {K::kGradsOut, K::kLand, K::kSumSquares, K::kAdamW, K::kUpdated})
      CHECK(count(prog, k) == count(base, k) + layers);
    // Gradients leave in landing order (the ring's slots are handed out in it).
    std::vector<int64_t> out;
    for (const StepOp& o : prog.ops)
      if (o.kind == K::kGradsOut) out.push_back(o.piece);
    CHECK(out == a.landing);
    // A layer's next load waits for both its pieces' updates, and its unit holds the whole block.
    REQUIRE(prog.layouts.size() == size_t(prog.visits));
    for (const StepOp& o : prog.ops)
      if (o.kind == K::kLoad && o.block >= 1 && o.block <= layers) {
        CHECK(o.after_previous.size() == 2);
        size_t covered = 0;
        for (const UnitRun& u : prog.layouts[size_t(o.visit)]) covered += u.run.n;
        CHECK(covered == a.layouts[size_t(o.block)].total_elems());
      }
  }
}

TEST_CASE("host checkpoints add exactly two copies per layer and micro-batch", "[engine][program]") {
  const ModelSpec spec = tiny();
  for (int64_t M : {1, 2, 3}) {
    EngineConfig cfg = config(1.0);
    cfg.accumulation = M;
    const Placement pl = place(spec, cfg);
    const StepProgram off = compile_step(pl, program_inputs(cfg, 1));
    cfg.checkpoints_on_host = true;
    const StepProgram on = compile_step(place(spec, cfg), program_inputs(cfg, 1));
    const int64_t layers = pl.head - 1;
    CHECK(count(on, K::kCheckpointOut) == layers * M);
    CHECK(count(on, K::kCheckpointIn) == layers * M);
    CHECK(on.ops.size() == off.ops.size() + size_t(2 * layers * M));
    // Each layer's input leaves after the block before it and comes back before its backward.
    for (int64_t b = 1; b <= layers; ++b)
      for (int64_t m = 0; m < M; ++m) {
        int out = -1, in = -1, fwd = -1, bwd = -1;
        for (size_t i = 0; i < on.ops.size(); ++i) {
          const StepOp& o = on.ops[i];
          if (o.micro_batch != m) continue;
          if (o.kind == K::kCheckpointOut && o.block == b) out = int(i);
          if (o.kind == K::kCheckpointIn && o.block == b) in = int(i);
          if (o.kind == K::kForward && o.block == b) fwd = int(i);
          if (o.kind == K::kBackward && o.block == b) bwd = int(i);
        }
        CHECK((out < fwd && fwd < in && in < bwd));
      }
  }
}

TEST_CASE("NVMe tiers: state read ahead before each update and written back after it, spills before the norm",
          "[engine][program]") {
  const ModelSpec spec = tiny();
  for (double clip : {0.0, 1.0}) {
    EngineConfig cfg = config(clip);
    cfg.nvme_dir = "/nonexistent";  // placement only: nothing is opened
    cfg.nvme_blocks = {0, 2, 3, 4};  // the embedding's shards, two layers and the head
    cfg.grad_ring = 2;
    const Placement pl = place(spec, cfg);
    const StepProgram prog = compile_step(pl, {.window = 2, .clip_norm = clip});
    check_order(prog);
    int nvme = 0, spills = 0;
    for (int64_t p = 0; p < pl.num_pieces(); ++p) {
      const int read = index_of(prog, K::kReadState, p), write = index_of(prog, K::kWriteState, p);
      const int adam = index_of(prog, K::kAdamW, p), spill = index_of(prog, K::kSpill, p);
      CHECK((read >= 0) == pl.at(p).on_nvme);
      CHECK((write >= 0) == pl.at(p).on_nvme);
      CHECK((spill >= 0) == (clip > 0 && pl.at(p).spills_grads));
      if (spill >= 0) {
        ++spills;
        CHECK(spill < prog.norm);
        const StepOp& r = prog.ops[size_t(read)];
        CHECK(std::find(r.after.begin(), r.after.end(), spill) != r.after.end());
      }
      if (read < 0) continue;
      ++nvme;
      CHECK((read < adam && adam < write));
      CHECK(write < index_of(prog, K::kUpdated, p));
      // ...and after the previous pass's write-back of the same state.
      CHECK(prog.ops[size_t(read)].after_previous == std::vector<int32_t>{write});
    }
    CHECK(nvme > 2);
    CHECK(spills == (clip > 0 ? nvme : 0));  // with clipping, every NVMe piece lands in the ring
    // Two staging slots: at any point at most two reads are ahead of their updates.
    int ahead = 0, most = 0;
    for (const StepOp& o : prog.ops) {
      if (o.kind == K::kReadState) most = std::max(most, ++ahead);
      if (o.kind == K::kAdamW && pl.at(o.piece).on_nvme) --ahead;
    }
    CHECK(most == 2);
  }
}

TEST_CASE("data parallel: the ranks' pass sums every gradient, and sharded state gathers every update",
          "[engine][program]") {
  const ModelSpec spec = tiny();
  SECTION("replicated state") {
    const Placement pl = place(spec, config(1.0));
    const StepProgram prog = compile_step(pl, {.window = 2, .clip_norm = 1.0, .world = 2});
    for (int64_t p = 0; p < pl.num_pieces(); ++p) {
      const int s = index_of(prog, K::kSumRanks, p);
      CHECK((index_of(prog, K::kLand, p) < s && s < index_of(prog, K::kSumSquares, p)));
      CHECK_FALSE(fields(prog.ops[size_t(s)]).over_slices);
      CHECK(prog.ops[size_t(s)].lane == Lane::kCollective);
      CHECK(index_of(prog, K::kGather, p) < 0);
    }
  }
  SECTION("sharded state, on one machine and on several") {
    for (bool shared : {false, true}) {
      EngineConfig cfg = config(1.0);
      cfg.state_shards = 2;
      cfg.state_shard = 1;
      const Placement pl = place(spec, cfg);
      const StepProgram prog = compile_step(pl, {.window = 2, .clip_norm = 1.0, .world = 2, .shared_compute = shared});
      check_order(prog);
      for (int64_t p = 0; p < pl.num_pieces(); ++p) {
        CHECK(fields(prog.ops[size_t(index_of(prog, K::kSumRanks, p))]).over_slices);
        CHECK(fields(prog.ops[size_t(index_of(prog, K::kSumSquares, p))]).over_slices);
        const int g = index_of(prog, K::kGather, p);
        CHECK((index_of(prog, K::kAdamW, p) < g && g < index_of(prog, K::kUpdated, p)));
        CHECK(fields(prog.ops[size_t(g)]).shared_copy == shared);
        CHECK(prog.ops[size_t(g)].lane == Lane::kCollective);
      }
    }
  }
}

TEST_CASE("kept activations add one copy out and one in per kept layer and micro-batch, each in ahead of its backward",
          "[engine][program]") {
  const ModelSpec spec = tiny();
  EngineConfig cfg = config(0.0);
  cfg.saved_blocks = {1, 3};
  cfg.accumulation = 3;
  const Placement pl = place(spec, cfg);
  const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
  CHECK(count(prog, K::kSaveOut) == 2 * 3);
  CHECK(count(prog, K::kFetchSaved) == 2 * 3);
  std::vector<std::pair<int64_t, int64_t>> fetched;
  for (size_t i = 0; i < prog.ops.size(); ++i) {
    const StepOp& o = prog.ops[i];
    if (o.kind == K::kForward) CHECK(fields(o).keep == (o.block == 1 || o.block == 3));
    if (o.kind != K::kFetchSaved) continue;
    fetched.push_back({o.block, o.micro_batch});
    // Its backward comes later and waits for it; the forward's copy out came before.
    int bwd = -1;
    for (size_t j = i + 1; j < prog.ops.size() && bwd < 0; ++j)
      if (prog.ops[j].kind == K::kBackward && prog.ops[j].block == o.block && prog.ops[j].micro_batch == o.micro_batch)
        bwd = int(j);
    REQUIRE(bwd > 0);
    CHECK(fields(prog.ops[size_t(bwd)]).keep);
    const std::vector<int32_t>& a = prog.ops[size_t(bwd)].after;
    CHECK(std::find(a.begin(), a.end(), int32_t(i)) != a.end());
    // Micro-batch 0 during the visit before the backward's; m + 1 during m's.
    if (o.micro_batch == 0) CHECK(o.visit + 1 == prog.ops[size_t(bwd)].visit);
    else CHECK(o.visit == prog.ops[size_t(bwd)].visit);
  }
  CHECK(fetched == std::vector<std::pair<int64_t, int64_t>>{{3, 0}, {3, 1}, {3, 2}, {1, 0}, {1, 1}, {1, 2}});
  CHECK(count(compile_eval(pl, program_inputs(cfg, 1)), K::kFetchSaved) == 0);
  CHECK(count(compile_eval(pl, program_inputs(cfg, 1)), K::kSaveOut) == 0);
}

TEST_CASE("the engine runs its program: the updates land on the timeline in the program's order", "[engine][program]") {
  const ModelSpec spec = tiny();
  for (double clip : {0.0, 1.0}) {
    EngineConfig cfg = config(clip);
    Engine e(spec, cfg, make_device({.spec = "cpu", .record_spans = true, .chaos = {.enabled = true, .seed = 5}}));
    e.init_params(3);
    const test::Batch b = test::batch(cfg.batch(), cfg.seq, spec.dims.vocab, 11);
    e.step(b.ids.data(), b.labels.data());
    e.finish_updates();
    std::vector<int32_t> ran, planned;
    for (const Span& s : e.timeline().spans())
      if (s.name == "adamw") ran.push_back(s.block);
    for (const StepOp& o : e.program().ops)
      if (o.kind == K::kAdamW) planned.push_back(int32_t(o.block));
    CHECK(ran == planned);
    // The same program as the plan's.
    CHECK(e.program().ops.size() == compile_step(place(spec, cfg), program_inputs(cfg, 1)).ops.size());
  }
}

TEST_CASE("one NVMe-tier layer without clipping: each read waits for its own last write-back", "[engine][program]") {
  // With one NVMe piece its state is read back in the next pass from the
  // other staging slot, right after the gradients land: the read must wait
  // for that write, or it finds the extent mid-write.
  const ModelSpec spec = tiny();
  char tmpl[] = "/tmp/strider-program-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::vector<std::vector<float>> trained;
  for (bool nvme : {false, true}) {
    EngineConfig cfg = config(0.0);
    if (nvme) {
      cfg.nvme_dir = tmpl;
      cfg.nvme_blocks = {2};
    }
    Engine e(spec, cfg, make_device({.spec = "cpu", .chaos = {.enabled = true, .seed = 21}}));
    e.init_params(3);
    for (uint32_t s = 0; s < 4; ++s) {
      const test::Batch b = test::batch(cfg.batch(), cfg.seq, spec.dims.vocab, 40 + s);
      e.step(b.ids.data(), b.labels.data());
    }
    std::vector<float> w(spec.layout(2).total_elems());
    e.read_state(2, ExtentKind::kMaster, w);
    trained.push_back(w);
  }
  CHECK(trained[0] == trained[1]);
  std::filesystem::remove_all(tmpl);
}

TEST_CASE("a pool: every visit on its block's device, the head's shards spread, each load just before its visit, "
          "and a hand-off where the device changes",
          "[engine][program][pool]") {
  const ModelSpec spec = tiny(true);
  for (int devices : {2, 3})
    for (bool host_ckpt : {false, true})
      for (int64_t window : {2, 3}) {
        INFO("devices " << devices << " host checkpoints " << host_ckpt << " K " << window);
        EngineConfig cfg = config(1.0);
        cfg.devices = devices;
        cfg.window = window;
        cfg.checkpoints_on_host = host_ckpt;
        cfg.saved_blocks = {2};
        const Placement pl = place(spec, cfg);
        const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
        check_order(prog);
        const int64_t M = cfg.accumulation, S = pl.shards().shards;
        REQUIRE(S == 3);
        // A block's visits on its device; the head's shard s's on the device after shard s - 1's.
        auto device_of = [&](const StepOp& o) {
          return o.block == pl.head ? pl.head_device(o.shard) : pl.block_device(o.block);
        };
        CHECK(pl.head_device(0) == pl.block_device(pl.head));
        for (int64_t s = 1; s < S; ++s) CHECK(pl.head_device(s) == (pl.head_device(s - 1) + 1) % devices);
        // Per device: its visits in order; each op of a visit on its visit's device.
        std::map<int, std::vector<int64_t>> mine;
        std::map<int64_t, int> load, first, release;
        std::map<int64_t, int> visit_device;
        for (size_t i = 0; i < prog.ops.size(); ++i) {
          const StepOp& o = prog.ops[i];
          if (!o.on_device()) continue;
          if (o.kind == K::kLoad) {
            load[o.visit] = int(i);
            visit_device[o.visit] = o.device;
            CHECK(o.device == device_of(o));
          }
          if (o.first_of_visit) first[o.visit] = int(i);
          if (o.kind == K::kRelease) {
            release[o.visit] = int(i);
            mine[o.device].push_back(o.visit);
          }
          if (o.kind == K::kForward || o.kind == K::kBackward || o.kind == K::kHeadLse || o.kind == K::kHeadGrad ||
              o.kind == K::kHeadNormBackward || o.kind == K::kFetchSaved)
            CHECK(o.device == device_of(o));
          if (o.kind == K::kHeadNormBackward) CHECK(o.device == pl.last_head_device());
          if (o.kind != K::kFetchSaved && o.visit >= 0 && visit_device.count(o.visit))
            CHECK(o.device == visit_device[o.visit]);
        }
        CHECK(int64_t(mine.size()) == devices);
        // Each device slides its own window of K units: its visit j loads into the unit of its visit
        // j-K, issued just before the visit (after the pool's visits before it), not K-1 rounds ahead.
        for (const auto& [d, vs] : mine)
          for (size_t j = 0; j < vs.size(); ++j) {
            CHECK(load[vs[j]] < first[vs[j]]);
            if (j >= 1) CHECK(load[vs[j]] > release[vs[j - 1]]);
            for (int64_t other = 0; other < vs[j]; ++other) CHECK(load[vs[j]] > load[other]);
            if (j >= size_t(window))
              CHECK(prog.ops[size_t(load[vs[j]])].after == std::vector<int32_t>{release[vs[j - size_t(window)]]});
            else
              CHECK(prog.ops[size_t(load[vs[j]])].after.empty());
          }
        // Hand-offs: forward, each block boundary whose devices differ moves the input of every
        // micro-batch, each right after its compute, and the head's input goes to every device of its
        // shards; backward, the output gradient of every block whose predecessor runs elsewhere (the
        // embedding's shards once). With host checkpoints, a layer's backward takes its input from the
        // checkpoint the other device wrote. The head's state and hidden gradient pass from shard to
        // shard, its log-sum-exp from the last shard's device to the others.
        std::map<std::pair<int, bool>, int> outs, ins;
        int ckpt_in_from_peer = 0;
        for (const StepOp& o : prog.ops) {
          if (o.kind == K::kHandOut) {
            outs[{int(o.as<HandArgs>().hand), o.as<HandArgs>().grads}]++;
            // Micro-batch by micro-batch: right after its own compute, not the visit's last.
            REQUIRE(o.after.size() == 1);
            CHECK(prog.ops[size_t(o.after[0])].micro_batch == o.micro_batch);
          }
          if (o.kind == K::kHandIn) {
            const HandArgs& h = o.as<HandArgs>();
            ins[{int(h.hand), h.grads}]++;
            CHECK(h.peer >= 0);
            CHECK(h.peer != o.device);
            REQUIRE(o.after.size() == 1);  // the hand-out of the same micro-batch and kind
            const StepOp& out = prog.ops[size_t(o.after[0])];
            REQUIRE(out.kind == K::kHandOut);
            CHECK((out.as<HandArgs>().hand == h.hand && out.as<HandArgs>().grads == h.grads &&
                   out.micro_batch == o.micro_batch && out.device == h.peer));
          }
          if (o.kind == K::kCheckpointIn && fields(o).peer >= 0) ckpt_in_from_peer++;
        }
        int boundaries = 0;  // layers and the embedding: blocks b (1..head-1) whose input comes from another device
        for (int64_t b = 1; b < pl.head; ++b) boundaries += pl.block_device(b) != pl.block_device(b - 1);
        std::set<int> head_devices;
        for (int64_t s = 0; s < S; ++s) head_devices.insert(pl.head_device(s));
        CHECK(int(head_devices.size()) == std::min<int>(devices, int(S)));
        const int head_in = int(head_devices.size()) - int(head_devices.count(pl.block_device(pl.head - 1)));
        const int head_grad_out = pl.last_head_device() != pl.block_device(pl.head - 1);
        auto block = [](bool grads) { return std::pair<int, bool>{int(Hand::kBlock), grads}; };
        auto head = [](Hand h) { return std::pair<int, bool>{int(h), false}; };
        CHECK(outs[block(false)] == (boundaries + (head_in > 0)) * M);
        CHECK(ins[block(false)] == (boundaries + head_in) * M);
        CHECK(ckpt_in_from_peer == (host_ckpt ? boundaries * M : 0));
        CHECK(outs[block(true)] == (boundaries + head_grad_out) * M);
        CHECK(ins[block(true)] == outs[block(true)]);
        CHECK(outs[head(Hand::kHeadState)] == (S - 1) * M);
        CHECK(ins[head(Hand::kHeadState)] == (S - 1) * M);
        CHECK(outs[head(Hand::kHeadGrad)] == (S - 1) * M);
        CHECK(ins[head(Hand::kHeadGrad)] == (S - 1) * M);
        CHECK(outs[head(Hand::kLse)] == M);
        CHECK(ins[head(Hand::kLse)] == int(head_devices.size() - 1) * M);
      }
}

TEST_CASE("an objective past SFT runs once, after every micro-batch's pass 1 and before any pass 2, and a spread "
          "head's log-sum-exp hand-offs carry its coefficients after it", "[engine][program]") {
  using K = StepOpKind;
  for (const ProgramCase& base : program_cases()) {
    if (base.name.rfind("pool", 0) != 0 && base.name.rfind("plain", 0) != 0 && base.name.rfind("shards", 0) != 0)
      continue;
    ProgramCase c = base;
    c.config.objective.objective = "grpo";
    INFO(c.name);
    const Placement pl = place(c.spec(), c.config);
    const StepProgram prog = compile_step(pl, program_inputs(c.config, c.world));
    const StepProgram eval = compile_eval(pl, program_inputs(c.config, c.world));
    CHECK(std::none_of(eval.ops.begin(), eval.ops.end(), [](const StepOp& o) { return o.kind == K::kObjective; }));
    int objective = -1, last_lse = -1, first_grad = -1;
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      const StepOp& o = prog.ops[i];
      if (o.kind == K::kObjective) {
        CHECK(objective < 0);
        objective = int(i);
        CHECK(o.device == pl.last_head_device());
        CHECK(o.micro_batch == -1);
      }
      if (o.kind == K::kHeadLse) last_lse = int(i);
      if (o.kind == K::kHeadGrad && first_grad < 0) first_grad = int(i);
      if (o.kind == K::kHandOut && o.as<HandArgs>().hand == Hand::kLse) {
        REQUIRE(o.after.size() == 1);
        CHECK(prog.ops[size_t(o.after[0])].kind == K::kObjective);
      }
    }
    REQUIRE(objective >= 0);
    CHECK(last_lse < objective);
    CHECK(objective < first_grad);
    // The loss figures leave after it: every pass 2 waits for them.
    for (const StepOp& o : prog.ops)
      if (o.kind == K::kLossOut) CHECK(std::find(o.after.begin(), o.after.end(), objective) != o.after.end());
  }
}

TEST_CASE("every kind of operation has its name and its executor, and some configuration's program holds it",
          "[engine][program]") {
  // op_side's and each executor's switch name every kind (-Werror=switch on
  // the engine's sources): a kind on no side, without a handler, or a host
  // kind without its price in SimUpdater::run, does not build. Here: every
  // kind's name, each operation's side against its lane, and the passes
  // emitting every kind across bit_matrix's configurations
  // (tests/engine/bit_matrix_programs.cpp).
  std::set<std::string> names;
  for (int k = 0; k < kOpKinds; ++k) {
    const auto kind = StepOpKind(k);
    INFO(k);
    CHECK(std::string(op_name(kind)) != "?");
    CHECK(names.insert(op_name(kind)).second);
  }
  std::set<int> emitted;
  std::vector<ProgramCase> cases = program_cases();
  for (const ProgramCase& c : program_cases()) {  // an objective past SFT, not among bit_matrix's SFT cases
    if (c.name.rfind("pool2-K2-M3", 0) != 0) continue;
    cases.push_back(c);
    cases.back().config.objective.objective = "dpo";
  }
  for (const ProgramCase& c : cases) {
    const Placement pl = place(c.spec(), c.config);
    for (const StepProgram& prog : {compile_step(pl, program_inputs(c.config, c.world)),
                                    compile_eval(pl, program_inputs(c.config, c.world))})
      for (const StepOp& o : prog.ops) {
        emitted.insert(int(o.kind));
        CHECK(o.on_device() == (o.lane == Lane::kCompute || o.lane == Lane::kH2D || o.lane == Lane::kD2H ||
                                o.kind == StepOpKind::kReadCompute));
      }
  }
  for (int k = 0; k < kOpKinds; ++k) {
    INFO(op_name(StepOpKind(k)));
    CHECK(emitted.count(k) == 1);
  }
}
