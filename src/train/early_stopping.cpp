// Early stopping and the best K checkpoints on the monitor.
#include "ddp/train/early_stopping.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <regex>

namespace fs = std::filesystem;

namespace ddp {

bool patience_run_out(const Monitor& monitor, double value, double min_delta, int64_t patience, TrainState& state) {
  const double delta = std::abs(min_delta);
  const bool improved = !std::isnan(value) && (std::isnan(state.patience_best) ||
                                               (monitor.goal == Goal::kMin ? value < state.patience_best - delta
                                                                           : value > state.patience_best + delta));
  if (improved) {
    state.patience_best = value;
    state.patience_wait = 0;
  } else {
    ++state.patience_wait;
  }
  return patience > 0 && state.patience_wait >= patience;
}

std::string top_k_name(int64_t epoch, const std::string& metric, double value) {
  char v[32];
  std::snprintf(v, sizeof v, "%.6g", value);
  return "epoch=" + std::to_string(epoch) + "-" + metric + "=" + v + ".pt";
}

std::vector<RankedCheckpoint> top_k_checkpoints(const std::string& dir, const Monitor& monitor) {
  static const std::regex pattern(R"(epoch=(\d{1,18})-(.+)=[^=]*\.pt)");
  std::vector<RankedCheckpoint> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!e.is_regular_file() || !std::regex_match(name, m, pattern) || m[2].str() != monitor.metric) continue;
    try {
      // The exact value is in the header; the name's is rounded for reading.
      const double value = read_checkpoint_meta(e.path().string()).state.monitored;
      if (!std::isnan(value)) out.push_back({e.path().string(), value, std::stoll(m[1])});
    } catch (const std::exception&) {
      // damaged, or a user's file of the same shape of name: not ranked, never removed
    }
  }
  std::sort(out.begin(), out.end(), [&](const RankedCheckpoint& a, const RankedCheckpoint& b) {
    if (monitor.better(a.value, b.value)) return true;
    if (monitor.better(b.value, a.value)) return false;
    return a.epoch < b.epoch;
  });
  return out;
}

bool enters_top_k(const std::string& dir, const Monitor& monitor, int64_t k, double value) {
  if (k <= 0 || std::isnan(value)) return false;
  const auto ranked = top_k_checkpoints(dir, monitor);
  return static_cast<int64_t>(ranked.size()) < k || monitor.better(value, ranked[static_cast<size_t>(k) - 1].value);
}

void prune_top_k(const std::string& dir, const Monitor& monitor, int64_t k) {
  const auto ranked = top_k_checkpoints(dir, monitor);
  std::error_code ec;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(k, 0)); i < ranked.size(); ++i) fs::remove(ranked[i].path, ec);
}

}  // namespace ddp
