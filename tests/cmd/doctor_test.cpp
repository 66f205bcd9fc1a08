// `ddptrain doctor` over a real two-rank Gloo group.
#include "support/testing.h"

namespace {

TEST(Doctor, TwoRanksPassEveryCheck) {
  DDP_SKIP_UNLESS_GLOO();
  auto r = ddp::testing::run_process({DDPTRAIN_EXE, "doctor", "--size", "2", "--backend", "gloo", "--timeout", "60"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[PASS] all-reduce result: expected 3.0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[PASS] data-parallel gradient vs one process"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("GB/s bus bandwidth"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("doctor: 3 of 3 checks passed"), std::string::npos) << r.output;
}

// A program made from the template runs the same checks under its own name.
TEST(Doctor, AProgramsDoctorSpeaksOfTheProgram) {
  DDP_SKIP_UNLESS_GLOO();
  auto r = ddp::testing::run_process({EXAMPLE_tabular, "doctor", "--size", "1", "--backend", "gloo", "--timeout", "60"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("tabular doctor\n", 0), 0u) << r.output;
  EXPECT_EQ(r.output.find("ddptrain doctor"), std::string::npos) << r.output;
}

TEST(Doctor, OneGpuOverNccl_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto r = ddp::testing::run_process({DDPTRAIN_EXE, "doctor", "--size", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("doctor: 3 of 3 checks passed"), std::string::npos) << r.output;
}

}  // namespace
