// Learning-rate schedules.
#include "ddp/train/lr_schedule.h"

#include <cmath>

#include "ddp/error.h"

namespace ddp {

LrSchedule::LrSchedule(LrScheduleOptions options) : o_(std::move(options)) {
  const auto& k = o_.kind();
  check_user(k == "constant" || k == "step" || k == "cosine" || k == "onecycle",
             "schedule '" + k + "' is not known.", "use constant, step, cosine or onecycle.");
  if (o_.total_steps() < 1) o_.total_steps(1);
  o_.warmup_steps(std::min(std::max<int64_t>(o_.warmup_steps(), 0), o_.total_steps()));
}

double LrSchedule::at(int64_t step) const {
  const double peak = o_.peak_lr();
  const int64_t warm = o_.warmup_steps(), total = o_.total_steps();
  // One-cycle starts from peak/25, as in the usual one-cycle policy; the
  // others warm up linearly from near zero.
  const double start = o_.kind() == "onecycle" ? peak / 25 : 0.0;
  if (step < warm) return start + (peak - start) * static_cast<double>(step + 1) / static_cast<double>(warm);
  const double t = total > warm ? static_cast<double>(step - warm) / static_cast<double>(total - warm) : 1.0;
  if (o_.kind() == "constant") return peak;
  if (o_.kind() == "step") return peak * (t < 0.5 ? 1.0 : (t < 0.75 ? 0.1 : 0.01));
  // cosine and onecycle anneal to zero over the remaining steps.
  return 0.5 * peak * (1.0 + std::cos(M_PI * std::min(t, 1.0)));
}

}  // namespace ddp
