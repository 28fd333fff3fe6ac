#include "engine/checkpoint/series.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <charconv>
#include <fmt/format.h>
#include <utility>

#include "host/error.h"

namespace strider {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kPrefix = "step-";

// The step of a "step-<digits>" (or "step-<digits>.old") name, or -1.
int64_t step_of(const std::string& name) {
  if (!name.starts_with(kPrefix)) return -1;
  std::string_view digits = std::string_view(name).substr(kPrefix.size());
  if (digits.ends_with(".old")) digits.remove_suffix(4);
  int64_t step = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  return ec == std::errc() && end == digits.data() + digits.size() && !digits.empty() ? step : -1;
}

std::string format_gib(uint64_t bytes) { return fmt::format("{:.2f} GiB", double(bytes) / double(1ull << 30)); }

}  // namespace

CheckpointSeries::CheckpointSeries(fs::path root, int keep) : root_(std::move(root)), keep_(keep) {
  STRIDER_CHECK(keep >= 1, "checkpoints to keep: {} must be >= 1", keep);
}

fs::path CheckpointSeries::dir_for(int64_t step) const { return root_ / fmt::format("{}{:08d}", kPrefix, step); }

std::vector<fs::path> CheckpointSeries::list() const {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (fs::exists(root_ / "trainer_state.json", ec)) {
    try {
      found.emplace_back(inspect_training_checkpoint(root_).step, root_);
    } catch (const Error&) {
      found.emplace_back(-1, root_);  // listed, so that resume says why it fails
    }
  }
  if (fs::is_directory(root_, ec))
    for (const auto& entry : fs::directory_iterator(root_, ec)) {
      const std::string name = entry.path().filename().string();
      int64_t step = step_of(name);
      if (step < 0 || !entry.is_directory()) continue;
      // A ".old" twin counts only where the save died between its renames.
      if (name.ends_with(".old") && fs::exists(dir_for(step))) continue;
      // Newest by the step it records, not by its name (a renamed or copied
      // directory); one that cannot say is listed by its name, so that
      // resume says why it fails.
      if (fs::exists(entry.path() / "trainer_state.json", ec)) try {
          step = inspect_training_checkpoint(entry.path()).step;
        } catch (const Error&) {
        }
      found.emplace_back(step, entry.path());
    }
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

uint64_t CheckpointSeries::bytes_needed(const Engine& engine, const TrainCheckpointOptions& options) {
  uint64_t params = 0, trained = 0;
  const ModelSpec& spec = engine.spec();
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    params += l.total_elems();
    for (const TensorSlot& t : l.slots())
      if (t.trainable) trained += t.numel;
  }
  // LoRA: the trained tensors' state only, and the adapter (fp32) as the model.
  const bool lora = spec.lora.enabled();
  const uint64_t state = lora ? trained : params;
  const uint64_t model_bytes = !options.write_model ? 0
                               : lora               ? trained * 4
                                                    : params * (options.model_dtype == DType::kF32 ? 4 : 2);
  // The starting weights in the compute dtype (keep_reference).
  const uint64_t reference =
      engine.keeps_reference() ? params * (engine.config().compute.dtype == at::kFloat ? 4 : 2) : 0;
  // fp32 master, m and v, the model, the reference, and 1% + 1 MiB for headers, JSON and metadata.
  const uint64_t raw = state * 12 + model_bytes + reference;
  return raw + raw / 100 + (1ull << 20);
}

uint64_t CheckpointSeries::free_bytes(const fs::path& dir) {
  fs::path p = dir;
  std::error_code ec;
  while (!p.empty() && !fs::exists(p, ec)) p = p.parent_path();
  if (p.empty()) p = ".";
  struct statvfs st {};
  STRIDER_CHECK(::statvfs(p.c_str(), &st) == 0, "statvfs({}) failed: {}", p.string(), errno_text(errno));
  return uint64_t(st.f_bavail) * uint64_t(st.f_frsize);
}

fs::path CheckpointSeries::save(Engine& engine, std::string_view model_config_json, const nlohmann::json& extra,
                                const TrainCheckpointOptions& options) {
  engine.finish_updates();
  const fs::path dir = dir_for(engine.steps_done());
  const uint64_t need = bytes_needed(engine, options), avail = free_bytes(root_);
  STRIDER_CHECK(need <= avail, "saving the training checkpoint {} needs about {} but the file system holding {} has "
                "{} free; nothing was written, and the checkpoints already there are kept: free space there, or "
                "give --checkpoint-dir on a larger disk", dir.string(), format_gib(need), root_.string(),
                format_gib(avail));
  // Temp directories of saves that died mid-way (one saver per root: the
  // caller holds its lock), whatever step they were for.
  std::error_code ec;
  // A directory of this step's name that is not a checkpoint (empty, or
  // someone else's) is moved aside, not deleted and not left to refuse this
  // save and every later one.
  if (fs::is_directory(dir, ec) && !fs::exists(dir / "trainer_state.json", ec)) {
    fs::path aside;
    for (int n = 1; aside.empty() || fs::exists(aside, ec); ++n) aside = fs::path(dir.string() + fmt::format(".unreadable-{}", n));
    fs::rename(dir, aside, ec);
    STRIDER_CHECK(!ec, "{} is in the way of this step's checkpoint and is not one (no trainer_state.json); moving it "
                  "to {} failed: {}; move or remove it", dir.string(), aside.string(), ec.message());
    fmt::print(stderr, "warning: {} was not a training checkpoint (no trainer_state.json); moved to {} to save this "
               "step's\n", dir.string(), aside.string());
  }
  if (fs::is_directory(root_, ec))
    for (const auto& entry : fs::directory_iterator(root_, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with(".step-") && name.find(".tmp-") != std::string::npos) fs::remove_all(entry.path(), ec);
    }
  save_training_checkpoint(dir, engine, model_config_json, extra, options);
  // Published: now the oldest beyond `keep` may go (never the one just written).
  std::vector<fs::path> all = list();
  int kept = 0;
  for (const fs::path& p : all) {
    if (p == root_) continue;  // a single checkpoint at the root is the user's: never removed
    if (!fs::exists(p / "trainer_state.json", ec)) continue;  // not a checkpoint: not ours to remove
    if (++kept <= keep_) continue;
    fs::remove_all(p, ec);  // best effort: the next save tries again
  }
  return dir;
}

CheckpointSeries::Resumed CheckpointSeries::resume(Engine& engine, const TrainLoadOptions& options, std::FILE* log) {
  Resumed r;
  for (const fs::path& dir : list()) {
    try {
      // A ".old" directory is loaded as what it is: its base name, per the recovery rule.
      fs::path load = dir;
      if (dir.filename().string().ends_with(".old"))
        load = dir.parent_path() / dir.filename().string().substr(0, dir.filename().string().size() - 4);
      r.extra = load_training_checkpoint(load, engine, options);
      r.dir = dir;
      if (options.verify_checksums)
        for (const std::string& p : check_model_files(inspect_training_checkpoint(load)))
          fmt::print(log, "warning: the exportable model in {} is damaged: {}; the training state is intact and "
                     "loaded, and the next save writes a new copy (do not export this one)\n", dir.string(), p);
      return r;
    } catch (const CheckpointMismatch&) {
      throw;
    } catch (const Error& e) {
      r.skipped.push_back(fmt::format("{}: {}", dir.string(), e.what()));
      fmt::print(log, "warning: skipping the damaged checkpoint {}: {}\n", dir.string(), e.what());
    }
  }
  std::string why;
  for (const std::string& s : r.skipped) why += "\n  " + s;
  throw Error(fmt::format("no training checkpoint in {} could be loaded{}", root_.string(),
                          r.skipped.empty() ? std::string(" (there is none)") : ":" + why));
}

}  // namespace strider
