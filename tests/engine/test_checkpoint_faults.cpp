// Training checkpoints under faults: a process SIGKILLed at random moments
// while saving always leaves a checkpoint that loads and equals exactly the
// state of the step it names; a crash between the publishing renames leaves
// one the loader finds; bad input is refused by name before the engine
// changes; a damaged model file is named; a full disk leaves the previous
// checkpoint loadable. Resume: test_train_checkpoint.cpp.
#include "tests/catch_torch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/train_checkpoint.h"
#include "engine/model/hf_folder.h"
#include "engine/run/engine.h"
#include "host/bf16.h"
#include "host/error.h"
#include "tests/engine/engine_state.h"
#include "tests/engine/tiny_model.h"

#include "tests/engine/train_checkpoint_setup.h"

namespace {

std::vector<std::string> temp_dirs(const fs::path& parent) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(parent))
    if (e.path().filename().string().find(".tmp-") != std::string::npos) out.push_back(e.path().string());
  return out;
}

}  // namespace

TEST_CASE("a damaged exportable model in a checkpoint is found and named, and its state still loads",
          "[train_checkpoint]") {
  const nlohmann::json model = tiny_config(false);
  TempDir tmp;
  const fs::path dir = tmp.path / "ck";
  auto e = engine(model, config(at::kFloat, 0.5));
  e->init_params(7);
  train(*e, 0, 1);
  save_training_checkpoint(dir, *e, model.dump(), {}, {.write_model = true});
  CHECK(check_model_files(inspect_training_checkpoint(dir)).empty());
  // One byte of a weight flipped, as a disk or a copy might: the format cannot see it.
  const fs::path file = dir / "model.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    const char x = char(0x5a);
    f.write(&x, 1);
  }
  const std::vector<std::string> problems = check_model_files(inspect_training_checkpoint(dir));
  REQUIRE(problems.size() == 1);
  CHECK_THAT(problems[0], Catch::Contains(file.string()) && Catch::Contains("its save recorded"));
  auto again = engine(model, config(at::kFloat, 0.5));
  load_training_checkpoint(dir, *again);  // the state is intact
  CHECK(same_bits(read_all(*again), read_all(*e)));
  fs::remove(file);
  CHECK_THAT(check_model_files(inspect_training_checkpoint(dir))[0], Catch::Contains("is missing"));
}

TEST_CASE("a crash between the publishing renames leaves a checkpoint the loader finds", "[train_checkpoint]") {
  const nlohmann::json model = tiny_config(false);
  TempDir tmp;
  const fs::path dir = tmp.path / "ckpt", old = tmp.path / "ckpt.old";
  auto e = engine(model, config(at::kFloat, 0.5));
  e->init_params(7);
  train(*e, 0, 1);
  save_training_checkpoint(dir, *e, model.dump(), {{"step", 1}});
  train(*e, 1, 2);
  save_training_checkpoint(dir, *e, model.dump(), {{"step", 2}});
  CHECK(fs::exists(dir));
  CHECK_FALSE(fs::exists(old));
  CHECK(temp_dirs(tmp.path).empty());
  const State two = read_all(*e);

  // The state after step 1 of publishing: <dir> renamed away, the new one not
  // yet in place, and a half-written temp directory beside them.
  fs::rename(dir, old);
  fs::create_directories(tmp.path / ".ckpt.tmp-99999-0");
  std::ofstream(tmp.path / ".ckpt.tmp-99999-0" / "trainer_state.json") << "{\"format\": ";
  auto f = engine(model, config(at::kFloat, 0.5, window(3)));
  CHECK(inspect_training_checkpoint(dir).path == old);
  CHECK(load_training_checkpoint(dir, *f) == nlohmann::json{{"step", 2}});
  CHECK(same_bits(read_all(*f), two));

  // The next save publishes over it and cleans up.
  train(*f, 2, 3);
  save_training_checkpoint(dir, *f, model.dump(), {{"step", 3}});
  CHECK(inspect_training_checkpoint(dir).path == dir);
  CHECK(inspect_training_checkpoint(dir).step == 3);
  CHECK_FALSE(fs::exists(old));
  CHECK(temp_dirs(tmp.path).empty());

  // A directory that is not a checkpoint is never replaced.
  fs::create_directories(tmp.path / "mine");
  std::ofstream(tmp.path / "mine" / "notes.txt") << "keep me";
  CHECK_THROWS_WITH(save_training_checkpoint(tmp.path / "mine", *f, model.dump()),
                    Catch::Contains("not a strider training checkpoint"));
  CHECK(fs::exists(tmp.path / "mine" / "notes.txt"));

  // A temp directory alone is not a checkpoint.
  fs::remove_all(dir);
  fs::create_directories(tmp.path / ".ckpt.tmp-99999-1");
  CHECK_THROWS_WITH(inspect_training_checkpoint(dir), Catch::Contains("no training checkpoint"));
}

TEST_CASE("bad checkpoints are refused by name and leave the engine untouched", "[train_checkpoint]") {
  const nlohmann::json model = tiny_config(false);
  TempDir tmp;
  const fs::path good = tmp.path / "good";
  {
    auto e = engine(model, config(at::kFloat, 0.5));
    e->init_params(7);
    train(*e, 0, 2);
    save_training_checkpoint(good, *e, model.dump());
  }
  auto copy_of_good = [&](const std::string& name) {
    const fs::path p = tmp.path / name;
    fs::copy(good, p, fs::copy_options::recursive);
    return p;
  };
  // The victim: a different state (one step, another init) that must survive.
  auto victim = engine(model, config(at::kFloat, 0.5, {2, false, {1}, tmp.path.string()}));
  victim->init_params(3);
  train(*victim, 0, 1);
  const State before = read_all(*victim);
  auto untouched = [&] { return victim->steps_done() == 1 && same_bits(read_all(*victim), before); };
  auto check_case = [&](const char* name, auto body) {
    INFO(name);
    body();
    CHECK(untouched());
  };

  check_case("truncated state file", [&] {
    const fs::path p = copy_of_good("truncated");
    fs::resize_file(p / "state.safetensors", fs::file_size(p / "state.safetensors") - 100);
    CHECK_THROWS_WITH(load_training_checkpoint(p, *victim), Catch::Contains((p / "state.safetensors").string()));
  });
  check_case("a flipped bit in the state data", [&] {
    const fs::path p = copy_of_good("flipped");
    std::fstream f(p / "state.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-7, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(-7, std::ios::end);
    f.write(&c, 1);
    f.close();
    CHECK_THROWS_WITH(load_training_checkpoint(p, *victim),
                      Catch::Contains("checksum") && Catch::Contains("state.safetensors") && Catch::Contains("head"));
  });
  check_case("state file missing", [&] {
    const fs::path p = copy_of_good("nostate");
    fs::remove(p / "state.safetensors");
    CHECK_THROWS_WITH(load_training_checkpoint(p, *victim), Catch::Contains("state.safetensors") && Catch::Contains("missing"));
  });
  check_case("missing trainer_state.json", [&] {
    const fs::path p = copy_of_good("nots");
    fs::remove(p / "trainer_state.json");
    CHECK_THROWS_WITH(load_training_checkpoint(p, *victim),
                      Catch::Contains((p / "trainer_state.json").string()) && Catch::Contains("missing"));
  });
  check_case("a field of trainer_state.json missing", [&] {
    const fs::path p = copy_of_good("nostep");
    nlohmann::json ts = nlohmann::json::parse(std::ifstream(p / "trainer_state.json"));
    ts.erase("step");
    std::ofstream(p / "trainer_state.json") << ts.dump();
    CHECK_THROWS_WITH(load_training_checkpoint(p, *victim),
                      Catch::Contains("trainer_state.json") && Catch::Contains("'step'"));
  });
  check_case("a checkpoint of another model", [&] {
    const nlohmann::json bigger = tiny_config(false, 4);
    auto other = engine(bigger, config(at::kFloat, 0.5));
    other->init_params(1);
    save_training_checkpoint(tmp.path / "other", *other, bigger.dump());
    CHECK_THROWS_WITH(load_training_checkpoint(tmp.path / "other", *victim),
                      Catch::Contains("trainer_state.json") && Catch::Contains("another model") &&
                          Catch::Contains("num_hidden_layers: checkpoint 4, engine 3"));
  });
  check_case("a state file of another model under a matching trainer_state.json", [&] {
    const nlohmann::json tied = tiny_config(true);
    auto other = engine(tied, config(at::kFloat, 0.5));
    other->init_params(1);
    train(*other, 0, 2);  // the same step, so only the tensors differ
    save_training_checkpoint(tmp.path / "tied", *other, tied.dump());
    const fs::path p = copy_of_good("mixed");
    fs::copy_file(tmp.path / "tied" / "state.safetensors", p / "state.safetensors",
                  fs::copy_options::overwrite_existing);
    CHECK_THROWS_WITH(load_training_checkpoint(p, *victim),
                      Catch::Contains("state.safetensors") && Catch::Contains("lm_head.weight"));
  });
  check_case("saving with the config of another model fails before any file exists", [&] {
    CHECK_THROWS_WITH(save_training_checkpoint(tmp.path / "never", *victim, tiny_config(false, 2).dump()),
                      Catch::Contains("num_hidden_layers"));
    CHECK_FALSE(fs::exists(tmp.path / "never"));
    CHECK(temp_dirs(tmp.path).empty());
  });
  load_training_checkpoint(good, *victim);
  CHECK_FALSE(untouched());  // a load does change it: the checks above can fail
}

namespace {

// A small tmpfs mounted for the test; not mounted when this process may not.
struct SmallTmpfs {
  TempDir dir;
  bool mounted = false;
  explicit SmallTmpfs(const char* size) {
    mounted = mount("tmpfs", dir.path.c_str(), "tmpfs", 0, (std::string("size=") + size).c_str()) == 0;
  }
  ~SmallTmpfs() {
    if (mounted) umount2(dir.path.c_str(), MNT_DETACH);
  }
};

}  // namespace

TEST_CASE("a full disk fails the save naming the file and keeps the previous checkpoint", "[train_checkpoint]") {
  // One checkpoint of the tiny model is ~450 KB: room for one, not for two.
  SmallTmpfs small("700k");
  if (!small.mounted) {
    WARN("skipped: cannot mount a tmpfs here (" << std::strerror(errno) << "): ENOSPC case not run");
    return;
  }
  const nlohmann::json model = tiny_config(false);
  const fs::path dir = small.dir.path / "ckpt";
  auto e = engine(model, config(at::kFloat, 0.5));
  e->init_params(7);
  train(*e, 0, 1);
  save_training_checkpoint(dir, *e, model.dump(), {{"step", 1}});
  const State one = read_all(*e);
  train(*e, 1, 2);
  CHECK_THROWS_WITH(save_training_checkpoint(dir, *e, model.dump(), {{"step", 2}}),
                    Catch::Contains("No space left on device") && Catch::Contains(".safetensors") &&
                        Catch::Contains("intact"));
  CHECK(temp_dirs(small.dir.path).empty());
  auto f = engine(model, config(at::kFloat, 0.5, window(3)));
  CHECK(load_training_checkpoint(dir, *f) == nlohmann::json{{"step", 1}});
  CHECK(same_bits(read_all(*f), one));
}

// ---- crash safety: a child process saving in a loop, SIGKILLed at random ----

namespace {

constexpr int kReportFd = 100;   // the child's end of the pipe: 'S' as a save starts, 'D' when done
constexpr int kMaxStep = 8;      // the child keeps re-saving this step once reached
const char* const kChildName = "train checkpoint crash child";

// fp32 state in fp32, or q8 state (bf16 compute: the q8 format needs it);
// layers whole or cut into sub-layer pieces.
struct CrashRun {
  StateFormat format;
  int64_t mlp_pieces = 0;
};

EngineConfig crash_config(const CrashRun& run, const Placement& p = {}) {
  EngineConfig c = config(run.format == StateFormat::kQ8 ? at::kBFloat16 : at::kFloat, 0.5, p);
  c.optimizer_state = run.format;
  c.mlp_pieces = run.mlp_pieces;
  return c;
}

}  // namespace

// Runs only when the parent test below execs this binary for it.
TEST_CASE("train checkpoint crash child", "[.crash_child]") {
  const char* dir = std::getenv("STRIDER_TCKPT_CHILD_DIR");
  if (!dir) return;
  const char* format = std::getenv("STRIDER_TCKPT_CHILD_FORMAT");
  const char* pieces = std::getenv("STRIDER_TCKPT_CHILD_MLP_PIECES");
  const nlohmann::json model = tiny_config(false);
  // Killed during a step too: with its layers' state and compute copies on
  // NVMe (scratch the next child lays out again; the checkpoint is what resumes).
  const std::string nvme = std::string(dir) + ".nvme";
  fs::create_directories(nvme);
  const CrashRun run{parse_state_format(format ? format : "fp32"), pieces ? std::atoll(pieces) : 0};
  auto e = engine(model, crash_config(run, compute_on_nvme(nvme)));
  bool resumed = true;
  try {
    inspect_training_checkpoint(dir);
  } catch (const Error&) {
    resumed = false;
  }
  if (resumed) load_training_checkpoint(dir, *e);
  else e->init_params(7);
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {  // the parent kills us long before
    const int s = int(e->steps_done());
    if (s < kMaxStep) train(*e, s, s + 1);
    if (::write(kReportFd, "S", 1) != 1) return;
    save_training_checkpoint(dir, *e, model.dump(), {{"step", e->steps_done()}});
    if (::write(kReportFd, "D", 1) != 1) return;
  }
}

TEST_CASE("SIGKILL at random moments while saving always leaves a loadable, exact checkpoint", "[train_checkpoint]") {
  using Clock = std::chrono::steady_clock;
  // The save is the same code in every format; q8's state also goes out as
  // floats and must come back to the same codes. Layers cut into sub-layer
  // pieces have a piece's state, gradients and compute copy apart.
  const CrashRun run = GENERATE(CrashRun{StateFormat::kFp32}, CrashRun{StateFormat::kQ8},
                                CrashRun{StateFormat::kFp32, 2});
  INFO("optimizer state " << state_format_name(run.format) << ", mlp_pieces " << run.mlp_pieces);
  const nlohmann::json model = tiny_config(false);
  // What each step's state must be.
  std::vector<State> ref;
  {
    auto r = engine(model, crash_config(run));
    r->init_params(7);
    ref.push_back(read_all(*r));
    for (int s = 0; s < kMaxStep; ++s) {
      train(*r, s, s + 1);
      ref.push_back(read_all(*r));
    }
  }
  TempDir tmp;
  const fs::path dir = tmp.path / "ckpt";
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  // Everything exec needs is built before fork: the child may only call async-signal-safe functions.
  std::vector<std::string> env_strings;
  for (char** p = environ; *p; ++p) env_strings.emplace_back(*p);
  env_strings.push_back("STRIDER_TCKPT_CHILD_DIR=" + dir.string());
  env_strings.push_back("STRIDER_TCKPT_CHILD_FORMAT=" + std::string(state_format_name(run.format)));
  env_strings.push_back("STRIDER_TCKPT_CHILD_MLP_PIECES=" + std::to_string(run.mlp_pieces));
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string arg0 = exe, arg1 = kChildName;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};

  auto loader = engine(model, crash_config(run, {3, true, {1, 3}, tmp.path.string(), {3}}));
  std::mt19937 rng(2024);
  int rounds = 0, from_old = 0, with_temp = 0, last_step = 0;
  // Measured as we go: how long a save and a whole step + save take in the child.
  auto save_time = Clock::duration(std::chrono::milliseconds(5));
  auto cycle_time = Clock::duration(std::chrono::milliseconds(40));
  const auto start = Clock::now();
  while (rounds < 4 || (rounds < 16 && Clock::now() - start < std::chrono::seconds(4))) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(fds[1], kReportFd);
      ::execve(exe.c_str(), argv, envp.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    // The next report from the child; false when it died or went silent.
    Clock::time_point last_s{}, last_d{};
    auto next = [&](char want) {
      for (;;) {
        pollfd pfd{fds[0], POLLIN, 0};
        char c = 0;
        if (::poll(&pfd, 1, 60'000) != 1 || ::read(fds[0], &c, 1) != 1) return false;
        const auto now = Clock::now();
        if (c == 'S') {
          if (last_d != Clock::time_point{}) cycle_time = now - last_d + save_time;
          last_s = now;
        } else {
          last_d = now;
          save_time = now - last_s;
        }
        if (c == want) return true;
      }
    };
    // One save completes first (so there is a checkpoint); then three rounds
    // in four kill inside a save, the fourth anywhere in a step + save.
    bool alive = next('D');
    const bool in_save = rng() % 4 != 0;
    const int more = int(rng() % 2);
    for (int i = 0; alive && i < more; ++i) alive = next('D');
    if (alive && in_save) alive = next('S');
    const auto window = in_save ? save_time : cycle_time;
    if (alive)
      std::this_thread::sleep_for(std::chrono::duration_cast<std::chrono::microseconds>(window) * (rng() % 1000) / 1000);
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(fds[0]);
    INFO("round " << rounds);
    REQUIRE(alive);
    REQUIRE((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL));

    if (!temp_dirs(tmp.path).empty()) ++with_temp;
    const TrainCheckpointInfo info = inspect_training_checkpoint(dir);
    if (info.path != dir) ++from_old;
    const nlohmann::json extra = load_training_checkpoint(dir, *loader);
    const int step = int(loader->steps_done());
    REQUIRE(step >= 1);
    REQUIRE(step <= kMaxStep);
    CHECK(extra == nlohmann::json{{"step", step}});
    CHECK(step >= last_step);  // a published checkpoint never goes back
    CHECK(same_bits(read_all(*loader), ref[size_t(step)]));
    last_step = step;
    ++rounds;
  }
  // Figures, not assertions: how often the kill landed where it matters.
  using Ms = std::chrono::duration<double, std::milli>;
  const double save_ms = Ms(save_time).count(), cycle_ms = Ms(cycle_time).count();
  WARN(state_format_name(run.format) << " state, mlp_pieces " << run.mlp_pieces << ": crash rounds " << rounds
                                     << ", last step " << last_step << ", loaded from .old " << from_old
                       << ", temp dirs left by the kill " << with_temp << ", last save "
                       << save_ms << " ms, step + save " << cycle_ms << " ms");
}
