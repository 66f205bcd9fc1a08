// An exponential moving average of the weights (--ema DECAY), kept over
// the training step's flat parameter buffers (grad_sync.h).
//
// Why: the average of the last few thousand steps' weights often validates
// better than the last step's (Polyak averaging; timm's ModelEma, the EMA
// callbacks written for Lightning). Here it costs one lerp per flat buffer
// and step, however many parameters the model has, and reads nothing back
// to the host: the decay is computed on the device from an update count
// held there, so a CUDA graph captures the update with the rest of the step.
//
// Warm-up: update n (from 0) uses the decay min(DECAY, (1 + n) / (10 + n)),
// so the first updates follow the weights closely (0.1, 0.18, ...) and the
// average does not hold on to the random initialisation for the thousands
// of steps that 0.999 would take. A step that fp16 loss scaling skips
// still counts (the weights it averages in are the previous step's), as
// with timm's: the update stays free of host decisions, so it is captured.
//
// Buffers (batch norm's running statistics) are not averaged: the averaged
// model runs with the live buffers, as timm's ModelEmaV3 with
// exclude_buffers. Running statistics are an average over recent batches
// already; an integer buffer (num_batches_tracked) has no average; and a
// buffer kept apart would cost a kernel per buffer and step. So only the
// parameters are swapped in for validation, and a checkpoint holds the
// average of each parameter (ema/<name>, beside the live weights).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/io/checkpoint.h"

namespace ddp {

class WeightEma {
 public:
  /// The average of `flat_params` (the training step's flat parameter
  /// buffers, of which `model`'s trainable parameters are views), starting
  /// from their values now. `decay` in (0, 1).
  WeightEma(torch::nn::Module& model, std::vector<torch::Tensor> flat_params, double decay);

  /// One update, after an optimizer step: device work only (capturable).
  void update();

  double decay() const { return decay_; }
  /// Updates made (read from the device).
  int64_t updates() const;
  /// The averages, laid out as the flat parameter buffers.
  const std::vector<torch::Tensor>& averages() const { return average_; }
  /// The average of parameter `name` (as model.named_parameters() names
  /// it), a view into averages(); undefined for a parameter not trained.
  torch::Tensor average_of(const std::string& name) const;

  /// While the returned guard lives, the model's parameters hold the
  /// averages (copied into the flat buffers, so every view and a captured
  /// graph's pointers stay valid); the weights come back when it dies.
  /// `written` runs after each copy (GradSync::bf16_copies_stale: the bf16
  /// copies no longer hold the parameters).
  class Swap {
   public:
    Swap(WeightEma& ema, std::function<void()> written);
    ~Swap();
    Swap(const Swap&) = delete;
    Swap& operator=(const Swap&) = delete;

   private:
    WeightEma& ema_;
    std::function<void()> written_;
    std::vector<torch::Tensor> weights_;
  };

  /// "ema/<name>" for each trained parameter and "ema_updates".
  void save(TensorMap& state) const;
  /// From save()'s entries; UserError if they are missing (a checkpoint of
  /// a run without --ema) or of other shapes.
  void load(const TensorMap& state);

 private:
  double decay_;
  std::vector<torch::Tensor> flat_, average_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;  // views into average_
  torch::Tensor updates_;  // double, on the parameters' device
};

}  // namespace ddp
