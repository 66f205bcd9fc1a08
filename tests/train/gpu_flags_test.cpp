// --size and --visible against the GPUs that exist: one-line errors, no hang.
#include "ddp/error.h"
#include "support/testing.h"

namespace {

using ddp::testing::run_process;

void expect_usage_error(const std::vector<std::string>& flags, const std::string& expect) {
  std::vector<std::string> argv{DDPTRAIN_EXE, "--dataset", "synthetic", "--epochs", "1", "--progress", "none",
                                "--save_path", ddp::testing::temp_dir("gpuflags")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto r = run_process(argv, {}, 60);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_LT(r.seconds, 10);
  EXPECT_NE(r.output.find(expect), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
}

TEST(GpuFlags, SizeAboveTheGpuCountIsAnError_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  expect_usage_error({"--size", std::to_string(torch::cuda::device_count() + 1)}, "GPU(s) available.");
}

TEST(GpuFlags, VisibleNamingAMissingGpuIsAnError_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto missing = std::to_string(torch::cuda::device_count());
  expect_usage_error({"--visible", missing}, "--visible names GPU '" + missing + "'");
}

TEST(GpuFlags, VisibleThatIsNotANumberIsAnError_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  expect_usage_error({"--visible", "gpu0"}, "--visible names GPU 'gpu0'");
}

}  // namespace
