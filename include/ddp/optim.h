// Optimizers with valid defaults, and learning-rate schedules with warmup.
//
// make_optimizer() builds LibTorch's SGD / Adam / AdamW with betas (0.9,
// 0.999) as floats (the seed's betas=(0, 0.999) crashes current PyTorch).
// LrSchedule maps a global step to a learning rate; the trainer sets it on
// every parameter group before each optimizer step.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddp {

struct OptimizerOptions {
  TORCH_ARG(std::string, name) = "adamw";   // sgd | adam | adamw
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, momentum) = 0.9;        // sgd only
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<torch::Tensor>& params,
                                                        const OptimizerOptions& options);

/// Sets the learning rate of every parameter group.
void set_lr(torch::optim::Optimizer& optimizer, double lr);

struct LrScheduleOptions {
  TORCH_ARG(std::string, kind) = "constant";  // constant | step | cosine | onecycle
  TORCH_ARG(double, peak_lr) = 1e-3;
  TORCH_ARG(int64_t, total_steps) = 1;
  TORCH_ARG(int64_t, warmup_steps) = 0;
};

class LrSchedule {
 public:
  explicit LrSchedule(LrScheduleOptions options);
  /// Learning rate for optimizer step `step` (0-based).
  double at(int64_t step) const;

 private:
  LrScheduleOptions o_;
};

}  // namespace ddp
