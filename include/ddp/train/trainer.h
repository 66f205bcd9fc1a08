// The training loop: one readable fit() that every run goes through.
//
// Set-up happens in a fixed order (device, SyncBatchNorm, gradient sync,
// optimizer, schedule, run directory, resume), then fit() loops over epochs:
// train, evaluate on a sharded test set, log, checkpoint. Everything the loop
// needs beyond that lives in its own module.
#pragma once

#include <memory>
#include <string>

#include "ddp/io/checkpoint.h"
#include "ddp/cli.h"
#include "ddp/data/dataset.h"
#include "ddp/io/metrics.h"
#include "ddp/models/net.h"
#include "ddp/train/lr_schedule.h"
#include "ddp/train/train_step.h"
#include "ddp/dist/world.h"

namespace ddp {

/// What a run trains: the model, its data, and a name for its architecture
/// (checked when resuming).
struct Parts {
  std::shared_ptr<Net> model;
  data::Splits data;
  std::string arch = "custom";
};

/// The training-step settings the flags ask for (also sets cuDNN autotuning
/// and TF32 on CUDA).
TrainStepOptions train_step_options(const Config& config, const torch::Device& device);

/// Asks every Trainer in this process to checkpoint and stop at the next
/// step boundary that all ranks agree on (called from signal handlers).
void request_stop();
bool stop_requested();

class Trainer {
 public:
  Trainer(Config config, World& world, Parts parts);
  ~Trainer();

  /// Trains every epoch and returns the last epoch's metrics.
  EpochMetrics fit();

  const std::string& run_dir() const { return run_dir_; }

 private:
  double train_epoch(int64_t epoch, int64_t& samples_seen);
  std::pair<double, double> evaluate();  // test loss, test accuracy
  void save(int64_t epoch, double test_acc);
  [[noreturn]] void save_and_stop(const std::string& path);
  std::string find_resume_checkpoint() const;
  void open_run_dir(const std::string& resume_from);
  void resume(const std::string& path);

  Config config_;
  World& world_;
  Parts parts_;
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<LrSchedule> schedule_;
  TrainState state_;
  std::string run_dir_;
  std::unique_ptr<MetricsLog> metrics_;
  int64_t steps_per_epoch_ = 0;
  double data_wait_seconds_ = 0;  // host time the last epoch waited for batches
  bool is_bar_ = false;
  bool stop_after_epoch_ = false;
  // Fault injection for tests of restarts: fail on this rank at this step,
  // in the first attempt only (DDPTRAIN_FAIL_AT_STEP=rank:step).
  int fail_rank_ = -1;
  int64_t fail_step_ = -1;
  bool fail_segv_ = false;
};

}  // namespace ddp
