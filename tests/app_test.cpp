// The program around the trainer (src/app.cpp): what the launcher refuses
// before starting ranks, and how a worker's error reaches the user.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <tuple>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

using ddp::testing::run_process;

using ddp::testing::count;

TEST(App, VisibleWithoutGpusIsAnError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has GPUs";
  const auto r = run_process({DDPTRAIN_EXE, "--visible", "0", "--dataset", "synthetic", "--epochs", "1",
                              "--save_path", ddp::testing::temp_dir("visible")},
                             {}, 120);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_NE(r.output.find("--visible 0 names GPUs"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("drop --visible"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("rank 0 of"), std::string::npos) << "a rank started:\n" << r.output;
}

// Every rank meets the same bad --data_root; the user reads it once.
TEST(App, TwoRanksPrintOneErrorLine) {
  DDP_SKIP_UNLESS_GLOO();
  const auto root = ddp::testing::temp_dir("one_error") + "/no-such-data";
  const auto r = run_process({DDPTRAIN_EXE, "--size", "2", "--backend", "gloo", "--data_root", root, "--epochs", "1",
                              "--progress", "none", "--timeout", "60", "--save_path",
                              ddp::testing::temp_dir("one_error_save")},
                             {}, 120);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_EQ(count(r.output, "'" + root + "' does not exist"), 1u) << r.output;
}

// A mistyped command is named as one, with the nearest command, in one line
// (the flag parser said "not expected: b a exprot"); `export --help` is help.
TEST(App, AMistypedCommandIsNamedWithTheNearest) {
  for (const auto& [program, word, nearest] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {DDPTRAIN_EXE, "exprot", "export"}, {EXAMPLE_tabular, "prdict", "predict"}, {EXAMPLE_tabular, "lol", ""}}) {
    const auto r = run_process({program, word, "a", "b"}, {}, 60);
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
    EXPECT_NE(r.output.find("unknown command '" + word + "'."), std::string::npos) << r.output;
    if (nearest.empty())
      EXPECT_EQ(r.output.find("did you mean"), std::string::npos) << r.output;
    else
      EXPECT_NE(r.output.find("did you mean " + nearest + "?"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("generate") == std::string::npos, program == EXAMPLE_tabular) << r.output;
  }
  const auto help = run_process({EXAMPLE_tabular, "export", "--help"}, {}, 60);
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("usage: tabular export CHECKPOINT OUT.pt"), std::string::npos) << help.output;
}

// --profile-trace needs Kineto's GPU profiling (a CUDA LibTorch 2.2+): a
// build without it refuses the flag before timing or training anything.
TEST(App, ProfileTraceWithoutAGpuProfilerIsAnError) {
  if (ddp::compat::kHasGpuProfiler) GTEST_SKIP() << "this build has the Kineto GPU profiler";
  const auto dir = ddp::testing::temp_dir("profile");
  const auto trace = dir + "/trace.json";
  for (const auto& args : std::vector<std::vector<std::string>>{
           {DDPTRAIN_EXE, "bench", "--model", "cnn", "--bench-steps", "2", "--profile-trace", trace},
           {DDPTRAIN_EXE, "--dataset", "synthetic", "--epochs", "1", "--save_path", dir + "/run", "--profile-trace",
            trace}}) {
    const auto r = run_process(args, {}, 120);
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
    EXPECT_EQ(count(r.output, "--profile-trace " + trace + ": this build has no Kineto GPU profiler"), 1u) << r.output;
    EXPECT_NE(r.output.find("drop --profile-trace"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("epoch 1/1"), std::string::npos) << "nothing trains first: " << r.output;
    EXPECT_FALSE(std::filesystem::exists(trace));
  }
}

// `ddptrain bench --task lm` says whether its step ran the side stream
// (the weight gradients on a second CUDA stream, --side-stream): never
// without bf16 autocast or off a GPU; on a GPU under bf16, by default, yes
// (for ddptrain's GPT on one GPU), and not with --side-stream off.
TEST(App, LmBenchSaysWhetherTheSideStreamRan) {
  struct Case {
    std::vector<std::string> flags;
    bool side;
  };
  std::vector<Case> cases{{{"--amp", "off"}, false}};
#ifdef DDP_WITH_CUDA_KERNELS
  if (torch::cuda::is_available()) {
    cases.push_back({{"--amp", "bf16"}, true});
    cases.push_back({{"--amp", "bf16", "--side-stream", "off"}, false});
  }
#endif
  for (const auto& c : cases) {
    std::vector<std::string> args{DDPTRAIN_EXE, "bench", "--task", "lm", "--model", "gpt-nano", "--bench-steps", "3",
                                  "--batch", "2", "--size", "1"};  // one process, on a machine of several GPUs too
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const auto r = run_process(args, {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string out = "\n" + r.output;
    const auto at = out.rfind("\n{");  // the result's line
    ASSERT_NE(at, std::string::npos) << r.output;
    const auto j = nlohmann::json::parse(out.substr(at + 1, out.find('\n', at + 1) - at - 1));
    EXPECT_EQ(j.at("side_stream").get<bool>(), c.side) << r.output;
    EXPECT_EQ(j.at("contender").get<std::string>().find(", side stream") != std::string::npos, c.side) << r.output;
  }
}

// A training run with --profile-trace writes the kernels of its last
// epoch's training steps (bench/kernel_breakdown.py reads the file).
TEST(App, TrainingProfileTraceHoldsTheLastEpochsKernels_CUDA) {
  if (!torch::cuda::is_available() || !ddp::compat::kHasGpuProfiler) GTEST_SKIP() << "needs a GPU and Kineto";
  const auto dir = ddp::testing::temp_dir("profile_run");
  const auto trace = dir + "/trace.json";
  const auto r = run_process({DDPTRAIN_EXE, "--dataset", "synthetic", "--model", "cnn", "--epochs", "2",
                              "--train-samples", "512", "--batch", "64", "--save_path", dir + "/run",
                              "--progress", "plain", "--profile-trace", trace},
                             {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "profile: epoch 2's training steps in " + trace), 1u) << r.output;
  std::ifstream in(trace);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("aten::convolution"), std::string::npos) << "no forward pass in " << trace;
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char ch) { return std::tolower(ch); });
  EXPECT_NE(text.find("\"cat\": \"kernel\""), std::string::npos) << "no kernel events in " << trace;
}

}  // namespace
