// MetricsLog: metrics.jsonl and metrics.csv agree, the event file and
// curves.svg follow, and truncate_to() (resume) cuts all of them alike.
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/io/metrics.h"
#include "support/testing.h"
#include "support/tfevents.h"

namespace {

using Row = std::map<std::string, std::string>;

// metrics.csv as rows keyed by the header's column names.
std::vector<Row> read_csv(const std::string& path, std::vector<std::string>* header = nullptr) {
  std::ifstream in(path);
  std::string line;
  std::vector<std::string> names;
  std::vector<Row> rows;
  auto split = [](const std::string& l) {
    std::vector<std::string> cells(1);
    for (char ch : l) {
      if (ch == ',') cells.emplace_back();
      else cells.back().push_back(ch);
    }
    return cells;
  };
  if (std::getline(in, line)) names = split(line);
  while (std::getline(in, line)) {
    auto cells = split(line);
    EXPECT_EQ(cells.size(), names.size()) << line;
    Row r;
    for (size_t i = 0; i < names.size() && i < cells.size(); ++i) r[names[i]] = cells[i];
    rows.push_back(r);
  }
  if (header) *header = names;
  return rows;
}

std::vector<Row> rows_of(const std::vector<Row>& rows, const std::string& kind) {
  std::vector<Row> out;
  for (const auto& r : rows)
    if (r.at("kind") == kind) out.push_back(r);
  return out;
}

using ddp::testing::count;

// A made-up run: `steps_per_epoch` optimizer steps per epoch, a log point
// every 2 steps, an epoch record at the end of each epoch.
void log_epochs(ddp::MetricsLog& log, int64_t first, int64_t last, int64_t steps_per_epoch) {
  for (int64_t e = first; e <= last; ++e) {
    for (int64_t k = 2; k <= steps_per_epoch; k += 2) {
      const int64_t step = (e - 1) * steps_per_epoch + k;
      log.log_step({step, e, 2.0 / static_cast<double>(step), 1e-3 * static_cast<double>(k), 1000.0 + static_cast<double>(step)});
    }
    ddp::EpochMetrics m;
    m.epoch = e;
    m.step = e * steps_per_epoch;
    m.train_loss = 1.0 / static_cast<double>(e);
    m.values["test_loss"] = 1.2 / static_cast<double>(e);
    m.values["test_acc"] = 0.5 + 0.1 * static_cast<double>(e);
    m.lr = 0.01 / static_cast<double>(e);
    m.epoch_seconds = 3.5;
    m.samples_per_second = 1234.5;
    log.append(m);
  }
}

TEST(Metrics, CsvHasStepAndEpochRowsThatMatchTheJsonl) {
  const auto dir = ddp::testing::temp_dir("metrics_csv");
  ddp::MetricsLog log(dir + "/metrics.jsonl");
  log_epochs(log, 1, 3, 6);

  std::vector<std::string> header;
  const auto rows = read_csv(dir + "/metrics.csv", &header);
  for (const char* col : {"kind", "epoch", "step", "wall_time", "train_loss", "test_loss", "test_acc", "lr",
                          "epoch_seconds", "samples_per_second"})
    EXPECT_NE(std::find(header.begin(), header.end(), col), header.end()) << col;
  const auto steps = rows_of(rows, "step"), epochs = rows_of(rows, "epoch");
  EXPECT_EQ(rows.size(), steps.size() + epochs.size());
  ASSERT_EQ(steps.size(), 9u);  // 3 log points in each of 3 epochs
  for (const auto& s : steps) {
    const double step = std::stod(s.at("step"));
    EXPECT_NEAR(std::stod(s.at("train_loss")), 2.0 / step, 1e-9);
    EXPECT_NEAR(std::stod(s.at("samples_per_second")), 1000.0 + step, 1e-6);
    EXPECT_EQ(std::stoll(s.at("epoch")), (static_cast<int64_t>(step) - 1) / 6 + 1);
    EXPECT_EQ(s.at("test_loss"), "");
    EXPECT_EQ(s.at("test_acc"), "");
    EXPECT_GT(std::stod(s.at("wall_time")), 1.6e9);  // stamped with the real time
  }
  std::ifstream jsonl(dir + "/metrics.jsonl");
  std::string line;
  size_t i = 0;
  for (; std::getline(jsonl, line); ++i) {
    ASSERT_LT(i, epochs.size());
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"train_loss", "test_loss", "test_acc", "lr", "epoch_seconds", "samples_per_second"})
      EXPECT_NEAR(std::stod(epochs[i].at(key)), j.at(key).get<double>(), 1e-9 * std::abs(j.at(key).get<double>())) << key;
    EXPECT_EQ(std::stoll(epochs[i].at("step")), j.at("step").get<int64_t>());
    EXPECT_EQ(std::stoll(epochs[i].at("epoch")), j.at("epoch").get<int64_t>());
  }
  EXPECT_EQ(i, 3u);

  const auto files = ddp::testing::event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  const auto events = ddp::testing::read_event_file(files[0]);
  std::map<std::string, int> per_tag;
  for (const auto& s : events.scalars) ++per_tag[s.tag];
  for (const char* tag : {"train/loss", "train/lr", "train/samples_per_second"}) EXPECT_EQ(per_tag[tag], 9) << tag;
  for (const char* tag : {"train/epoch_loss", "test/loss", "test/accuracy"}) EXPECT_EQ(per_tag[tag], 3) << tag;
  EXPECT_EQ(count(ddp::testing::read_file(dir + "/curves.svg"), "<circle class=\"test-acc\""), 3u);
}

TEST(Metrics, TruncateKeepsEveryFileConsistent) {
  const auto dir = ddp::testing::temp_dir("metrics_truncate");
  {
    ddp::MetricsLog log(dir + "/metrics.jsonl");
    log_epochs(log, 1, 3, 6);
  }
  // As Trainer::resume does from a checkpoint taken 2 steps into epoch 3
  // (a preemption): epochs 1-2 stay, and the steps up to 14.
  ddp::MetricsLog log(dir + "/metrics.jsonl");
  log.truncate_to(2, 14);
  EXPECT_EQ(log.epochs().size(), 2u);
  auto rows = read_csv(dir + "/metrics.csv");
  auto steps = rows_of(rows, "step"), epochs = rows_of(rows, "epoch");
  ASSERT_EQ(epochs.size(), 2u);
  ASSERT_EQ(steps.size(), 7u);  // 2 4 6 | 8 10 12 | 14
  EXPECT_EQ(steps.back().at("step"), "14");
  auto files = ddp::testing::event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  auto events = ddp::testing::read_event_file(files[0]);
  EXPECT_EQ(events.first_file_version, "brain.Event:2");
  std::map<std::string, std::vector<int64_t>> steps_of;
  for (const auto& s : events.scalars) steps_of[s.tag].push_back(s.step);
  EXPECT_EQ(steps_of["train/loss"], (std::vector<int64_t>{2, 4, 6, 8, 10, 12, 14}));
  EXPECT_EQ(steps_of["test/accuracy"], (std::vector<int64_t>{6, 12}));
  EXPECT_EQ(count(ddp::testing::read_file(dir + "/curves.svg"), "<circle class=\"test-acc\""), 2u);

  // The resumed run goes on: epoch 3 again, each epoch once in every file.
  log.log_step({16, 3, 0.5, 0.001, 900});
  log.log_step({18, 3, 0.4, 0.001, 900});
  ddp::EpochMetrics m;
  m.epoch = 3;
  m.step = 18;
  m.values["test_acc"] = 0.85;
  log.append(m);
  rows = read_csv(dir + "/metrics.csv");
  EXPECT_EQ(rows_of(rows, "epoch").size(), 3u);
  EXPECT_EQ(rows_of(rows, "step").size(), 9u);
  std::vector<int64_t> epoch_numbers;
  for (const auto& e : ddp::read_epoch_metrics(dir + "/metrics.jsonl")) epoch_numbers.push_back(e.epoch);
  EXPECT_EQ(epoch_numbers, (std::vector<int64_t>{1, 2, 3}));
  events = ddp::testing::read_event_file(ddp::testing::event_files(dir).at(0));
  std::vector<float> acc;
  for (const auto& s : events.scalars)
    if (s.tag == "test/accuracy") acc.push_back(s.value);
  EXPECT_EQ(acc, (std::vector<float>{static_cast<float>(0.5 + 0.1 * 1), static_cast<float>(0.5 + 0.1 * 2), 0.85f}));
  EXPECT_EQ(count(ddp::testing::read_file(dir + "/curves.svg"), "<circle class=\"test-acc\""), 3u);

  // Back to before the first epoch: nothing left, no curves.
  log.truncate_to(0, 0);
  EXPECT_TRUE(rows_of(read_csv(dir + "/metrics.csv"), "epoch").empty());
  EXPECT_TRUE(ddp::read_epoch_metrics(dir + "/metrics.jsonl").empty());
  EXPECT_FALSE(std::filesystem::exists(dir + "/curves.svg"));
}

TEST(Metrics, CorruptJsonlNamesFileAndLine) {
  const auto dir = ddp::testing::temp_dir("metrics_bad");
  std::ofstream(dir + "/metrics.jsonl") << R"({"epoch": 1, "train_loss": 1, "test_loss": 1, "test_acc": 0.5, "lr": 0.1, "epoch_seconds": 1, "samples_per_second": 1})"
                                        << "\n{\"epoch\": 2, \"train_lo\n";
  try {
    ddp::read_epoch_metrics(dir + "/metrics.jsonl");
    ADD_FAILURE() << "no error";
  } catch (const ddp::UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir + "/metrics.jsonl line 2"), std::string::npos) << what;
    EXPECT_NE(what.find("Hint"), std::string::npos) << what;
  }
}

}  // namespace
