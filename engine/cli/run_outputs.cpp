#include "engine/cli/run_outputs.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <utility>
#include <fmt/format.h>

#include "host/error.h"

namespace strider::cli {
namespace fs = std::filesystem;
namespace {

volatile std::sig_atomic_t g_signal = 0;

void on_stop_signal(int signo) {
  if (g_signal != 0) {  // the second: stop now
    std::signal(signo, SIG_DFL);
    std::raise(signo);
    return;
  }
  g_signal = signo;
}

// Creates `dir` (and parents) and checks that a file can be created in it.
void probe_dir(const fs::path& dir, std::string_view option, const std::string& value) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRIDER_CHECK(!ec, "{} {}: cannot create the directory {}: {}", option, value, dir.string(), ec.message());
  STRIDER_CHECK(fs::is_directory(dir), "{} {}: {} is not a directory", option, value, dir.string());
  std::string probe = (dir / ".strider-write-probe-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  STRIDER_CHECK(fd >= 0, "{} {}: cannot write into {}: {}", option, value, dir.string(), errno_text(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) p = fs::absolute(path).lexically_normal();
  return p;
}

// `a` and `b` are the same file or directory: one resolved path, or one inode.
bool same_path(const fs::path& a, const fs::path& b) {
  if (a == b) return true;
  std::error_code ec;
  return fs::exists(a, ec) && fs::exists(b, ec) && fs::equivalent(a, b, ec);
}

// `child` lies strictly inside the directory `dir` (resolved paths).
bool inside(const fs::path& child, const fs::path& dir) {
  auto c = child.begin();
  for (auto d = dir.begin(); d != dir.end(); ++d, ++c)
    if (c == child.end() || *c != *d) return false;
  return c != child.end();
}

}  // namespace

void check_paths_apart(const std::vector<RunPath>& inputs, const std::vector<RunPath>& outputs,
                       const std::vector<std::string_view>& managed) {
  std::vector<fs::path> in, out;
  for (const RunPath& p : inputs) in.push_back(resolved(p.path));
  for (const RunPath& p : outputs) out.push_back(resolved(p.path));
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      STRIDER_CHECK(!same_path(out[o], in[i]), "{} {} is {} {} ({}): writing it would destroy what this run reads",
                    outputs[o].option, outputs[o].path, inputs[i].option, inputs[i].path, in[i].string());
      STRIDER_CHECK(!inside(out[o], in[i]), "{} {} lies inside {} {} ({}), which this run reads: write it elsewhere",
                    outputs[o].option, outputs[o].path, inputs[i].option, inputs[i].path, in[i].string());
    }
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (k == o) continue;
      STRIDER_CHECK(k > o || !same_path(out[o], out[k]), "{} {} is also this run's {} ({}): give each its own path",
                    outputs[o].option, outputs[o].path, outputs[k].option, out[o].string());
      const bool managed_k =
          std::find(managed.begin(), managed.end(), outputs[k].option) != managed.end();
      STRIDER_CHECK(!managed_k || !inside(out[o], out[k]),
                    "{} {} lies inside {} {}, whose files this run prunes and rewrites: write it elsewhere",
                    outputs[o].option, outputs[o].path, outputs[k].option, outputs[k].path);
    }
  }
}

void check_output_dir(const std::string& path, std::string_view option) {
  STRIDER_CHECK(!path.empty(), "{}: the path is empty", option);
  probe_dir(fs::path(path), option, path);
}

void check_output_file(const std::string& path, std::string_view option) {
  STRIDER_CHECK(!path.empty(), "{}: the path is empty", option);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    STRIDER_CHECK(S_ISREG(st.st_mode), "{} {}: it exists and is not a regular file (a device, a directory or a "
                  "pipe); refusing to replace it: name a file", option, path);
  } else {
    STRIDER_CHECK(errno == ENOENT, "{} {}: {}", option, path, errno_text(errno));
  }
  const fs::path parent = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  probe_dir(parent, option, path);
}

StopSignals::StopSignals() {
  g_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // I/O in flight goes on; the loop checks the flag between steps
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
}

bool StopSignals::requested() const { return g_signal != 0; }
int StopSignals::signal_number() const { return int(g_signal); }

const char* StopSignals::name(int signo) {
  return signo == SIGINT ? "SIGINT" : signo == SIGTERM ? "SIGTERM" : "a signal";
}

void check_recordable(const nlohmann::json& record) {
  // Where each recorded string comes from, for the message.
  static const std::pair<std::string_view, std::string_view> kOrigins[] = {
      {"extra.data", "--data"}, {"extra.data_file.path", "--data"}, {"extra.config_file.path", "--config"},
      {"extra.config_file.text", "--config's text"}, {"base_model", "--model"}};
  const auto walk = [](const auto& self, const nlohmann::json& j, const std::string& key) -> void {
    if (j.is_object()) {
      for (const auto& [k, v] : j.items()) self(self, v, key.empty() ? k : key + "." + k);
    } else if (j.is_array()) {
      for (size_t i = 0; i < j.size(); ++i) self(self, j[i], fmt::format("{}[{}]", key, i));
    } else if (j.is_string()) {
      try {
        (void)j.dump();
      } catch (const nlohmann::json::type_error& e) {
        std::string_view origin = key;
        for (const auto& [k, o] : kOrigins)
          if (k == key) origin = o;
        throw Error(fmt::format("{} holds bytes that are not UTF-8 ({}): every checkpoint records it as JSON text, "
                                "which holds UTF-8 only; rename the file (or re-save the config as UTF-8)",
                                origin, e.what()));
      }
    }
  };
  walk(walk, record, "");
}

nlohmann::json config_file_record(const std::string& path) {
  if (path.empty()) return nullptr;
  std::ifstream in(path);
  STRIDER_CHECK(in.good(), "--config {}: cannot read it: {}", path, errno_text(errno));
  fmt::print("options from {} (the command line's own win)\n", path);
  return {{"path", std::filesystem::absolute(path).string()},
          {"text", std::string(std::istreambuf_iterator<char>(in), {})}};
}

void append_line(std::ofstream& metrics, const std::string& path, const nlohmann::json& line) {
  metrics << line.dump() << "\n" << std::flush;
  STRIDER_CHECK(metrics.good(), "--metrics {}: writing failed ({}); the run stops here", path, errno_text(errno));
}

}  // namespace strider::cli
