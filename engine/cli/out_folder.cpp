#include "engine/cli/out_folder.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "host/error.h"

namespace strider::cli {
namespace fs = std::filesystem;
namespace {

// --out as an absolute path without a trailing separator ("out/" names "out", "." the working directory).
fs::path folder_path(const std::string& out) {
  fs::path p = fs::absolute(fs::path(out)).lexically_normal();
  if (p.filename().empty() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  return p;
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The top-level entries an earlier strider output's manifest lists (empty
// when there is none, or it is not one strider wrote).
std::set<std::string> listed_entries(const fs::path& dir) {
  std::set<std::string> names;
  std::ifstream f(dir / kOutManifest);
  if (!f) return names;
  try {
    const nlohmann::json m = nlohmann::json::parse(f);
    for (const auto& file : m.at("files")) names.insert(fs::path(file.get<std::string>()).begin()->string());
    names.insert(kOutManifest);
  } catch (const std::exception&) {
    names.clear();  // not a manifest strider wrote
  }
  return names;
}

// The directory's entry (and a rename in it) on disk before going on.
void sync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void rename_or_throw(const fs::path& from, const fs::path& to, const std::string& what) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error(fmt::format("--out: {}: renaming {} to {} failed: {}", what, from.string(), to.string(),
                            errno_text(errno)));
}

// Switches the complete folder `staging` in for `dir` (--out, `out` as
// given): a rename where there is none, else one exchange, after which the
// earlier folder's checkpoints come back and the rest of it goes. Returns the
// earlier folder's entries it replaced. Throws only before the switch.
std::vector<std::string> switch_in(const fs::path& staging, const fs::path& dir, const std::string& out) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    rename_or_throw(staging, dir, "switching in the final save");
    sync_dir(dir.parent_path());
    return {};
  }
  // One rename exchanges the two folders: --out is the earlier one or the new one, never a mix.
  if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0)
    throw Error(fmt::format("--out {}: exchanging it with the final save's {} failed: {} (--out is the earlier "
                            "folder still)", out, staging.string(), errno_text(errno)));
  sync_dir(dir.parent_path());
  // The earlier folder is now at `staging`: its checkpoints come back, the rest goes.
  std::vector<std::string> replaced;
  for (const std::string& name : entries(staging))
    if (name != kOutCheckpoints) replaced.push_back(name);
  // From here on --out is the new folder: a failure is a warning, and
  // nothing that holds the run's checkpoints is removed.
  if (fs::is_directory(staging / kOutCheckpoints, ec) && !fs::exists(dir / kOutCheckpoints, ec) &&
      ::rename((staging / kOutCheckpoints).c_str(), (dir / kOutCheckpoints).c_str()) != 0) {
    fmt::print(stderr, "warning: moving the run's checkpoints from {} into --out failed: {}; they stay there (the "
               "next run into --out moves them back)\n", (staging / kOutCheckpoints).string(), errno_text(errno));
    return replaced;
  }
  fs::remove_all(staging, ec);
  if (ec)
    fmt::print(stderr, "warning: removing the earlier --out's files, now in {}, failed: {}\n", staging.string(),
               ec.message());
  return replaced;
}

// `staging` is a final save that completed (its manifest written) after
// `dir`'s, so a run stopped between the two: not the earlier folder a switch replaced.
bool completed_later(const fs::path& staging, const fs::path& dir) {
  std::error_code ec;
  const fs::path mine = staging / kOutManifest, theirs = dir / kOutManifest;
  if (!fs::is_regular_file(mine, ec)) return false;
  if (!fs::is_regular_file(theirs, ec)) return true;
  return fs::last_write_time(mine, ec) > fs::last_write_time(theirs, ec);
}

}  // namespace

OutFolder::OutFolder(std::string out, bool overwrite) : out_(std::move(out)) {
  const fs::path dir = folder_path(out_);
  STRIDER_CHECK(dir != dir.root_path(), "--out {}: the final save replaces --out as a whole; name a folder, not "
                "the file system's root", out_);
  const fs::path parent = dir.parent_path();
  staging_ = (parent / ("." + dir.filename().string() + ".strider-new")).string();
  std::error_code ec;
  // An earlier run stopped between its switch and moving its checkpoints
  // back: they are in the sibling folder, with the earlier --out's files.
  if (fs::exists(staging_, ec) && completed_later(staging_, dir)) {
    // A final save that finished but was not switched in: the newest trained model, not to be lost.
    switch_in(staging_, dir, out_);
    switched_at_start_ = true;
    fmt::print(stderr, "note: switched in {} as --out {}: an earlier run finished its final save there and stopped "
               "before switching it in\n", staging_, out_);
  }
  if (fs::exists(staging_, ec)) {
    const fs::path left = fs::path(staging_) / kOutCheckpoints, home = dir / kOutCheckpoints;
    if (fs::is_directory(left, ec)) {
      STRIDER_CHECK(fs::is_directory(dir, ec) && !fs::exists(home, ec), "--out {}: {} holds checkpoints an earlier "
                    "run left while switching in its --out, and they cannot go back to {} ({}): move them where "
                    "you want them, then start again", out_, left.string(), home.string(),
                    fs::exists(home, ec) ? "it exists" : "--out is not a folder");
      rename_or_throw(left, home, "moving back the checkpoints an interrupted save left");
      fmt::print(stderr, "note: moved {} back to {} (an earlier run stopped while switching in its --out)\n",
                 left.string(), home.string());
    }
    fs::remove_all(staging_, ec);  // a save that did not finish, or an earlier folder already replaced
    STRIDER_CHECK(!ec, "--out {}: removing {} (what an earlier run's final save left) failed: {}", out_, staging_,
                  ec.message());
  }
  // The final save writes beside --out and exchanges the two folders: both
  // must work there, found out now (a network file system may not exchange).
  const fs::path probe = staging_ + "-probe";
  fs::create_directories(staging_, ec);
  STRIDER_CHECK(!ec, "--out {}: the final save writes its folder first as {} (then switches it in) and cannot "
                "create it: {}; give --out in a folder this run can write into", out_, staging_, ec.message());
  fs::create_directories(probe, ec);
  int why = ec.value();
  const bool exchanges = !ec && ::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, probe.c_str(), RENAME_EXCHANGE) == 0;
  if (!ec && !exchanges) why = errno;
  fs::remove_all(staging_, ec);
  fs::remove_all(probe, ec);
  STRIDER_CHECK(exchanges, "--out {}: its file system cannot exchange two folders in one rename (renameat2 "
                "RENAME_EXCHANGE: {}), which the final save needs to replace --out whole; give --out on a local "
                "file system", out_, errno_text(why));
  if (!fs::is_directory(dir, ec)) return;  // absent (or not a folder: check_output_dir says so)
  const std::vector<std::string> there = entries(dir);
  if (there.empty()) return;
  std::set<std::string> ours = listed_entries(dir);
  ours.insert(kOutCheckpoints);
  std::vector<std::string> foreign;
  for (const std::string& name : there)
    if (!ours.count(name)) foreign.push_back(name);
  if (foreign.empty()) {
    fmt::print(stderr, "note: --out {} holds an earlier strider output; the final save replaces it as a whole\n", out_);
    return;
  }
  STRIDER_CHECK(overwrite, "--out {} holds files strider did not write there ({}): refusing to replace them. Give an "
                "empty or new folder, or --overwrite-out to have the final save replace the folder as a whole "
                "(it then holds exactly what this run writes)", out_, fmt::join(foreign, ", "));
  fmt::print(stderr, "warning: --overwrite-out: the final save replaces --out {} as a whole, and with it {}\n", out_,
             fmt::join(foreign, ", "));
}

std::string OutFolder::begin() {
  std::error_code ec;
  fs::remove_all(staging_, ec);
  fs::create_directories(staging_, ec);
  STRIDER_CHECK(!ec, "--out {}: creating {} for the final save failed: {}", out_, staging_, ec.message());
  return staging_;
}

std::vector<std::string> OutFolder::commit() {
  const fs::path dir = folder_path(out_), staging(staging_);
  {
    std::vector<std::string> listed;
    for (const auto& e : fs::recursive_directory_iterator(staging))
      if (e.is_regular_file()) listed.push_back(fs::relative(e.path(), staging).string());
    std::sort(listed.begin(), listed.end());
    std::ofstream m(staging / kOutManifest);
    m << nlohmann::json{{"written_by", "strider finetune"}, {"files", listed}}.dump(2) << "\n";
    m.close();
    STRIDER_CHECK(m.good(), "--out {}: writing {} failed: {}", out_, (staging / kOutManifest).string(),
                  errno_text(errno));
  }
  sync_dir(staging);
  return switch_in(staging, dir, out_);
}

void OutFolder::abandon() noexcept {
  std::error_code ec;
  fs::remove_all(staging_, ec);
}

}  // namespace strider::cli
