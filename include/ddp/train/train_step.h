// One training step of data-parallel SGD, and what makes it fast on a GPU.
//
// run() does a micro-batch: the task's training_step() (forward and loss)
// under autocast, then backward (with the
// gradient all-reduce overlapping it, see grad_sync.h). On the last
// micro-batch of an optimizer step it also waits for the gradients, unscales
// them (fp16), clips them, and steps the flat optimizer. Nothing in it reads
// a value back to the host, so a whole step can be captured in a CUDA graph:
// with cuda_graph, the first `graph_warmup` steps run eagerly on a side
// stream (cuDNN autotuning, NCCL set-up), then one step is captured and every
// later batch of the same shape is copied into the graph's static input
// tensors and replayed. Where capture is impossible (CPU, gradient
// accumulation, no fused optimizer, a failed capture) it says why once and
// stays eager.
#pragma once

#include <memory>
#include <string>

#include "ddp/io/checkpoint.h"
#include "ddp/compat.h"
#include "ddp/train/ema.h"
#include "ddp/train/flat_optimizer.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/train/loss.h"
#include "ddp/models/net.h"
#include "ddp/train/task.h"
#include "ddp/dist/world.h"

namespace ddp {

namespace models {
class GptImpl;
}

struct TrainStepOptions {
  TORCH_ARG(std::string, amp) = "off";    // off | bf16 | fp16 (dynamic loss scaling)
  TORCH_ARG(bool, cuda_graph) = false;
  TORCH_ARG(bool, channels_last) = false;  // inputs and 4-D weights
  TORCH_ARG(int, accum_steps) = 1;
  TORCH_ARG(double, clip_grad_norm) = 0;   // 0: off
  TORCH_ARG(double, bucket_cap_mb) = 25;
  TORCH_ARG(int, graph_warmup) = 3;
  TORCH_ARG(FlatOptimizerOptions, optimizer);
  /// ZeRO-1 over this step's ranks (FlatOptimizerOptions::shard_over).
  TORCH_ARG(bool, shard_optimizer) = false;
  /// With shard_optimizer: how the gradients are summed. kAuto: reduce-
  /// scattered where the backend has a reduce_scatter (NCCL), else
  /// all-reduced whole (sharded_reduction()); kReduceScatter on a backend
  /// without one runs one reduce per rank's part.
  TORCH_ARG(GradientReduction, gradient_reduction) = GradientReduction::kAuto;
  /// ZeRO-2 (GradSyncOptions::shard_gradients), with the optimizer state
  /// sharded too (shard_optimizer implied).
  TORCH_ARG(bool, shard_gradients) = false;
  /// Decay of the weights' moving average (ema.h), updated after every
  /// optimizer step; 0: none.
  TORCH_ARG(double, ema) = 0;
  /// The loss of the (Net, options) constructor, which trains a Net on
  /// "input" and "target" with compute_loss(); unused with a Task.
  TORCH_ARG(LossOptions, loss);
};

class TrainStep : public Stateful {
 public:
  /// Trains `model` (the module task.make_model() returned) with the task's
  /// training_step().
  TrainStep(Task& task, torch::nn::Module& model, World& world, TrainStepOptions options);
  /// Trains a Net on {"input", "target"} batches with options.loss().
  TrainStep(Net& model, World& world, TrainStepOptions options);
  ~TrainStep() override;

  /// An input in the memory format the model runs in (channels-last or not).
  torch::Tensor prepare(const torch::Tensor& x) const;

  /// Autocast as --amp asks, for a forward pass on `device` (training and
  /// evaluation use the same precision).
  compat::AutocastGuard autocast(c10::DeviceType device) const {
    return compat::AutocastGuard(device, amp_dtype_, amp_on_);
  }

  /// One micro-batch (see above); `lr` is used when this is the last one.
  /// `loss_scale` divides the loss before backward (gradient accumulation:
  /// 1 / the micro-batches in this optimizer step). Returns the task's loss
  /// and logs, detached, on the device.
  StepOutput run(const data::Batch& batch, bool last_micro, double lr, double loss_scale = 1.0);
  /// run() on {"input": x, "target": y}; returns the loss.
  torch::Tensor run(const torch::Tensor& x, const torch::Tensor& y, bool last_micro, double lr);

  /// With --ema: the model's parameters hold the weights' moving average
  /// while the returned guard lives (validation, best.pt's choice); null
  /// without --ema.
  std::unique_ptr<WeightEma::Swap> averaged_weights();
  /// The weights' moving average; null without --ema.
  const WeightEma* ema() const { return ema_.get(); }

  /// Optimizer state, the fp16 loss scale and the weights' moving average,
  /// for checkpoints.
  void save(TensorMap& state) const override;
  void load(const TensorMap& state) override;

  /// --shard-optimizer: run() returns with the updated parameters still
  /// being gathered (FlatOptimizer::wait_for_parameters); whoever reads the
  /// model's parameters outside run() calls this first, on every rank
  /// (evaluation, a checkpoint, an export, a hook). The next run() waits
  /// itself, as do averaged_weights(), gather_optimizer_state() and load().
  void wait_for_parameters() { optimizer_->wait_for_parameters(); }
  /// Whether the model's forward waits for that gather block by block
  /// (ddptrain's GPT under LmTask; see wait_by_part) rather than run()
  /// for all of it before the forward.
  bool waits_for_parameters_by_block() const { return part_waits_ != nullptr; }

  GradSync& sync() { return *sync_; }
  FlatOptimizer& optimizer() { return *optimizer_; }
  /// Before a checkpoint, on every rank: a sharded optimizer's state is
  /// gathered whole for save() (FlatOptimizer::gather_state).
  void gather_optimizer_state() { optimizer_->gather_state(); }
  /// The fp16 dynamic loss scale (a 1-element device tensor); undefined
  /// unless --amp fp16.
  const torch::Tensor& loss_scale() const { return scale_; }
  /// True once a CUDA graph has been captured and is being replayed.
  bool graphed() const;
  /// Why --cuda-graph is not in use ("" when it is or was not asked for).
  const std::string& graph_fallback() const { return fallback_; }
  /// Whether the backward's weight gradients run on a second CUDA stream
  /// (--side-stream; cuda/side_stream.h), as decided when this step was
  /// made: under bf16 autocast with ddptrain's linear kernels, and with
  /// auto only for ddptrain's GPT and LmTask trained by one process.
  bool side_stream() const { return side_stream_; }

 private:
  StepOutput step_body(const data::Batch& batch, bool last_micro, double loss_scale);
  GradientReduction gradient_reduction() const;  // the GradSync's: options resolved for this world
  bool try_capture(const data::Batch& batch);
  void fall_back(const std::string& why);

  std::unique_ptr<Task> own_task_;  // the (Net, options) constructor's
  Task& task_;
  torch::nn::Module& model_;
  World& world_;
  TrainStepOptions o_;
  std::unique_ptr<GradSync> sync_;
  std::unique_ptr<FlatOptimizer> optimizer_;
  std::unique_ptr<WeightEma> ema_;
  c10::ScalarType amp_dtype_ = c10::ScalarType::Float;
  bool amp_on_ = false, fp16_ = false;
  bool broadcast_buffers_ = false;  // local batch norm on several ranks
  bool expect_unused_ = false;      // SyncBatchNorm on several ranks: GradSync::expect_gradients_from
  torch::Tensor scale_, growth_tracker_, found_inf_;  // fp16 loss scaling
  bool graph_wanted_ = false;
  bool side_stream_ = false;  // see side_stream()
  int64_t eager_steps_ = 0;
  std::string fallback_;
  struct Graph;
  std::unique_ptr<Graph> graph_;
  // --shard-optimizer on ddptrain's GPT: the forward waits for the gather
  // part by part (GptImpl::before_part holds a weak pointer to this).
  struct PartWaits;
  std::shared_ptr<PartWaits> part_waits_;
  void wait_by_part(models::GptImpl& gpt);
};

}  // namespace ddp
