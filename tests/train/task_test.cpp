// The Task interface: built-in regression, tasks of one's own (the examples),
// task flags, flags a program ignores, monitors where lower is better, and a
// custom metric reduced across ranks. Real processes, real Gloo groups.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/models/registry.h"
#include "ddp/train/task.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::read_file;
using ddp::testing::run_process;

using ddp::testing::metrics_under;

std::string run_dir_of(const std::string& save_path) {
  for (const auto& e : fs::directory_iterator(save_path))
    if (e.is_directory()) return e.path().string();
  return "";
}

std::vector<std::string> cpu_run(const std::string& exe, const std::string& save_path, std::vector<std::string> extra) {
  std::vector<std::string> a{exe, "--save_path", save_path, "--progress", "plain", "--backend", "gloo", "--timeout", "120"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// ddptrain --task regression: the seed's MSE-on-a-scalar case as a one-flag
// run on learnable data. No accuracy anywhere; best.pt follows test_loss,
// where lower is better.
TEST(Task, BuiltinRegressionLearnsAndBestFollowsTheLowestLoss) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("task_regression");
  auto r = run_process(cpu_run(DDPTRAIN_EXE, dir, {"--task", "regression", "--size", "2", "--epochs", "3",
                                                   "--train-samples", "6000", "--test-samples", "1000"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto m = metrics_under(dir);
  ASSERT_EQ(m.size(), 3u);
  for (const char* key : {"test_loss", "test_mse", "test_mae", "test_r2"}) EXPECT_TRUE(m[2].contains(key)) << key;
  EXPECT_GE(m[2]["test_r2"].get<double>(), 0.8) << r.output;  // stated in the README
  EXPECT_EQ(m[2]["monitor"], "test_loss");
  EXPECT_EQ(m[2]["goal"], "min");
  const auto run = run_dir_of(dir);
  for (const std::string file : {"/metrics.jsonl", "/metrics.csv", "/curves.svg"})
    EXPECT_EQ(read_file(run + file).find("acc"), std::string::npos) << file << " mentions accuracy";
  EXPECT_EQ(r.output.find("acc"), std::string::npos) << r.output;
  // The end-of-run summary: the monitor's final and best value, and the
  // commands that come next.
  for (const std::string& line : std::vector<std::string>{"done: 3 epoch(s)", "on SYNTHETIC data; test_loss final", "(lower is better)",
                                 std::string("resume:   ") + DDPTRAIN_EXE + " --resume " + run + " --size 2\n",  // placement is not restored
                                 std::string("export:   ") + DDPTRAIN_EXE + " export " + run + "/best.pt"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  auto report = run_process({DDPTRAIN_EXE, "report", run});
  ASSERT_EQ(report.exit_code, 0) << report.output;
  EXPECT_EQ(report.output.find("acc"), std::string::npos) << report.output;
  EXPECT_NE(report.output.find("lower is better"), std::string::npos) << report.output;
  EXPECT_NE(read_file(run + "/curves.svg").find("test r2"), std::string::npos);

  // best.pt holds the epoch with the lowest test_loss, and its value.
  size_t best_epoch = 0;
  for (size_t i = 1; i < m.size(); ++i)
    if (m[i]["test_loss"].get<double>() < m[best_epoch]["test_loss"].get<double>()) best_epoch = i;
  ddp::models::ModelSpec spec;
  spec.num_classes = 1;
  auto model = ddp::models::make_model(spec);
  auto meta = ddp::load_checkpoint(run + "/best.pt", *model, nullptr, torch::kCPU, "cnn/auto/1x28x28/1");
  EXPECT_EQ(meta.state.epoch, static_cast<int64_t>(best_epoch + 1));
  EXPECT_DOUBLE_EQ(meta.state.best, m[best_epoch]["test_loss"].get<double>());
}

// --stop-at in the direction of the monitor, and its errors.
// A run's config.toml repeats it, also for a task that ignores some
// built-in flags: the defaults spelt out in the file are not "given".
TEST(Task, ConfigTomlRepeatsARegressionRun) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("task_config"), again = ddp::testing::temp_dir("task_config_again");
  auto r = run_process(cpu_run(DDPTRAIN_EXE, dir, {"--task", "regression", "--size", "1", "--epochs", "1",
                                                   "--train-samples", "500", "--test-samples", "100"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto r2 = run_process({DDPTRAIN_EXE, "--config", run_dir_of(dir) + "/config.toml", "--save_path", again});
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_EQ(metrics_under(dir)[0]["test_loss"], metrics_under(again)[0]["test_loss"]);
}

TEST(Task, StopAtAMetricWhereLowerIsBetter) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("task_stop_at");
  auto r = run_process(cpu_run(DDPTRAIN_EXE, dir, {"--task", "regression", "--size", "1", "--epochs", "3",
                                                   "--train-samples", "1000", "--test-samples", "200",
                                                   "--stop-at", "test_loss=100"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(metrics_under(dir).size(), 1u) << r.output;  // any loss is <= 100: stop after epoch 1
  EXPECT_NE(r.output.find("reached --stop-at"), std::string::npos) << r.output;

  auto unknown = run_process(cpu_run(DDPTRAIN_EXE, ddp::testing::temp_dir("task_stop_bad"),
                                     {"--task", "regression", "--size", "1", "--epochs", "1", "--train-samples", "200",
                                      "--test-samples", "50", "--stop-at", "test_acc>=0.9"}));
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("--stop-at names 'test_acc', which this task does not report"), std::string::npos)
      << unknown.output;
  EXPECT_NE(ddp::testing::user_error([] { ddp::testing::parse_args({"--stop-at", "test_loss"}); })
                .find("is not METRIC=VALUE"),
            std::string::npos);
}

// A task's flag joins the table: --help, config.toml, and --config.
TEST(Task, TaskFlagRoundTripsThroughConfigToml) {
  ddp::Config defaults;
  defaults.add_flag("--aux-weight", "weight of the auxiliary loss", 0.1);
  defaults.add_flag("--head", "which head", std::string("small"), {"small", "big"});
  const char* argv[] = {"prog", "--aux-weight", "0.25", "--head", "big"};
  auto c = ddp::parse_cli(5, argv, defaults);
  EXPECT_EQ(c.flag<double>("aux-weight"), 0.25);
  EXPECT_EQ(c.flag<std::string>("head"), "big");
  EXPECT_TRUE(c.was_given("aux-weight"));
  const auto toml = ddp::config_to_toml(c);
  EXPECT_NE(toml.find("aux-weight = 0.25"), std::string::npos) << toml;
  EXPECT_NE(toml.find("head = 'big'"), std::string::npos) << toml;
  EXPECT_EQ(ddp::config_to_json(c)["aux-weight"], 0.25);
  const auto file = ddp::testing::temp_dir("task_flag") + "/config.toml";
  std::ofstream(file) << toml;
  const char* again[] = {"prog", "--config", file.c_str()};
  auto d = ddp::parse_cli(3, again, defaults);
  EXPECT_EQ(d.flag<double>("aux-weight"), 0.25);
  EXPECT_EQ(d.flag<std::string>("head"), "big");
  // Its choices are checked like a built-in flag's.
  const char* bad[] = {"prog", "--head", "huge"};
  EXPECT_NE(ddp::testing::user_error([&] { ddp::parse_cli(3, bad, defaults); }).find("huge"), std::string::npos);
}

TEST(Task, TaskFlagShowsInHelpAndInTheRunsConfig) {
  DDP_SKIP_UNLESS_GLOO();
  auto help = run_process({EXAMPLE_two_inputs, "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("--aux-weight"), std::string::npos) << help.output;
  const auto dir = ddp::testing::temp_dir("task_flag_run");
  auto r = run_process(cpu_run(EXAMPLE_two_inputs, dir, {"--size", "1", "--epochs", "1", "--train-samples", "256",
                                                         "--test-samples", "64", "--aux-weight", "0.5"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(read_file(run_dir_of(dir) + "/config.toml").find("aux-weight = 0.5"), std::string::npos);
}

// A flag that the program would ignore is an error, not a silent no-op.
TEST(Task, FlagThatTheProgramIgnoresIsReported) {
  DDP_SKIP_UNLESS_GLOO();
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--model", "resnet18"}, {"--dataset", "cifar10"}, {"--loss", "mse"}, {"--task", "regression"}}) {
    auto args = cpu_run(EXAMPLE_two_inputs, ddp::testing::temp_dir("task_ignored"),
                        {"--size", "1", "--epochs", "1", "--train-samples", "64", "--test-samples", "16"});
    args.insert(args.end(), flags.begin(), flags.end());
    auto r = run_process(args);
    EXPECT_EQ(r.exit_code, 2) << flags[0] << "\n" << r.output;
    EXPECT_NE(r.output.find(flags[0] + " does not apply to this program"), std::string::npos) << r.output;
  }
  // The built-in task reads --model and --loss: no complaint there.
  auto ok = run_process(cpu_run(DDPTRAIN_EXE, ddp::testing::temp_dir("task_builtin"),
                                {"--size", "1", "--epochs", "1", "--dataset", "synthetic", "--train-samples", "128",
                                 "--test-samples", "32", "--loss", "cross-entropy", "--model", "cnn"}));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// Example (a): the seed's task as it was meant.
TEST(Task, RegressionExampleReachesStatedR2) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("example_regression");
  auto r = run_process(cpu_run(EXAMPLE_regression, dir, {"--size", "2", "--epochs", "4", "--train-samples", "8000",
                                                         "--test-samples", "1000"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto m = metrics_under(dir);
  ASSERT_EQ(m.size(), 4u);
  EXPECT_GE(m[3]["test_r2"].get<double>(), 0.9) << r.output;  // stated in the README
}

// Example (b): two inputs, a custom loss with its own flag, macro-F1.
TEST(Task, TwoInputExampleReachesStatedMacroF1) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("example_two_inputs");
  auto r = run_process(cpu_run(EXAMPLE_two_inputs, dir, {"--size", "2", "--epochs", "2", "--train-samples", "6000",
                                                         "--test-samples", "1001"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto m = metrics_under(dir);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_GE(m[1]["test_f1"].get<double>(), 0.9) << r.output;  // stated in the README
  EXPECT_EQ(m[1]["monitor"], "test_f1");
  for (const char* logged : {"train_ce", "train_aux"}) EXPECT_TRUE(m[1].contains(logged)) << logged;
  EXPECT_LT(m[1]["train_ce"].get<double>(), m[0]["train_ce"].get<double>());
  EXPECT_TRUE(fs::exists(run_dir_of(dir) + "/best.pt"));
}

// The custom metric over 2 ranks with uneven shards (1001 test samples:
// 501 and 500) equals the 1-rank value: every count is exact.
TEST(Task, CustomMetricOverTwoUnevenRanksEqualsOneRank) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("task_metric");
  for (const char* ranks : {"1", "2"}) {
    auto r = run_process({DDP_TESTWORKER, "--launch", ranks, "task_metric", dir, "--test-samples", "1001",
                          "--train-samples", "64"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const auto one = read_file(dir + "/metrics_world1.txt"), two = read_file(dir + "/metrics_world2.txt");
  ASSERT_NE(one.find("test_f1 "), std::string::npos) << one;
  EXPECT_EQ(one, two);
}

// best.pt follows the monitor at every validation, as Lightning's
// ModelCheckpoint does, not only at the epochs that save a checkpoint:
// test_loss 1.0, 0.5, 2.0 over three epochs with --save_epoch 10 makes
// epoch 2 the best (it was epoch 3, the only one compared).
TEST(Task, BestFollowsEveryValidationNotOnlySaveEpochs) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("best_between_saves");
  auto r = run_process({DDP_TESTWORKER, "--launch", "1", "not_finite", dir, "scripted", "--epochs", "3",
                        "--save_epoch", "10", "--train-samples", "256", "--test-samples", "64", "--batch", "32"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto run = run_dir_of(dir + "/runs");
  ASSERT_TRUE(fs::exists(run + "/best.pt")) << r.output;
  EXPECT_EQ(ddp::read_checkpoint_meta(run + "/best.pt").state.epoch, 2);
  EXPECT_FALSE(fs::exists(run + "/epoch_2.pt"));  // still only the save epochs' checkpoints
  EXPECT_TRUE(fs::exists(run + "/epoch_3.pt"));
  EXPECT_NE(r.output.find("final 2, best 0.5"), std::string::npos) << r.output;
}

// A --stop-at naming a metric that the task does not report stops the run
// after the first validation, with that epoch's checkpoint saved (it was
// thrown before the save: with --epochs 1 the whole run was lost).
TEST(Task, StopAtAnUnknownMetricKeepsTheEpoch) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("stop_at_unknown");
  auto r = run_process(cpu_run(DDPTRAIN_EXE, dir, {"--task", "regression", "--size", "1", "--epochs", "2",
                                                   "--train-samples", "512", "--test-samples", "128",
                                                   "--stop-at", "test_acc>=0.9", "--log-every", "1"}));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--stop-at names 'test_acc', which this task does not report"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(run_dir_of(dir) + "/epoch_1.pt")) << r.output;
  // Warned of before training, by the validation batches that run first.
  const auto warned = r.output.find("warning: --stop-at names 'test_acc', which validation does not report (it reports "
                                    "test_loss, test_mae, test_mse, test_r2)");
  ASSERT_NE(warned, std::string::npos) << r.output;
  const auto trained = r.output.find("epoch 1/2 step 1/");
  ASSERT_NE(trained, std::string::npos) << r.output;
  EXPECT_LT(warned, trained) << r.output;
  auto quiet = run_process(cpu_run(DDPTRAIN_EXE, ddp::testing::temp_dir("stop_at_unknown_no_sanity"),
                                   {"--task", "regression", "--size", "1", "--epochs", "1", "--train-samples", "256",
                                    "--test-samples", "64", "--stop-at", "test_acc>=0.9", "--sanity-val-steps", "0"}));
  EXPECT_EQ(quiet.output.find("which validation does not report"), std::string::npos) << quiet.output;
}

// The validation before training leaves the random generators as they were:
// a task that draws random numbers in its steps trains the same with it and
// without it (--sanity-val-steps 0).
TEST(Task, SanityValidationLeavesTheRandomGeneratorsAsTheyWere) {
  DDP_SKIP_UNLESS_GLOO();
  std::vector<nlohmann::json> rows[2];
  for (int sanity : {0, 2}) {
    const auto dir = ddp::testing::temp_dir("sanity_rng_" + std::to_string(sanity));
    auto r = run_process({DDP_TESTWORKER, "--launch", "1", "not_finite", dir, "random", "--epochs", "1",
                          "--train-samples", "256", "--test-samples", "64", "--batch", "32", "--sanity-val-steps",
                          std::to_string(sanity)});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    rows[sanity ? 1 : 0] = metrics_under(dir + "/runs");
  }
  ASSERT_EQ(rows[0].size(), 1u);
  ASSERT_EQ(rows[1].size(), 1u);
  EXPECT_EQ(rows[0][0]["train_loss"], rows[1][0]["train_loss"]);
  EXPECT_EQ(rows[0][0]["test_loss"], rows[1][0]["test_loss"]);
}

// A validation_step() that fails does so before the first training step
// (Lightning's sanity check), not after an epoch of training.
TEST(Task, FailingValidationStepStopsBeforeTraining) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("bad_validation");
  auto r = run_process({DDP_TESTWORKER, "--launch", "2", "not_finite", dir, "bad_validation", "--epochs", "1",
                        "--train-samples", "256", "--test-samples", "64", "--batch", "32", "--log-every", "1"});
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_NE(r.output.find("validation_step() failed on purpose."), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "trained before validating:\n" << r.output;
}

// A NaN validation metric while the training loss stays finite is said
// once a job, on rank 0, with its source: the model's buffer that holds
// infinite values, or the task's own arithmetic when the model is finite.
TEST(Task, NonFiniteValidationMetricIsSaidOnceWithItsSource) {
  DDP_SKIP_UNLESS_GLOO();
  for (const char* mode : {"buffer", "metric"}) {
    SCOPED_TRACE(mode);
    const auto dir = ddp::testing::temp_dir(std::string("not_finite_") + mode);
    auto r = run_process({DDP_TESTWORKER, "--launch", "2", "not_finite", dir, mode, "--epochs", "2",
                          "--train-samples", "512", "--test-samples", "256", "--batch", "32"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string warning = "warning: epoch 1's validation gave ";
    const auto at = r.output.find(warning);
    ASSERT_NE(at, std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("validation gave", at + warning.size()), std::string::npos) << "said more than once:\n" << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    if (std::string(mode) == "buffer") {
      EXPECT_TRUE(line.find("test_loss inf") != std::string::npos || line.find("test_loss nan") != std::string::npos)
          << line;
      EXPECT_NE(line.find("buffer 'scale'"), std::string::npos) << line;
    } else {
      EXPECT_NE(line.find("test_huge_share nan"), std::string::npos) << line;
      EXPECT_EQ(line.find("test_loss"), std::string::npos) << line;  // the loss itself is finite
      EXPECT_NE(line.find("parameters and buffers are all finite"), std::string::npos) << line;
    }
  }
}

}  // namespace

namespace {

// On one GPU the task's step (two inputs, logs) runs under bf16 autocast and
// is captured in a CUDA graph; the run learns as on the CPU.
TEST(Task, TwoInputTaskIsCapturedOnOneGpu_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto dir = ddp::testing::temp_dir("task_gpu");
  auto r = run_process({EXAMPLE_two_inputs, "--size", "1", "--backend", "nccl", "--epochs", "2", "--train-samples",
                        "6000", "--test-samples", "1001", "--amp", "bf16", "--cuda-graph", "--save_path", dir,
                        "--progress", "plain"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("captured the training step"), std::string::npos) << r.output;
  const auto m = metrics_under(dir);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_GE(m[1]["test_f1"].get<double>(), 0.9) << r.output;
  EXPECT_TRUE(m[1].contains("train_aux"));
}

}  // namespace

namespace {

// Gradient accumulation averages each optimizer step over the micro-batches
// it really has: 160 samples in batches of 32 with --accum-steps 2 make
// groups of 2, 2 and 1; the last group's gradient is its one batch's mean,
// as in one run with batches of 64, 64 and 32. (The model has no batch
// norm, so the two runs see the same arithmetic up to float rounding; a
// last group divided by 2 would halve the final update.)
TEST(Task, AccumulationAveragesTheLastPartialGroupOverItsOwnSize) {
  DDP_SKIP_UNLESS_GLOO();
  std::vector<std::string> common = {"--size", "1", "--epochs", "1", "--train-samples", "160", "--test-samples",
                                     "200", "--optimizer", "sgd", "--momentum", "0", "--lr", "0.5",
                                     "--schedule", "constant", "--seed", "1"};
  auto accumulated = common, plain = common;
  accumulated.insert(accumulated.end(), {"--batch", "32", "--accum-steps", "2"});
  plain.insert(plain.end(), {"--batch", "64"});
  const auto a = ddp::testing::temp_dir("accum_a"), b = ddp::testing::temp_dir("accum_b");
  auto ra = run_process(cpu_run(EXAMPLE_regression, a, accumulated)), rb = run_process(cpu_run(EXAMPLE_regression, b, plain));
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  const double la = metrics_under(a).at(0)["test_loss"].get<double>(), lb = metrics_under(b).at(0)["test_loss"].get<double>();
  EXPECT_NEAR(la, lb, 1e-5 * std::max(1.0, std::abs(lb))) << ra.output << rb.output;
}

}  // namespace
