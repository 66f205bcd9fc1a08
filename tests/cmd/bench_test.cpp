// `PROGRAM bench` in a program of your own times its task's own model and
// training_step, after --convert-layers as training does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "ddp/cmd/bench.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

TEST(Bench, AProgramTimesItsOwnTasksStep) {
  const auto data = ddp::testing::temp_dir("bench_tabular_data");
  ddp::testing::write_sales_csvs(data, 200, 50);
  for (const std::string convert : {"on", "off"}) {
    auto r = ddp::testing::run_process({EXAMPLE_tabular, "bench", "--data_root", data, "--size", "1", "--backend",
                                        "gloo", "--batch", "32", "--bench-steps", "3", "--convert-layers", convert});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto line = r.output.substr(r.output.rfind("{\""));
    const auto j = nlohmann::json::parse(line.substr(0, line.find('\n')));
    EXPECT_EQ(j["program"], "tabular") << line;  // the name it gave itself
    EXPECT_EQ(j["model"].get<std::string>().rfind("sales-mlp/", 0), 0u) << line;
    EXPECT_EQ(j["batch"], 32);
    EXPECT_EQ(j["converted_layers"], convert == "on" ? 3 : 0) << line;
    EXPECT_GT(j["ms_per_step"].get<double>(), 0);
    EXPECT_TRUE(std::isfinite(j["final_loss"].get<double>())) << line;
  }
}

// `ddptrain bench --model cnn`: the ImageNet stem that bench gives the
// ResNets (its inputs are ImageNet's shape) is not the cnn's.
TEST(Bench, TimesEveryBuiltInImageModel) {
  for (const std::string model : {"cnn", "resnet18"}) {
    auto r = ddp::testing::run_process({DDPTRAIN_EXE, "bench", "--size", "1", "--backend", "gloo", "--model", model,
                                        "--image-size", "32", "--batch", "4", "--bench-steps", "1"}, {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto line = r.output.substr(r.output.rfind("{\""));
    const auto j = nlohmann::json::parse(line.substr(0, line.find('\n')));
    EXPECT_EQ(j["model"], model) << line;
    EXPECT_EQ(j["batch"], 4);
    EXPECT_TRUE(std::isfinite(j["final_loss"].get<double>())) << line;
  }
}

// The search behind --largest-batch, on predicates with a known answer:
// doubling from the start until a batch fails, then bisecting, each batch
// tried once, and the answer exact.
TEST(Bench, LargestFittingBatchDoublesThenBisects) {
  std::vector<int64_t> tried;
  auto up_to = [&](int64_t limit) {
    tried.clear();
    return [&tried, limit](int64_t b) {
      tried.push_back(b);
      return b <= limit;
    };
  };
  EXPECT_EQ(ddp::largest_fitting_batch(16, up_to(37)), 37);
  EXPECT_EQ(tried, (std::vector<int64_t>{16, 32, 64, 48, 40, 36, 38, 37}));
  EXPECT_EQ(ddp::largest_fitting_batch(64, up_to(5)), 5);  // the start does not fit: bisect below it
  EXPECT_EQ(tried, (std::vector<int64_t>{64, 32, 16, 8, 4, 6, 5}));
  EXPECT_EQ(ddp::largest_fitting_batch(1, up_to(1)), 1);
  EXPECT_EQ(tried, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ddp::largest_fitting_batch(8, up_to(0)), 0);  // not even 1
  EXPECT_EQ(ddp::largest_fitting_batch(3, up_to(1000)), 1000);
  std::sort(tried.begin(), tried.end());
  EXPECT_EQ(std::adjacent_find(tried.begin(), tried.end()), tried.end()) << "a batch was tried twice";
  EXPECT_LE(tried.size(), 20u);
  EXPECT_THROW(ddp::largest_fitting_batch(0, up_to(4)), ddp::UserError);
}

// --largest-batch searches a GPU's memory, eagerly: on a CPU, or with
// --cuda-graph, it stops at once with a one-line error, before the model is
// built, in ddptrain and in a program of one's own (the CPU allocator has no budget of its own to search, and glibc's
// heap keeps freed address space; a capture that ran out of memory keeps
// its pool).
TEST(Bench, LargestBatchOnACpuOrWithCudaGraphIsRefusedInOneLine) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU: Bench.LargestBatchSearchIsExact_CUDA runs";
  const std::vector<std::string> gpt2{"--task", "lm", "--model", "gpt2"};
  const auto data = ddp::testing::temp_dir("bench_largest_data");
  ddp::testing::write_sales_csvs(data, 40, 10);
  struct Case {
    std::string program;
    std::vector<std::string> flags;
    std::string expect;
  };
  for (const auto& [program, flags, expect] : std::vector<Case>{
           {DDPTRAIN_EXE, gpt2, "--largest-batch searches a GPU's memory; this run is on cpu."},
           {DDPTRAIN_EXE, {"--task", "lm", "--model", "gpt2", "--cuda-graph"}, "--largest-batch searches eagerly: a CUDA graph's capture"},
           {EXAMPLE_tabular, {"--data_root", data}, "--largest-batch searches a GPU's memory; this run is on cpu."}}) {
    std::vector<std::string> args{program, "bench", "--size", "1", "--backend", "gloo", "--batch", "4", "--largest-batch"};
    args.insert(args.end(), flags.begin(), flags.end());
    auto r = ddp::testing::run_process(args, {}, 60);
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 20) << "the refusal came after building the model";
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  }
}

// On a GPU: GPT-2 124M at context 1024 from batch 8, in one process. Every
// try has its line; the largest batch fits and the next one up does not
// (the search is exact), a try that ran out of memory left nothing behind,
// and the largest batch's line is timed.
TEST(Bench, LargestBatchSearchIsExact_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto r = ddp::testing::run_process({DDPTRAIN_EXE, "bench", "--size", "1", "--task", "lm", "--model", "gpt2",
                                      "--batch", "8", "--amp", "bf16", "--optimizer", "adamw", "--bench-steps", "3",
                                      "--largest-batch"}, {}, 400);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<int64_t, bool> fits;
  double held_min = 1e18, held_max = 0;
  nlohmann::json largest;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("{\"", 0) != 0) continue;
    const auto j = nlohmann::json::parse(line);
    if (j.value("largest", false)) {
      largest = j;
      continue;
    }
    const int64_t b = j["batch"].get<int64_t>();
    EXPECT_EQ(fits.count(b), 0u) << "batch " << b << " tried twice";
    fits[b] = j["fits"].get<bool>();
    held_min = std::min(held_min, j["held_after_mib"].get<double>());
    held_max = std::max(held_max, j["held_after_mib"].get<double>());
    if (!fits[b]) EXPECT_NE(j["reason"].get<std::string>().find("out of memory"), std::string::npos) << line;
  }
  ASSERT_FALSE(largest.is_null()) << r.output;
  const int64_t best = largest["batch"].get<int64_t>();
  EXPECT_TRUE(fits.at(best)) << r.output;
  ASSERT_EQ(fits.count(best + 1), 1u) << r.output;
  EXPECT_FALSE(fits.at(best + 1)) << r.output;
  for (const auto& [b, ok] : fits) EXPECT_EQ(ok, b <= best) << "batch " << b << "\n" << r.output;
  EXPECT_LT(held_max - held_min, 64) << "a try that ran out of memory left memory behind\n" << r.output;
  EXPECT_GT(largest["tokens_per_s"].get<double>(), 0);
  EXPECT_GT(largest["peak_mem_mib"].get<double>(), 1000);
  EXPECT_TRUE(std::isfinite(largest["final_loss"].get<double>()));
}

}  // namespace
