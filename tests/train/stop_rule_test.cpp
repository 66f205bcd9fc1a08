// --stop-at's one parser: the three forms it accepts, what it refuses, and
// which way each form is reached.
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/train/stop_rule.h"

namespace {

using ddp::StopRule;

TEST(StopRule, ParsesTheThreeForms) {
  const StopRule up = ddp::parse_stop_rule("val_acc>=0.93");
  EXPECT_EQ(up.metric, "val_acc");
  EXPECT_EQ(up.way, StopRule::Way::kAtLeast);
  EXPECT_DOUBLE_EQ(up.value, 0.93);
  EXPECT_EQ(up.str(), "val_acc>=0.93");
  const StopRule down = ddp::parse_stop_rule("test_loss<=3e-1");
  EXPECT_EQ(down.way, StopRule::Way::kAtMost);
  EXPECT_DOUBLE_EQ(down.value, 0.3);
  EXPECT_EQ(down.str(), "test_loss<=3e-1");
  const StopRule monitor = ddp::parse_stop_rule("mae=0.5");
  EXPECT_EQ(monitor.way, StopRule::Way::kMonitors);
  EXPECT_EQ(monitor.metric, "mae");
  EXPECT_TRUE(ddp::parse_stop_rule("").empty());
}

TEST(StopRule, RefusesWhatIsNotOneOfThem) {
  for (const char* bad : {"val_acc", "=0.9", ">=0.9", "acc>0.9", "acc<0.9", "acc==0.9", "acc=>0.9", "acc>=",
                          "acc>=0.9x", "acc>=nan", "acc<=inf", "a<=b<=1"}) {
    try {
      ddp::parse_stop_rule(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const ddp::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

// --monitor's parse: NAME:min or NAME:max; "" keeps the task's.
TEST(StopRule, MonitorIsANameAndAGoal) {
  const ddp::Monitor task{"acc", ddp::Goal::kMax};
  EXPECT_EQ(ddp::parse_monitor("", task).metric, "acc");
  const auto loss = ddp::parse_monitor("val_loss:min", task);
  EXPECT_EQ(loss.metric, "val_loss");
  EXPECT_EQ(loss.goal, ddp::Goal::kMin);
  EXPECT_EQ(ddp::parse_monitor("f1:max", task).goal, ddp::Goal::kMax);
  for (const char* bad : {"loss", ":min", "loss:", "loss:low", "loss:min:x"}) {
    try {
      ddp::parse_monitor(bad, task);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const ddp::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("--monitor '") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(StopRule, ReachedInItsWayOrTheMonitors) {
  const StopRule up = ddp::parse_stop_rule("acc>=0.9"), down = ddp::parse_stop_rule("loss<=0.2");
  EXPECT_TRUE(up.reached(0.9, false));
  EXPECT_FALSE(up.reached(0.89, true));
  EXPECT_TRUE(down.reached(0.2, true));
  EXPECT_FALSE(down.reached(0.21, false));
  const StopRule monitor = ddp::parse_stop_rule("mae=0.5");
  EXPECT_TRUE(monitor.reached(0.4, /*higher_is_better=*/false));
  EXPECT_FALSE(monitor.reached(0.4, /*higher_is_better=*/true));
  EXPECT_TRUE(monitor.reached(0.6, /*higher_is_better=*/true));
}

}  // namespace
