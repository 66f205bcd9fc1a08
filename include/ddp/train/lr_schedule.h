// Learning-rate schedules with warmup. (The optimizers themselves are in
// flat_optimizer.h.) LrSchedule maps a global step to a learning rate; the
// trainer passes it to the optimizer before each step.
#pragma once

#include <string>

#include <torch/torch.h>

namespace ddp {

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
