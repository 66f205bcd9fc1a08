// Learning-rate schedules.
#include <cmath>
#include <set>

#include "ddp/error.h"
#include "ddp/train/lr_schedule.h"
#include "support/testing.h"

#include <nlohmann/json.hpp>

namespace {

TEST(Schedule, WarmupThenCosineToZero) {
  ddp::LrSchedule s(ddp::LrScheduleOptions().kind("cosine").peak_lr(1.0).total_steps(110).warmup_steps(10));
  EXPECT_NEAR(s.at(0), 0.1, 1e-12);
  EXPECT_NEAR(s.at(9), 1.0, 1e-12);
  EXPECT_NEAR(s.at(10), 1.0, 1e-12);
  EXPECT_NEAR(s.at(60), 0.5, 1e-12);
  EXPECT_NEAR(s.at(110), 0.0, 1e-12);
  for (int i = 11; i < 110; ++i) EXPECT_LT(s.at(i), s.at(i - 1));
}

TEST(Schedule, StepAndConstant) {
  ddp::LrSchedule step(ddp::LrScheduleOptions().kind("step").peak_lr(1.0).total_steps(100));
  EXPECT_DOUBLE_EQ(step.at(10), 1.0);
  EXPECT_DOUBLE_EQ(step.at(60), 0.1);
  EXPECT_DOUBLE_EQ(step.at(90), 0.01);
  ddp::LrSchedule constant(ddp::LrScheduleOptions().kind("constant").peak_lr(0.3).total_steps(100));
  EXPECT_DOUBLE_EQ(constant.at(99), 0.3);
  EXPECT_THROW(ddp::LrSchedule(ddp::LrScheduleOptions().kind("warm")), ddp::UserError);
}

// Every schedule, with and without warm-up, step for step against the
// learning rates that torch.optim.lr_scheduler wrote
// (tools/gen_schedule_testdata.py -> tests/testdata/schedules.json).
TEST(Schedule, EachScheduleMatchesPyTorchStepForStep) {
  const auto data = nlohmann::json::parse(ddp::testing::read_file(DDP_TEST_DATA_DIR "/schedules.json"));
  std::set<std::string> seen;
  for (const auto& c : data["cases"]) {
    const std::string kind = c["schedule"];
    const int64_t total = c["total_steps"], warmup = c["warmup_steps"];
    const double peak = c["peak_lr"];
    seen.insert(kind + (warmup > 0 ? "+warmup" : ""));
    ddp::LrSchedule s(ddp::LrScheduleOptions().kind(kind).peak_lr(peak).total_steps(total).warmup_steps(warmup));
    const auto& want = c["lrs"];
    ASSERT_EQ(static_cast<int64_t>(want.size()), total);
    double worst = 0;
    int64_t worst_step = 0;
    for (int64_t step = 0; step < total; ++step) {
      const double ref = want[step];
      const double rel = std::abs(s.at(step) - ref) / std::abs(ref);
      if (rel > worst) worst = rel, worst_step = step;
    }
    EXPECT_LT(worst, 1e-9) << kind << " S=" << total << " W=" << warmup << ": step " << worst_step << " gives "
                           << s.at(worst_step) << ", PyTorch " << want[worst_step].get<double>();
  }
  EXPECT_EQ(seen.size(), 8u) << "every schedule with and without warm-up";
}

// onecycle without --warmup-epochs rises over 30% of the run, like
// OneCycleLR's pct_start; the warm-up does not default to some epochs.
TEST(Schedule, OneCycleRisesOverThirtyPercentOfTheRun) {
  ddp::LrSchedule s(ddp::LrScheduleOptions().kind("onecycle").peak_lr(1.0).total_steps(1000));
  EXPECT_NEAR(s.at(0), 1.0 / 25, 1e-15);
  EXPECT_NEAR(s.at(299), 1.0, 1e-12);  // the rise ends at step 0.3 * 1000 - 1
  EXPECT_LT(s.at(300), 1.0);
  EXPECT_NEAR(s.at(999), 1.0 / 25 / 1e4, 1e-15);
}

}  // namespace
