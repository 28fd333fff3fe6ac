// A run's checkpoints: the newest N kept, a save that cannot fit refused
// before it writes (the older ones stay), resume from the newest that loads
// (a damaged one skipped with a warning, a mismatched one refused), and one
// run per directory (DirLock).
#include "tests/catch_torch.h"

#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "engine/checkpoint/series.h"
#include "host/error.h"
#include "io/run_lock.h"
#include "tests/engine/engine_state.h"
#include "tests/engine/tiny_model.h"

using namespace strider;
namespace fs = std::filesystem;

namespace {

std::unique_ptr<Engine> tiny_engine(double lr = 1e-2) {
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 1;
  cfg.compute = {at::kFloat, 40};
  cfg.adam = {.lr = lr};
  cfg.optimizer_threads = 2;
  auto e = std::make_unique<Engine>(ModelSpec::from_json(test::tiny_config(false, 2), "tiny"), cfg,
                                    make_device({.spec = "cpu", .budget_bytes = size_t(64) << 20}));
  e->init_params(3);
  return e;
}

void train_one(Engine& e, uint32_t seed) {
  test::Batch b = test::batch(e.config().batch(), e.config().seq, e.spec().dims.vocab, seed);
  e.step(b.ids.data(), b.labels.data());
}

std::vector<std::string> names(const std::vector<fs::path>& ps) {
  std::vector<std::string> out;
  for (const fs::path& p : ps) out.push_back(p.filename().string());
  return out;
}

const std::string kModel = test::tiny_config(false, 2).dump();

}  // namespace

TEST_CASE("checkpoint series: the newest N are kept, each complete", "[checkpoint_series]") {
  test::TempDir tmp;
  CheckpointSeries series(tmp.path / "run", 2);
  auto e = tiny_engine();
  for (int s = 1; s <= 3; ++s) {
    train_one(*e, s);
    CHECK(series.save(*e, kModel, {{"at", s}}) == series.dir_for(s));
  }
  CHECK(names(series.list()) == std::vector<std::string>{"step-00000003", "step-00000002"});
  for (const fs::path& p : series.list()) CHECK(fs::exists(p / "trainer_state.json"));
  CHECK_THROWS_WITH(CheckpointSeries(tmp.path, 0), Catch::Contains("must be >= 1"));
}

TEST_CASE("checkpoint series: resume takes the newest that loads, skipping a damaged one", "[checkpoint_series]") {
  test::TempDir tmp;
  CheckpointSeries series(tmp.path, 3);
  auto e = tiny_engine();
  train_one(*e, 1);
  series.save(*e, kModel, {{"at", 1}});
  const test::State at1 = test::read_all(*e);
  train_one(*e, 2);
  series.save(*e, kModel, {{"at", 2}});
  // Flip a byte in the middle of the newest state file.
  const fs::path state = series.dir_for(2) / "state.safetensors";
  {
    std::fstream f(state, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(fs::file_size(state) - 64));
    f.put('\x5a');
  }
  auto fresh = tiny_engine();
  std::FILE* log = std::tmpfile();
  CheckpointSeries::Resumed r = series.resume(*fresh, {}, log);
  CHECK(r.dir == series.dir_for(1));
  CHECK(r.extra["at"] == 1);
  REQUIRE(r.skipped.size() == 1);
  CHECK_THAT(r.skipped[0], Catch::Contains("step-00000002") && Catch::Contains("checksum"));
  std::rewind(log);
  char buf[512] = {};
  CHECK(std::fread(buf, 1, sizeof buf - 1, log) > 0);
  CHECK_THAT(std::string(buf), Catch::Contains("warning: skipping the damaged checkpoint"));
  std::fclose(log);
  CHECK(fresh->steps_done() == 1);
  CHECK(test::same_bits(test::read_all(*fresh), at1));

  // Another lr is a mismatch, not damage: refused, however many older ones there are.
  auto other = tiny_engine(5e-3);
  CHECK_THROWS_AS(series.resume(*other, {}, stderr), CheckpointMismatch);
  // Nothing loadable at all: the error names the root and every reason.
  test::TempDir empty;
  CHECK_THROWS_WITH(CheckpointSeries(empty.path, 2).resume(*other, {}, stderr),
                    Catch::Contains(empty.path.string()) && Catch::Contains("there is none"));
}

TEST_CASE("checkpoint series: a save that cannot fit is refused before writing, the older ones kept",
          "[checkpoint_series]") {
  test::TempDir dir;
  // The tiny model's checkpoint needs about 1.2 MiB by the estimate (much less in fact).
  if (mount("tmpfs", dir.path.c_str(), "tmpfs", 0, "size=2m") != 0) {
    WARN("skipped: cannot mount a tmpfs here (" << std::strerror(errno) << "): free-space case not run");
    return;
  }
  struct Unmount {
    std::string p;
    ~Unmount() { umount2(p.c_str(), MNT_DETACH); }
  } unmount{dir.path.string()};
  CheckpointSeries series(dir.path, 2);
  auto e = tiny_engine();
  train_one(*e, 1);
  REQUIRE(CheckpointSeries::bytes_needed(*e) < CheckpointSeries::free_bytes(dir.path));
  series.save(*e, kModel, {});
  // Fill the file system until less is free than a checkpoint needs.
  {
    std::ofstream fill(dir.path / "filler", std::ios::binary);
    const std::string block(64 << 10, 'x');
    while (CheckpointSeries::free_bytes(dir.path) >= CheckpointSeries::bytes_needed(*e) && fill.write(block.data(), block.size()))
      fill.flush();
  }
  train_one(*e, 2);
  CHECK_THROWS_WITH(series.save(*e, kModel, {}), Catch::Contains("needs about") && Catch::Contains("free") &&
                                                     Catch::Contains("checkpoints already there are kept"));
  CHECK(names(series.list()) == std::vector<std::string>{"step-00000001"});
  auto fresh = tiny_engine();
  CHECK(series.resume(*fresh, {}, stderr).dir == series.dir_for(1));
}

namespace {
// Runs DirLock(dir, what, "run-b", mark) in a child process, which holds it
// until told to go; returns the child's pid once it holds it.
struct LockingChild {
  pid_t pid = -1;
  int go[2] = {-1, -1};
  LockingChild(const std::string& dir, DirLock::Mark mark) {
    int ready[2];
    REQUIRE(::pipe(ready) == 0);
    REQUIRE(::pipe(go) == 0);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // the child: only syscalls, then _exit
      char c = 0;
      try {
        DirLock held(dir, "--out", "run-b", mark);
        c = 1;
        (void)!::write(ready[1], &c, 1);
        (void)!::read(go[0], &c, 1);
      } catch (...) {
        (void)!::write(ready[1], &c, 1);
      }
      ::_exit(0);
    }
    char c = 0;
    REQUIRE(::read(ready[0], &c, 1) == 1);
    REQUIRE(c == 1);
    ::close(ready[0]);
    ::close(ready[1]);
  }
  ~LockingChild() {
    (void)!::write(go[1], "x", 1);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(go[0]);
    ::close(go[1]);
  }
};
}  // namespace

TEST_CASE("DirLock: one run per directory, the holder named, released when dropped", "[checkpoint_series]") {
  test::TempDir tmp;
  const std::string dir = (tmp.path / "ckpt").string();
  {
    DirLock first(dir, "--checkpoint-dir", "run-a");
    // The same directory for two of this run's roles: named as such, not as another run.
    CHECK_THROWS_WITH(DirLock(dir, "--nvme"), Catch::Contains("--nvme " + dir + " is also this run's --checkpoint-dir"));
    DirLock::check_held_by(dir, "--checkpoint-dir", "run-a");  // a process of the same run may go on
    CHECK_THROWS_WITH(DirLock::check_held_by(dir, "--checkpoint-dir", "run-b"), Catch::Contains("not run run-b"));
  }
  DirLock again(dir, "--checkpoint-dir");  // the first was released
  CHECK(fs::exists(again.path()));
}

TEST_CASE("DirLock: another process's lock is refused naming its pid, with a lock file or none", "[checkpoint_series]") {
  test::TempDir tmp;
  for (DirLock::Mark mark : {DirLock::Mark::kLockFile, DirLock::Mark::kDirectory}) {
    const std::string dir = (tmp.path / (mark == DirLock::Mark::kLockFile ? "file" : "dir")).string();
    {
      LockingChild child(dir, mark);
      CHECK_THROWS_WITH(DirLock(dir, "--out", "", mark),
                        Catch::Contains("in use by another strider run") &&
                            Catch::Contains("pid " + std::to_string(child.pid)) && Catch::Contains(dir));
    }
    DirLock mine(dir, "--out", "", mark);  // the child ended: released
    // An output folder locked as a directory holds nothing of the lock.
    if (mark == DirLock::Mark::kDirectory) CHECK(fs::is_empty(dir));
  }
}
