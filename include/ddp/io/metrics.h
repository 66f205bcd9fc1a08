// The run's record, in the run directory, written by rank 0 only.
//
// metrics.jsonl  one JSON object per epoch: epoch, step, wall_time,
//                train_loss, test_loss, test_acc, lr, epoch_seconds,
//                samples_per_second.
// metrics.csv    the same epochs plus the trainer's log points, for
//                spreadsheets and pandas. Columns:
//                  kind,epoch,step,wall_time,train_loss,test_loss,test_acc,lr,epoch_seconds,samples_per_second
//                kind is "step" (a log point: train_loss is the mean over
//                the epoch so far, samples_per_second since the epoch
//                began; test_loss, test_acc, epoch_seconds empty) or
//                "epoch" (every column). step counts optimizer steps since
//                the run began; wall_time is Unix seconds.
// events.out.tfevents.<secs>.<host>
//                TensorBoard scalars: train/loss, train/lr,
//                train/samples_per_second at log points; train/epoch_loss,
//                test/loss, test/accuracy at the end of each epoch; all
//                against the optimizer step (see tensorboard.h).
// curves.svg     loss and accuracy against epoch, rewritten after each
//                epoch (see plot.h).
//
// Every line is flushed as soon as it is complete, so a crash loses at most
// the epoch in progress. When a run resumes, truncate_to() cuts all four back
// to the checkpoint, so no epoch or step appears twice.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp {

class EventWriter;

/// One log point inside an epoch (values already averaged across ranks).
struct StepMetrics {
  int64_t step = 0;           // optimizer steps done since the run began
  int64_t epoch = 0;          // 1-based
  double train_loss = 0;      // mean over the epoch so far
  double lr = 0;
  double samples_per_second = 0;
  double wall_time = 0;       // Unix seconds; 0: the log stamps it
};

struct EpochMetrics {
  int64_t epoch = 0;          // 1-based
  int64_t step = 0;           // optimizer steps done at the end of the epoch
  double train_loss = 0;      // mean over all ranks and steps
  double test_loss = 0;
  double test_acc = 0;        // fraction in [0, 1]
  double lr = 0;              // at the end of the epoch
  double epoch_seconds = 0;
  double samples_per_second = 0;
  double wall_time = 0;       // Unix seconds; 0: the log stamps it
  nlohmann::json to_json() const;
  static EpochMetrics from_json(const nlohmann::json& j);
};

/// Reads metrics.jsonl; UserError naming the file and line if it is corrupt.
std::vector<EpochMetrics> read_epoch_metrics(const std::string& jsonl_path);

class MetricsLog {
 public:
  /// Appends to `path` (metrics.jsonl, created if absent) and writes the
  /// other files beside it. An empty path makes a no-op log.
  explicit MetricsLog(std::string path);
  ~MetricsLog();
  /// A log point: one CSV row and the step scalars.
  void log_step(StepMetrics s);
  /// The end of an epoch: JSONL line, CSV row, epoch scalars, curves.svg.
  void append(EpochMetrics m);
  /// Keeps epochs 1..`epochs`, and step rows up to optimizer step `steps`
  /// (-1: those of the kept epochs), in every file (used when resuming).
  void truncate_to(int64_t epochs, int64_t steps = -1);
  const std::string& path() const { return path_; }
  const std::vector<EpochMetrics>& epochs() const { return epochs_; }

 private:
  EventWriter& events();
  std::string file(const std::string& name) const;
  void append_csv(const std::string& row) const;

  std::string path_, dir_;
  std::vector<EpochMetrics> epochs_;  // for curves.svg
  std::unique_ptr<EventWriter> events_;
};

}  // namespace ddp
