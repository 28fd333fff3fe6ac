// DPO's reference log-probabilities from the command line (preference_reference.h).
#include "engine/cli/preference_reference.h"

#include <chrono>
#include <cstdio>
#include <fmt/format.h>

#include "host/error.h"

namespace strider::cli {

std::vector<float> score_windows(Engine& engine, const TokenFile& file, bool reference,
                                 const std::function<bool()>& stop) {
  const EngineConfig& c = engine.config();
  const uint64_t rows = uint64_t(c.batch()), seq = uint64_t(c.seq);
  TokenLoader order(file, {.batch = rows, .seq = seq, .seed = 0, .shuffle = false, .pair_rows = rows});
  const uint64_t pairs = order.num_windows(), per_batch = rows / 2;
  std::vector<float> out(2 * pairs, 0.0f);
  std::vector<int64_t> ids(rows * seq), labels(ids.size()), attention(ids.size());
  fmt::print("  reference log-probabilities of {} pairs under the {}: scoring them\n", pairs,
             reference ? "frozen base" : "starting weights");
  std::fflush(stdout);  // said as it begins: a signal ends it between two batches
  const auto t0 = std::chrono::steady_clock::now();
  // The last batch runs into the order's next pass (pairs already scored, the same values again).
  for (uint64_t done = 0; done < pairs; done += per_batch) {
    if (stop()) {
      fmt::print("  scoring the reference interrupted after {} of {} pairs\n", done, pairs);
      return {};
    }
    const bool padded = order.next(ids, labels, {}, attention);
    const std::vector<float> lp = engine.logprobs(ids.data(), labels.data(), nullptr,
                                                  padded ? attention.data() : nullptr, reference);
    for (uint64_t b = 0; b < rows; ++b) {
      double sum = 0;
      for (uint64_t t = 0; t < seq; ++t) sum += lp[b * seq + t];
      out[order.last_windows()[b]] = float(sum);
    }
  }
  fmt::print("  reference scored in {:.1f} s (recorded in each checkpoint)\n",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return out;
}

std::string reference_record(std::span<const float> logps) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(logps.size() * 8);
  for (const std::byte b : std::as_bytes(logps)) {
    out.push_back(kHex[std::to_integer<unsigned>(b) >> 4]);
    out.push_back(kHex[std::to_integer<unsigned>(b) & 15]);
  }
  return out;
}

std::vector<float> reference_from_record(const nlohmann::json& extra, const std::string& key, uint64_t windows,
                                         const std::string& where) {
  const char* of = key == "reference_logps" ? "the training data" : "the eval data (--eval-data)";
  STRIDER_CHECK(extra.contains(key) && extra[key].is_string(),
                "--resume: {} holds no reference log-probabilities of {} (a run with --objective dpo records them in "
                "each checkpoint); they are never recomputed from trained weights: resume from a checkpoint of "
                "this DPO run with its own data, or start anew",
                where, of);
  const std::string& hex = extra[key].get_ref<const std::string&>();
  STRIDER_CHECK(hex.size() == windows * 8, "--resume: {}'s reference log-probabilities of {} are of {} sequences, "
                "the file has {}: the run's own preference file is needed", where, of, hex.size() / 8, windows);
  std::vector<float> out(windows);
  std::span<std::byte> bytes = std::as_writable_bytes(std::span(out));
  auto nibble = [&](char ch) -> unsigned {
    if (ch >= '0' && ch <= '9') return unsigned(ch - '0');
    if (ch >= 'a' && ch <= 'f') return unsigned(ch - 'a' + 10);
    throw Error(fmt::format("--resume: {}'s reference log-probabilities are not hex (a character '{}')", where, ch));
  };
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  return out;
}

const ObjectiveInputs* PairInputs::next(std::span<const float> reference, std::span<const uint64_t> windows) {
  row.resize(windows.size());
  for (size_t b = 0; b < windows.size(); ++b) row[b] = reference[windows[b]];
  inputs = {.rows = int64_t(windows.size()), .row = row.data()};
  return &inputs;
}

}  // namespace strider::cli
