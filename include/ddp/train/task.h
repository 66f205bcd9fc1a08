// The task: what a batch means. It owns the model's forward pass, the loss
// and the metrics; the trainer owns everything around them (ranks, the
// sampler, precision, gradient sync, the optimizer, checkpoints and logs).
//
// The shape is Lightning's LightningModule, in C++:
//
//   struct MyTask : ddp::Task {
//     MyModel model{nullptr};
//     ddp::data::Splits make_data(const ddp::Config&, ddp::World&) override;   // optional
//     ModulePtr make_model(const ddp::Config&, const ddp::data::Splits&) override {
//       model = MyModel(...);
//       return model.ptr();
//     }
//     ddp::StepOutput training_step(const ddp::data::Batch& b) override {
//       return torch::nn::functional::cross_entropy(model(b.input()), b.target());
//     }
//     ddp::Totals validation_step(const ddp::data::Batch& b) override;      // sums
//     ddp::Metrics validation_metrics(const ddp::Totals& t) override;       // from the sums
//     ddp::Monitor monitor() const override { return {"test_acc", ddp::Goal::kMax}; }
//   };
//
// Autocast, loss scaling, gradient sync, clipping and the optimizer wrap
// training_step(), and --cuda-graph captures it, so it must not read values
// back to the host (no .item()). validation_step() returns sums (of any
// shape: a confusion matrix is fine); the trainer adds them over batches and
// ranks in one all-reduce, with every test sample counted exactly once, and
// validation_metrics() turns the totals into the numbers that are logged.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/cli.h"
#include "ddp/data/dataset.h"
#include "ddp/models/net.h"
#include "ddp/train/flat_optimizer.h"
#include "ddp/train/loss.h"
#include "ddp/train/stop_rule.h"
#include "ddp/train/lr_schedule.h"

namespace ddp {

class World;

using ModulePtr = std::shared_ptr<torch::nn::Module>;
/// Named tensors a step returns: scalars to log, or sums to total.
using TensorMap = std::map<std::string, torch::Tensor>;
/// Validation sums, added over batches and ranks (float64, on the CPU).
using Totals = TensorMap;
/// Named numbers, e.g. {"test_loss": 0.31, "test_acc": 0.89}.
using Metrics = std::map<std::string, double>;

/// What training_step() gives back.
struct StepOutput {
  /* implicit */ StepOutput(torch::Tensor loss_) : loss(std::move(loss_)) {}
  StepOutput(torch::Tensor loss_, TensorMap logs_) : loss(std::move(loss_)), logs(std::move(logs_)) {}
  /// The scalar loss to minimise (the mean over the batch).
  torch::Tensor loss;
  /// Scalars to log by name, e.g. {"train_aux", aux}: averaged over the
  /// epoch and the ranks like the loss, and written beside it.
  TensorMap logs;
};


/// Where training stands, for the hooks.
struct StepEnd {
  int64_t step = 0;     // optimizer steps done
  int64_t epoch = 0;    // 1-based
  double lr = 0;
  int64_t samples = 0;  // samples this step trained on, over all ranks and micro-batches
};
struct EpochEnd {
  int64_t epoch = 0;
  int64_t step = 0;
  Metrics& metrics;   // add your own; they are logged with the rest
};

/// The optimizer and schedule the flags ask for, which configure_optimizer()
/// may change.
struct OptimizerSetup {
  FlatOptimizerOptions optimizer;
  LrScheduleOptions schedule;
};

class Task {
 public:
  virtual ~Task() = default;

  // ---- 1. Before the flags are parsed (in every process, so keep the
  //         constructor cheap: build the model in make_model) ----
  /// Adds the task's own flags (config.add_flag) and sets defaults of
  /// built-in flags from code (e.g. config.augment = "none").
  virtual void add_flags(Config& config) {}

  // ---- 2. Set-up, on every rank ----
  /// The data. Default: the built-in datasets named by --dataset/--data_root.
  virtual data::Splits make_data(const Config& config, World& world);
  /// The model to train; keep it to call it in the steps. Default: the
  /// built-in model named by --model, sized from the data.
  virtual ModulePtr make_model(const Config& config, const data::Splits& data);
  /// Names the architecture; --resume refuses a checkpoint of another one.
  virtual std::string arch() const { return arch_; }

  // ---- 3. The steps ----
  virtual StepOutput training_step(const data::Batch& batch) = 0;
  /// Sums over the batch, e.g. {"loss": loss * n, "correct": c, "count": n}.
  virtual TensorMap validation_step(const data::Batch& batch) = 0;
  /// Metrics from the totals over a whole evaluation split. Default: every
  /// scalar total X other than "count" gives test_X = X / count. Name them
  /// once, X or test_X: each gets the prefix of the split it was computed
  /// on, val_X on the validation split, test_X on test (validation.h).
  /// Both also run once before training on a few batches
  /// (--sanity-val-steps, as Lightning's sanity check), whose metrics are
  /// checked, not logged.
  virtual Metrics validation_metrics(const Totals& totals);
  virtual Monitor monitor() const { return {}; }

  // ---- 3b. Prediction (`predict`: a trained model on data, written to a file) ----
  /// Named outputs for a batch, each with the batch's size as its first
  /// dimension, e.g. {"prob": softmax(logits)}; they become the file's
  /// columns (.csv) or its array (.npy). Runs under NoGradGuard in eval
  /// mode, with the checkpoint's weights in model(). Default:
  /// {"output": the model's output for "input"}, for a model that is a
  /// ddp::Net (the built-in ones); override it for another model (the
  /// template does).
  virtual TensorMap predict_step(const data::Batch& batch);
  /// The data that `predict --split PATH` predicts, in its order. Default:
  /// for ddptrain's own data, the test split of make_data() with --data_root
  /// PATH; a task whose make_data() is its own overrides it (else `predict
  /// --split PATH` is refused: nothing says its make_data() read PATH).
  virtual data::DatasetPtr make_predict_data(const Config& config, World& world, const std::string& path);
  /// The model make_model() returned, once `predict` has made and loaded it
  /// (null before; the trainer leaves it so).
  const ModulePtr& model() const { return model_; }
  void set_model(ModulePtr model) { model_ = std::move(model); }

  // ---- 4. Optional hooks ----
  /// Change the optimizer and schedule that the flags gave.
  virtual void configure_optimizer(const Config& config, OptimizerSetup& setup) {}
  /// After every optimizer step, on every rank (e.g. an EMA of the weights).
  virtual void on_step_end(const StepEnd& step) {}
  /// After every validation, on every rank; may add metrics.
  virtual void on_epoch_end(EpochEnd& epoch) {}
  /// Built-in flags that this task does not read; giving one is an error.
  /// Default: the built-in tasks' loss flags, and the data and model flags
  /// when make_data or make_model is your own. Your program's --help asks
  /// before set-up, when no default has run yet, and leaves these out.
  virtual std::vector<std::string> ignored_flags() const;

  /// True once the default make_data() has loaded a built-in dataset
  /// (--augment auto augments those images only).
  bool uses_builtin_data() const { return builtin_data_; }

 protected:
  std::string arch_ = "custom";
  ModulePtr model_;
  bool builtin_data_ = false, builtin_model_ = false;  // set by the defaults above
  /// The test split of make_data() with --data_root PATH (the default
  /// make_predict_data, for data ddptrain reads).
  data::DatasetPtr test_split_at(const Config& config, World& world, const std::string& path);
};

/// Classification: cross-entropy (with --label-smoothing) on "input" ->
/// logits and "target" class indices; metrics test_loss and test_acc
/// (monitor: test_acc, higher is better).
class ClassificationTask : public Task {
 public:
  void add_flags(Config& config) override {}
  ModulePtr make_model(const Config& config, const data::Splits& data) override;
  /// The network; default: the built-in one that --model names.
  virtual std::shared_ptr<Net> make_net(const Config& config, const data::Splits& data);
  StepOutput training_step(const data::Batch& batch) override;
  TensorMap validation_step(const data::Batch& batch) override;
  Metrics validation_metrics(const Totals& totals) override;
  Monitor monitor() const override { return {"test_acc", Goal::kMax}; }
  std::vector<std::string> ignored_flags() const override;

 protected:
  std::shared_ptr<Net> net_;
  LossOptions loss_;
};

/// Regression: "input" -> outputs shaped like "target"; --loss mse, l1 or
/// huber; metrics test_loss, test_mse, test_mae and test_r2 (R squared over
/// the whole validation set; monitor: test_loss, lower is better).
class RegressionTask : public ClassificationTask {
 public:
  void add_flags(Config& config) override;
  /// --dataset auto or synthetic: the built-in learnable regression
  /// (data::make_synthetic_regression); otherwise the files named.
  data::Splits make_data(const Config& config, World& world) override;
  std::shared_ptr<Net> make_net(const Config& config, const data::Splits& data) override;
  StepOutput training_step(const data::Batch& batch) override;
  TensorMap validation_step(const data::Batch& batch) override;
  Metrics validation_metrics(const Totals& totals) override;
  Monitor monitor() const override { return {"test_loss", Goal::kMin}; }
  std::vector<std::string> ignored_flags() const override;
};

/// The built-in task that --task names.
std::shared_ptr<Task> make_builtin_task(const std::string& name);
/// Default flags with every built-in task's own flags added (and no other
/// default changed), for reading --task before the task is known.
Config builtin_task_flags();

/// Throws UserError if the user gave a flag that `task` ignores.
void check_flags_apply(const Config& config, const Task& task);

}  // namespace ddp
