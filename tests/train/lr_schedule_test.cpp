// Learning-rate schedules.
#include "ddp/error.h"
#include "ddp/train/lr_schedule.h"
#include "support/testing.h"

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

TEST(Schedule, StepConstantOneCycle) {
  ddp::LrSchedule step(ddp::LrScheduleOptions().kind("step").peak_lr(1.0).total_steps(100));
  EXPECT_DOUBLE_EQ(step.at(10), 1.0);
  EXPECT_DOUBLE_EQ(step.at(60), 0.1);
  EXPECT_DOUBLE_EQ(step.at(90), 0.01);
  ddp::LrSchedule constant(ddp::LrScheduleOptions().kind("constant").peak_lr(0.3).total_steps(100));
  EXPECT_DOUBLE_EQ(constant.at(99), 0.3);
  ddp::LrSchedule one(ddp::LrScheduleOptions().kind("onecycle").peak_lr(1.0).total_steps(100).warmup_steps(30));
  EXPECT_GT(one.at(0), 0.04);  // starts at peak / 25, not at zero
  EXPECT_LT(one.at(0), 0.1);
  EXPECT_NEAR(one.at(29), 1.0, 1e-12);
  EXPECT_LT(one.at(99), 0.01);
  EXPECT_THROW(ddp::LrSchedule(ddp::LrScheduleOptions().kind("warm")), ddp::UserError);
}


}  // namespace
