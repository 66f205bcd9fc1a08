// The run's record, in the run directory, written by rank 0 only.
//
// The task names its metrics (task.h): a classifier reports test_loss and
// test_acc, a regression test_mse, test_mae and test_r2, a task of your own
// whatever it returns. Every file below carries them by name.
//
// metrics.jsonl  one JSON object per epoch: epoch, step, wall_time,
//                train_loss, lr, epoch_seconds, samples_per_second, the
//                task's metrics by name, and "monitor"/"goal" (the metric
//                that picks best.pt, and whether min or max is better).
// metrics.csv    the same epochs plus the trainer's log points, for
//                spreadsheets and pandas. Columns:
//                  kind,epoch,step,wall_time,train_loss,lr,epoch_seconds,samples_per_second
//                then one column per metric, in name order (the header is
//                rewritten when a new name appears). kind is "step" (a log
//                point: train_loss is the mean over the epoch so far,
//                samples_per_second since the epoch began; the metric
//                columns and epoch_seconds empty) or "epoch" (every
//                column). step counts optimizer steps since the run
//                began; wall_time is Unix seconds.
// events.out.tfevents.<secs>.<host>
//                TensorBoard scalars: train/loss, train/lr,
//                train/samples_per_second at log points; train/epoch_loss
//                and one tag per metric at the end of each epoch (test_loss
//                -> test/loss, test_acc -> test/accuracy, test_r2 ->
//                test/r2), all against the optimizer step (tensorboard.h).
// curves.svg     losses, and the monitor metric, against epoch, rewritten
//                after each epoch (see plot.h).
//
// Every line is flushed as soon as it is complete, so a crash loses at most
// the epoch in progress. When a run resumes, truncate_to() cuts all four back
// to the checkpoint, so no epoch or step appears twice.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <map>

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
  /// The task's metrics and logs by name, e.g. test_loss, test_acc (a
  /// fraction in [0, 1]), test_r2.
  std::map<std::string, double> values;
  std::string monitor;        // the metric that picks best.pt ("" if unknown)
  std::string goal = "min";   // min | max
  double lr = 0;              // at the end of the epoch
  double epoch_seconds = 0;
  double samples_per_second = 0;
  double wall_time = 0;       // Unix seconds; 0: the log stamps it
  /// values[name], or NaN when absent.
  double value(const std::string& name) const;
  nlohmann::json to_json() const;
  static EpochMetrics from_json(const nlohmann::json& j);
};

/// TensorBoard tag and display name of a metric: its first '_' becomes '/'
/// (or ' '), and "acc" reads "accuracy": test_acc -> test/accuracy.
std::string metric_tag(const std::string& name);
/// True for accuracies (names ending in "_acc"): fractions shown in per cent.
bool is_fraction_metric(const std::string& name);
std::string metric_label(const std::string& name);

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
  void append_csv(const std::string& row);
  /// Rewrites metrics.csv under `columns`, moving each cell to its column.
  void rewrite_csv(const std::vector<std::string>& columns);
  std::string epoch_row(const EpochMetrics& m) const;

  std::string path_, dir_;
  std::vector<EpochMetrics> epochs_;  // for curves.svg
  std::vector<std::string> columns_;  // metrics.csv's header
  std::unique_ptr<EventWriter> events_;
};

}  // namespace ddp
