// `strider finetune --resume` (resume_run.h).
#include "engine/cli/resume_run.h"

#include <fmt/format.h>

#include <string_view>

#include "host/error.h"

namespace strider::cli {

CheckpointSeries::Resumed resume_checkpoint(const FinetuneOptions& o, CheckpointSeries& series, Engine& engine,
                                            const std::string& data_path, const nlohmann::json& data,
                                            int64_t world_now) {
  // --steps is the schedule's total_steps: linear and cosine decay reach 0
  // there, so another --steps changes every later step's learning rate and
  // must be asked for (issue 32); a constant schedule does not use it.
  TrainLoadOptions lo;
  if (engine.config().schedule.shape == LrShape::kConstant) lo.allow_changed.push_back("total_steps");
  bool data_may_change = false, world_may_change = false;
  for (const std::string& f : o.allow_changed) {
    if (f == "data") data_may_change = true;
    else if (f == "world") world_may_change = true;
    else lo.allow_changed.push_back(f);
  }
  CheckpointSeries::Resumed r = [&] {
    try {
      return series.resume(engine, lo, stderr);
    } catch (const CheckpointMismatch& e) {
      if (!e.allowable())
        throw Error(fmt::format("{} (no option lets the model change on resume: its architecture, config.json's "
                                "fields, its LoRA adapters, their base and its format are the checkpoint's; "
                                "--allow-changed names only the engine's other maths settings, data and world)",
                                e.what()));
      const bool steps = std::string_view(e.what()).find("total_steps:") != std::string_view::npos;
      throw Error(fmt::format(
          "{} (on the command line: --allow-changed FIELD[,FIELD...]){}", e.what(),
          steps ? fmt::format(". --steps {} is total_steps: the {} schedule decays the learning rate to 0 there, "
                              "so another --steps changes the learning rate of every step from here on; resume "
                              "with the saved run's --steps, or pass --allow-changed total_steps to stretch or "
                              "shorten its decay",
                              o.steps, o.train.schedule)
                : std::string()));
    }
  }();
  const nlohmann::json& extra = r.extra;
  if (extra.contains("data_file")) {
    const nlohmann::json& was = extra["data_file"];
    const bool same = was.value("bytes", uint64_t{0}) == data["bytes"].get<uint64_t>() &&
                      was.value("xxh3", std::string()) == data["xxh3"].get<std::string>();
    STRIDER_CHECK(same || data_may_change,
                  "--resume: the checkpoint {} was trained on {} ({} bytes, xxh3 {}), but the data now is {} ({} "
                  "bytes, xxh3 {}); resume on the same data, or pass --allow-changed data to continue on this one",
                  r.dir.string(), was.value("path", std::string("?")), was.value("bytes", uint64_t{0}),
                  was.value("xxh3", std::string("?")), data_path, data["bytes"].get<uint64_t>(),
                  data["xxh3"].get<std::string>());
    if (!same) fmt::print("  the data changed ({} -> {}): --allow-changed data\n", was.value("path", ""), data_path);
  }
  // The checkpoint is whole (rank 0 gathered the slices), so any number of
  // ranks loads it, each taking its slice. But the global batch is ranks x
  // --micro-batch x --accumulation: another world size changes the maths of
  // a step, as another --accumulation would, so it must be asked for.
  const int64_t world = extra.value("world", int64_t{1});
  STRIDER_CHECK(world == world_now || world_may_change,
                "--resume: the checkpoint {} was saved by {} rank(s) and this run has {}: its global batch (ranks x "
                "--micro-batch x --accumulation) would change from {} to {} sequences; resume with {} rank(s), or "
                "pass --allow-changed world to go on with {} (the state reshards: each rank loads its slice, and "
                "the data continues where it stopped)",
                r.dir.string(), world, world_now, world * engine.config().batch(), world_now * engine.config().batch(),
                world, world_now);
  if (world != world_now)
    fmt::print("  the world size changed ({} -> {} ranks): --allow-changed world\n", world, world_now);
  return r;
}

}  // namespace strider::cli
