// The training loop: one readable fit() that every run goes through.
//
// Set-up happens in a fixed order, in the constructor: the task's data and
// model, --pretrain, SyncBatchNorm, the training step (gradient sync,
// optimizer), the schedule, resume, the run directory. Then fit() loops over
// epochs: train, evaluate on a sharded test set, log, checkpoint. The task
// (task.h) decides what a batch means; everything else the loop needs lives
// in its own module.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ddp/io/checkpoint.h"
#include "ddp/cli.h"
#include "ddp/data/dataset.h"
#include "ddp/io/metrics.h"
#include "ddp/models/net.h"
#include "ddp/train/lr_schedule.h"
#include "ddp/train/stop_rule.h"
#include "ddp/train/task.h"
#include "ddp/train/train_step.h"
#include "ddp/dist/world.h"

namespace ddp {

/// The training-step settings the flags ask for (also sets cuDNN autotuning
/// and TF32 on CUDA).
TrainStepOptions train_step_options(const Config& config, const torch::Device& device);


class Trainer {
 public:
  Trainer(Config config, World& world, Task& task);
  ~Trainer();

  /// Trains every epoch and returns the last epoch's metrics.
  EpochMetrics fit();
  /// One pass over the choosing split (validation if there is one, else
  /// test), sharded across ranks (every sample counted once): the task's
  /// validation metrics, named val_* or test_*.
  Metrics validate() { return *evaluate(choosing_split(), choosing_, -1, false); }

  const std::string& run_dir() const { return run_dir_; }
  torch::nn::Module& model() { return *model_; }

  /// A test hook: called after every optimizer step on this rank (fault
  /// injection, see tests/worker). Unset in normal runs.
  static std::function<void(const World&, int64_t step)>& after_step_hook();

 private:
  // One training epoch's batches: its loader, and the feeder that moves
  // them (and with a device stage, finishes them) onto the device.
  struct EpochFeed;
  std::unique_ptr<EpochFeed> make_feed(int64_t epoch, int64_t start_batch);
  double train_epoch(int64_t epoch, int64_t& samples_seen, Metrics& logs);
  // nullopt: a stop signal was agreed on during it (`stoppable` only).
  // `average`: with --ema, judge the weights' average (swapped in and back),
  // not the weights as they are (test_best() has loaded best.pt's average).
  std::optional<Metrics> evaluate(const data::DatasetPtr& split, const std::string& prefix, int64_t max_batches,
                                  bool stoppable, bool average = true);
  const data::DatasetPtr& choosing_split() const { return data_.val ? data_.val : data_.test; }
  void test_best();
  void print_choosing_split() const;
  void sanity_validation();
  void save(int64_t epoch, double monitored, bool periodic);
  void save_job_checkpoint(const std::string& path);
  bool reached_stop_at(const Metrics& metrics) const;
  void check_stop_rule() const;
  int64_t warmup_steps() const;
  void print_start() const;
  void note_fewer_samples_than_asked() const;
  void print_summary(const EpochMetrics& last, double seconds) const;
  [[noreturn]] void save_and_stop(const std::string& path);
  std::string find_resume_checkpoint();
  void open_run_dir(const std::string& resume_from);
  void resume(const std::string& path);
  void set_aside_abandoned_branch();
  bool patience_run_out_on_rank_0(double monitored);
  void save_top_k(int64_t epoch, double monitored);
  void keep_global_batch(const CheckpointMeta& saved);
  void check_same_data(const CheckpointMeta& saved, const std::string& checkpoint) const;
  void hint_if_slow(int64_t batches_done, int64_t batches_per_epoch, double seconds);
  void hint_if_data_bound(int64_t epoch, double wait_share, int64_t samples);
  void warn_if_not_finite(int64_t epoch, const Metrics& metrics);
  void check_schedule_length(const CheckpointMeta& saved, const LrScheduleOptions& now) const;
  Config job_config() const;
  CheckpointMeta meta() const;
  std::string command(const std::string& args) const;
  std::string placement_flags() const;

  Config config_;
  World& world_;
  Task& task_;
  data::Splits data_;
  std::string layers_line_;       // what --convert-layers did, printed with the start lines ("": nothing to say)
  nlohmann::json data_identity_;  // of the splits as make_data() gave them (data/identity.h), saved in checkpoints
  ModulePtr model_;
  Monitor monitor_;          // named as the choosing split reports it (val_* or test_*)
  std::string choosing_;     // that split's metric prefix: "val_" with a validation split, else "test_"
  StopRule stop_rule_;       // --stop-at (or --stop-at-acc) naming the choosing split's metric
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<LrSchedule> schedule_;
  TrainState state_;
  std::string run_dir_;
  RunDirLock run_dir_lock_;  // rank 0: held while this job owns run_dir_
  std::string restart_dir_;  // on a restart: the run directory this job made, if any
  std::unique_ptr<MetricsLog> metrics_;
  int64_t steps_per_epoch_ = 0;
  double data_wait_seconds_ = 0;  // host time the last epoch waited for batches
  bool augment_ = false;  // --augment, resolved for this data (data::augment_applies)
  bool is_bar_ = false;
  bool stop_after_epoch_ = false;
  bool hinted_slow_ = false;
  bool hinted_data_ = false;
  bool warned_not_finite_ = false;  // a non-finite validation metric, said once a job
  std::vector<std::string> log_names_;  // training_step()'s logs, fixed at the first step
  std::unique_ptr<EpochFeed> next_feed_;  // the next epoch's, already loading during validation
  int64_t next_feed_epoch_ = 0;
};

}  // namespace ddp
