// What the engine tests compare: every block's fp32 state, bit for bit, and a
// temporary directory removed when the test ends.
#pragma once

#include <cstring>
#include <filesystem>
#include <stdlib.h>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace strider::test {

using State = std::vector<std::vector<float>>;  // per block: master, m, v

inline State read_all(Engine& e) {
  State st;
  for (int64_t b = 0; b < e.spec().num_blocks(); ++b)
    for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
      std::vector<float> x(e.spec().layout(b).total_elems());
      e.read_state(b, k, x);
      st.push_back(std::move(x));
    }
  return st;
}

inline bool same_bits(const State& a, const State& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0) return false;
  return true;
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/strider-engine-test-XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace strider::test
