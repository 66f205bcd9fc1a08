// Learning-rate schedules, written as the closed forms of PyTorch's
// schedulers of the same names (see lr_schedule.h for the formulas).
#include "ddp/train/lr_schedule.h"

#include <cmath>

#include "ddp/error.h"

namespace ddp {
namespace {

// Cosine from `from` (pct 0) to `to` (pct 1), as OneCycleLR's _annealing_cos.
double cosine_between(double from, double to, double pct) {
  return to + (from - to) / 2.0 * (std::cos(M_PI * pct) + 1.0);
}

}  // namespace

LrSchedule::LrSchedule(LrScheduleOptions options) : o_(std::move(options)) {
  const auto& k = o_.kind();
  check_user(k == "constant" || k == "step" || k == "cosine" || k == "onecycle",
             "schedule '" + k + "' is not known.", "use constant, step, cosine or onecycle.");
  if (o_.total_steps() < 1) o_.total_steps(1);
  o_.warmup_steps(std::min(std::max<int64_t>(o_.warmup_steps(), 0), o_.total_steps()));
}

// OneCycleLR(max_lr=peak, total_steps=S, pct_start) with div_factor 25,
// final_div_factor 1e4 and cosine annealing: the rise ends at the
// (fractional) step pct_start*S - 1, the fall at step S-1.
double LrSchedule::one_cycle(int64_t step) const {
  const double peak = o_.peak_lr(), initial = peak / 25.0, last = initial / 1e4;
  const double total = static_cast<double>(o_.total_steps());
  const double pct_start = o_.warmup_steps() > 0 ? static_cast<double>(o_.warmup_steps()) / total : o_.pct_start();
  const double rise_end = pct_start * total - 1.0, s = static_cast<double>(step);
  if (s <= rise_end) return cosine_between(initial, peak, rise_end > 0 ? s / rise_end : 1.0);
  const double fall = total - 1.0 - rise_end;
  return cosine_between(peak, last, fall > 0 ? std::min(1.0, (s - rise_end) / fall) : 1.0);
}

double LrSchedule::at(int64_t step) const {
  if (o_.kind() == "onecycle") return one_cycle(step);
  const double peak = o_.peak_lr();
  const int64_t warm = o_.warmup_steps(), total = o_.total_steps();
  if (step < warm) return peak * static_cast<double>(step + 1) / static_cast<double>(warm);
  if (o_.kind() == "constant") return peak;
  const int64_t after = step - warm, rest = total - warm;
  if (o_.kind() == "step") {
    // MultiStepLR's milestones ceil(rest/2) and ceil(3 rest/4), in integers.
    const int64_t first = (rest + 1) / 2, second = (3 * rest + 3) / 4;
    return peak * (after >= second ? 0.01 : (after >= first ? 0.1 : 1.0));
  }
  // cosine: CosineAnnealingLR(T_max = rest, eta_min = 0).
  const double t = rest > 0 ? static_cast<double>(after) / static_cast<double>(rest) : 1.0;
  return 0.5 * peak * (1.0 + std::cos(M_PI * std::min(t, 1.0)));
}

}  // namespace ddp
