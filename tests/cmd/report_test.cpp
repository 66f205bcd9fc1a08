// `ddptrain report` and the files behind it, on a real 2-epoch run of the
// real binary over 2 Gloo ranks.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "ddp/cli.h"
#include "ddp/io/metrics.h"
#include "support/testing.h"
#include "support/tfevents.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::run_process;

constexpr int kTrainSamples = 1024, kRanks = 2, kBatch = 64, kLogEvery = 3, kEpochs = 2;

// One short run shared by the tests below; its run directory.
const std::string& two_epoch_run() {
  static const std::string run = [] {
    const auto save = ddp::testing::temp_dir("report_run");
    std::vector<std::string> a{DDPTRAIN_EXE, "--epochs", std::to_string(kEpochs), "--train-samples",
                               std::to_string(kTrainSamples), "--test-samples", "256", "--size", std::to_string(kRanks),
                               "--batch", std::to_string(kBatch), "--log-every", std::to_string(kLogEvery),
                               "--backend", "gloo", "--progress", "plain", "--timeout", "60", "--save_path", save};
    const auto root = ddp::testing::fashion_mnist_root();
    if (!root.empty()) a.insert(a.end(), {"--data_root", root});
    const auto r = run_process(a);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (const auto& e : fs::directory_iterator(save)) return e.path().string();
    return std::string();
  }();
  return run;
}

std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", 100 * fraction);
  return buf;
}

TEST(Report, SummarisesARealTwoEpochRun) {
  DDP_SKIP_UNLESS_GLOO();
  const auto& run = two_epoch_run();
  ASSERT_FALSE(run.empty());
  const auto r = run_process({DDPTRAIN_EXE, "report", run});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto epochs = ddp::read_epoch_metrics(run + "/metrics.jsonl");
  ASSERT_EQ(epochs.size(), static_cast<size_t>(kEpochs));
  auto best = epochs[0];
  for (const auto& m : epochs)
    if (m.value("test_acc") > best.value("test_acc")) best = m;
  const auto& out = r.output;
  EXPECT_NE(out.find(run), std::string::npos) << out;
  EXPECT_NE(out.find("2 of 2 done"), std::string::npos) << out;
  EXPECT_NE(out.find("final " + percent(epochs.back().value("test_acc")) + " (epoch 2)"), std::string::npos) << out;
  EXPECT_NE(out.find("best " + percent(best.value("test_acc")) + " (epoch " + std::to_string(best.epoch) + ")"),
            std::string::npos) << out;
  // The task's own words for its model and data (run.json), then the flags.
  EXPECT_NE(out.find("model        cnn/"), std::string::npos) << out;
  EXPECT_NE(out.find("data         "), std::string::npos) << out;
  EXPECT_NE(out.find("config       adamw lr"), std::string::npos) << out;
  EXPECT_NE(out.find("samples/s"), std::string::npos) << out;
  // Every checkpoint in the directory is listed, and nothing else.
  size_t listed = 0;
  for (const auto& e : fs::directory_iterator(run))
    if (e.path().extension() == ".pt") {
      EXPECT_NE(out.find(e.path().filename().string()), std::string::npos) << e.path();
      ++listed;
    }
  EXPECT_GE(listed, 2u);  // epoch_2.pt and best.pt at least
  EXPECT_EQ(out.find("preempt"), std::string::npos);
}

TEST(Report, RunFilesAgreeWithEachOther) {
  DDP_SKIP_UNLESS_GLOO();
  const auto& run = two_epoch_run();
  ASSERT_FALSE(run.empty());
  const auto epochs = ddp::read_epoch_metrics(run + "/metrics.jsonl");
  ASSERT_EQ(epochs.size(), static_cast<size_t>(kEpochs));

  // metrics.csv: one step row per log point of the trainer, one epoch row per epoch.
  const int micro_batches = (kTrainSamples / kRanks + kBatch - 1) / kBatch;
  int log_points = 0;
  for (int micro = 1; micro <= micro_batches; ++micro) log_points += micro % kLogEvery == 0 || micro == micro_batches;
  std::ifstream csv(run + "/metrics.csv");
  std::string line;
  std::map<std::string, int> kinds;
  std::getline(csv, line);
  EXPECT_EQ(line.rfind("kind,epoch,step,", 0), 0u) << line;
  while (std::getline(csv, line)) ++kinds[line.substr(0, line.find(','))];
  EXPECT_EQ(kinds["step"], kEpochs * log_points);
  EXPECT_EQ(kinds["epoch"], kEpochs);

  // The event file: the same numbers, at the optimizer step.
  const auto files = ddp::testing::event_files(run);
  ASSERT_EQ(files.size(), 1u);
  const auto events = ddp::testing::read_event_file(files[0]);
  EXPECT_EQ(events.first_file_version, "brain.Event:2");
  std::map<std::string, std::vector<ddp::testing::ScalarEvent>> by_tag;
  for (const auto& s : events.scalars) by_tag[s.tag].push_back(s);
  EXPECT_EQ(by_tag["train/loss"].size(), static_cast<size_t>(kEpochs * log_points));
  EXPECT_EQ(by_tag["train/lr"].size(), static_cast<size_t>(kEpochs * log_points));
  EXPECT_EQ(by_tag["train/samples_per_second"].size(), static_cast<size_t>(kEpochs * log_points));
  ASSERT_EQ(by_tag["test/accuracy"].size(), epochs.size());
  ASSERT_EQ(by_tag["test/loss"].size(), epochs.size());
  for (size_t i = 0; i < epochs.size(); ++i) {
    EXPECT_EQ(by_tag["test/accuracy"][i].value, static_cast<float>(epochs[i].value("test_acc")));
    EXPECT_EQ(by_tag["test/loss"][i].value, static_cast<float>(epochs[i].value("test_loss")));
    EXPECT_EQ(by_tag["test/accuracy"][i].step, epochs[i].step);
  }
  EXPECT_EQ(epochs.back().step, kEpochs * micro_batches);  // accum-steps 1: one step per micro-batch
  // The last log point of an epoch is its end: same step, same train loss.
  const auto& last_loss = by_tag["train/loss"].back();
  EXPECT_EQ(last_loss.step, epochs.back().step);
  EXPECT_NEAR(last_loss.value, epochs.back().train_loss, 1e-5 * std::abs(epochs.back().train_loss));

  // curves.svg: a marker per epoch.
  const auto svg = ddp::testing::read_file(run + "/curves.svg");
  size_t markers = 0;
  for (size_t p = svg.find("<circle class=\"test-acc\""); p != std::string::npos;
       p = svg.find("<circle class=\"test-acc\"", p + 1))
    ++markers;
  EXPECT_EQ(markers, epochs.size());

  // config.toml reads back to config.json.
  const std::string toml = run + "/config.toml";
  const char* argv[] = {"ddptrain", "--config", toml.c_str()};
  const auto again = ddp::parse_cli(3, argv);
  EXPECT_EQ(ddp::config_to_json(again), nlohmann::json::parse(ddp::testing::read_file(run + "/config.json")));
}

TEST(Report, BadRunDirIsOneLineErrorWithAHint) {
  const auto missing = ddp::testing::temp_dir("report_bad") + "/no_such_run";
  auto r = run_process({DDPTRAIN_EXE, "report", missing});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'" + missing + "'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Hint"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;

  // A --save_path with runs in it: the hint names one.
  const auto save = ddp::testing::temp_dir("report_save");
  fs::create_directories(save + "/train_2026-01-01_00-00-00");
  std::ofstream(save + "/train_2026-01-01_00-00-00/config.json") << "{}";
  r = run_process({DDPTRAIN_EXE, "report", save});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("not a run directory of ddptrain"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(save + "/train_2026-01-01_00-00-00"), std::string::npos) << r.output;

  r = run_process({DDPTRAIN_EXE, "report"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("usage: ddptrain report RUN_DIR"), std::string::npos) << r.output;
}

}  // namespace
