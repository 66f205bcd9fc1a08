// Learning-rate schedules with warmup. (The optimizers themselves are in
// flat_optimizer.h.) LrSchedule maps a global step to a learning rate; the
// trainer passes it to the optimizer before each step.
//
// Each schedule is the one of torch.optim.lr_scheduler that carries its name,
// step for step (tests/train/lr_schedule_test.cpp compares with values that
// PyTorch wrote, tools/gen_schedule_testdata.py). For S steps and W warm-up
// steps, peak = peak_lr:
//   warm-up (W > 0)  peak * (s+1)/W for s < W                 LinearLR(1/W, 1, W-1)
//   constant         peak
//   step             peak * 0.1^k, k = milestones passed at 50% and 75% of S-W   MultiStepLR
//   cosine           peak * (1 + cos(pi * (s-W)/(S-W))) / 2    CosineAnnealingLR(T_max=S-W)
//   onecycle         OneCycleLR(peak, S, pct_start = W/S, or pct_start() when W = 0):
//                    cosine from peak/25 up to peak, then down to peak/25/1e4;
//                    it is its own warm-up (the learning rate only: the
//                    optimizer's momentum is not cycled)
#pragma once

#include <string>

#include <torch/torch.h>

namespace ddp {

struct LrScheduleOptions {
  TORCH_ARG(std::string, kind) = "constant";  // constant | step | cosine | onecycle
  TORCH_ARG(double, peak_lr) = 1e-3;
  TORCH_ARG(int64_t, total_steps) = 1;
  /// Linear warm-up steps; for onecycle the rising phase (0: pct_start).
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// onecycle without warm-up steps: the rising fraction of the run (PyTorch's default).
  TORCH_ARG(double, pct_start) = 0.3;
};

class LrSchedule {
 public:
  explicit LrSchedule(LrScheduleOptions options);
  /// Learning rate for optimizer step `step` (0-based).
  double at(int64_t step) const;

 private:
  double one_cycle(int64_t step) const;
  LrScheduleOptions o_;
};

}  // namespace ddp
