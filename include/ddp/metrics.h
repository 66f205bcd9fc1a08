// The run's record: one JSON object per epoch in metrics.jsonl.
//
// Keys: epoch, train_loss, test_loss, test_acc, lr, epoch_seconds,
// samples_per_second. Only rank 0 writes; each line is flushed as soon as it
// is complete, so a crash loses at most the epoch in progress.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace ddp {

struct EpochMetrics {
  int64_t epoch = 0;          // 1-based
  double train_loss = 0;      // mean over all ranks and steps
  double test_loss = 0;
  double test_acc = 0;        // fraction in [0, 1]
  double lr = 0;              // at the end of the epoch
  double epoch_seconds = 0;
  double samples_per_second = 0;
  nlohmann::json to_json() const;
};

class MetricsLog {
 public:
  /// Appends to `path` (creating it). An empty path makes a no-op log.
  explicit MetricsLog(std::string path) : path_(std::move(path)) {}
  void append(const EpochMetrics& m) const;
  /// Keeps only the first `epochs` lines (used when resuming).
  void truncate_to(int64_t epochs) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ddp
