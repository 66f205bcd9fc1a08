// SGD with momentum, Adam and AdamW over flat parameter buffers.
//
// GradSync lays every parameter and gradient out in one flat buffer per
// dtype, so an optimizer step is a fixed handful of kernels over those few
// tensors, however many parameter tensors the model has. On CUDA with
// LibTorch 2.2+ the step is LibTorch's fused kernel (one launch per buffer,
// with the learning rate and the step count held on the device, so a CUDA
// graph can capture it); elsewhere it is the same arithmetic as
// torch::optim's per-tensor optimizers, written with tensor ops over the
// flat buffers. Both equal torch::optim::SGD/Adam/AdamW to fp32 rounding
// (tests/train/flat_optimizer_test.cpp).
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/io/checkpoint.h"

namespace ddp {

struct FlatOptimizerOptions {
  TORCH_ARG(std::string, name) = "adamw";  // sgd | adam | adamw
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.0;   // L2 for sgd/adam, decoupled for adamw
  TORCH_ARG(double, momentum) = 0.9;       // sgd
  TORCH_ARG(double, beta1) = 0.9;          // floats: the seed's betas=(0, 0.999) crashed PyTorch
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  /// Use LibTorch's fused kernels where this build has them (CUDA, 2.2+).
  TORCH_ARG(bool, fused) = true;
};

class FlatOptimizer {
 public:
  /// `params[i]` and `grads[i]` are flat buffers of equal size (from GradSync).
  FlatOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads, FlatOptimizerOptions options);

  /// Sets the learning rate for the next step(). Call it outside a CUDA graph
  /// capture: it writes the device-side copy that a captured step reads.
  void set_lr(double lr);
  double lr() const { return lr_; }

  /// One update of every parameter. With `found_inf` (a 1-element float
  /// tensor, fp16 loss scaling), a non-zero value skips the update on the
  /// device; this needs the fused kernels.
  void step(const torch::Tensor& found_inf = {});

  /// Whether step() runs without host synchronisation or host-side
  /// per-step scalars (so it can be captured in a CUDA graph).
  bool capturable() const { return fused_; }

  /// Optimizer steps taken (read from the device).
  int64_t steps_taken() const;

  void save(TensorMap& state) const;
  void load(const TensorMap& state);

  const FlatOptimizerOptions& options() const { return o_; }

 private:
  FlatOptimizerOptions o_;
  bool adam_ = true, fused_ = false;
  std::vector<torch::Tensor> params_, grads_;
  std::vector<torch::Tensor> m_, v_;  // first/second moments (sgd: momentum buffer in m_)
  std::vector<torch::Tensor> step_;   // fused path: one float step count per buffer, on its device
  torch::Tensor lr_t_;                // learning rate on the device (fused path)
  double lr_ = 0;
  int64_t host_step_ = 0;             // composed path
};

}  // namespace ddp
