// A run can move (issue 43, item 9): a resumed run finds its data from any
// working directory and at a new --data_root, and continues bit-exactly;
// other data at --data_root stops it in one line, before it writes anything.
// Through the real ddptrain binary and a program built from the template
// (examples/tabular), on small MNIST-shaped and CSV data.
#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/models/registry.h"
#include "support/checkpoint_weights.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace moved_run {

using ddp::testing::only_run_dir;
using ddp::testing::run_process;

// `exe` with `args`, run in the working directory `cwd`.
ddp::testing::ProcessResult run_in(const std::string& cwd, const std::string& exe, std::vector<std::string> args) {
  std::vector<std::string> argv{"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", cwd, exe};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, 120);
}

// A small CPU run of the CNN: one rank, no loader threads, no sanity steps.
std::vector<std::string> small(std::vector<std::string> extra) {
  std::vector<std::string> a{"--size", "1", "--backend", "gloo", "--model", "cnn", "--workers", "0",
                             "--sanity-val-steps", "0", "--progress", "none", "--timeout", "60"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Every file under `dir` with its size and modification time: what a run
// that "writes nothing" leaves exactly as it was.
std::map<std::string, std::pair<uintmax_t, int64_t>> snapshot(const std::string& dir) {
  std::map<std::string, std::pair<uintmax_t, int64_t>> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    struct stat st {};
    ::stat(e.path().c_str(), &st);
    out[e.path().string()] = {e.is_regular_file() ? e.file_size() : 0,
                              static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
  }
  return out;
}

// The lines a refused run printed besides the one every rank prints at its
// start ("ddptrain: rank 0 of 1 (...)"): the error alone, in one line.
std::vector<std::string> lines_after_start(const std::string& output) {
  std::vector<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.find(": rank 0 of 1 (") == std::string::npos) out.push_back(line);
  return out;
}

using ddp::testing::expect_bit_equal;

// Trained with a relative --data_root in one directory, resumed from
// another without --data_root: the run saved the path resolved. On main it
// looked for 'data' under the new directory and stopped.
TEST(MovedRun, RelativeDataRootResumesFromAnotherWorkingDirectory) {
  DDP_SKIP_UNLESS_GLOO();
  const auto job = ddp::testing::temp_dir("moved_relative"), elsewhere = ddp::testing::temp_dir("moved_elsewhere");
  ddp::testing::write_mnist_like(job + "/data", 256, 64, 1);
  auto first = run_in(job, DDPTRAIN_EXE, small({"--data_root", "data", "--save_path", "runs", "--epochs", "1"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string run = only_run_dir(job + "/runs");
  const auto saved = nlohmann::json::parse(ddp::testing::read_file(run + "/config.json"));
  EXPECT_EQ(saved["data_root"], job + "/data");
  EXPECT_EQ(saved["save_path"], job + "/runs");
  EXPECT_EQ(ddp::read_checkpoint_meta(run + "/epoch_1.pt").config["data_root"], job + "/data");

  auto resumed = run_in(elsewhere, DDPTRAIN_EXE, {"--resume", run, "--epochs", "2", "--reschedule", "--progress", "none"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(ddp::testing::metrics_jsonl(run).size(), 2u) << resumed.output;
  EXPECT_TRUE(fs::is_empty(elsewhere)) << "the resumed run wrote in its working directory";
}

// The data copied to a new folder (the old one gone): --resume with the
// new --data_root goes on, and ends bit-identical to a run never moved.
// On main, the new --data_root was refused as changing what the run learns.
TEST(MovedRun, CopiedDataAtANewDataRootContinuesBitExactly) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("moved_copy");
  ddp::testing::write_mnist_like(dir + "/old", 512, 128, 3);
  const auto run = [&](const std::string& save_path, std::vector<std::string> extra) {
    auto a = small({"--data_root", dir + "/old", "--save_path", save_path, "--epochs", "2", "--seed", "4"});
    a.insert(a.end(), extra.begin(), extra.end());
    return run_in(dir, DDPTRAIN_EXE, a);
  };
  auto straight = run(dir + "/straight", {});
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto first = run(dir + "/moved", {"--save_epoch", "1"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string moved = only_run_dir(dir + "/moved");

  fs::copy(dir + "/old", dir + "/new");
  fs::rename(dir + "/old", dir + "/gone");
  auto resumed = run_in(dir, DDPTRAIN_EXE, {"--resume", moved + "/epoch_1.pt", "--data_root", dir + "/new"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resume: " + moved + "/epoch_1.pt"), std::string::npos) << resumed.output;
  expect_bit_equal(only_run_dir(dir + "/straight") + "/epoch_2.pt", moved + "/epoch_2.pt");
  // The run goes on reading the new place.
  EXPECT_EQ(ddp::read_checkpoint_meta(moved + "/epoch_2.pt").config["data_root"], dir + "/new");
}

// Other data at --data_root, of the same shape: other pixels, or another
// number of samples. One line naming the split, what differs and the fix;
// exit 2; the run directory exactly as it was.
TEST(MovedRun, OtherDataAtTheDataRootIsRefusedInOneLineAndWritesNothing) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("moved_other");
  ddp::testing::write_mnist_like(dir + "/data", 256, 64, 5);
  ddp::testing::write_mnist_like(dir + "/other", 256, 64, 6);
  ddp::testing::write_mnist_like(dir + "/fewer", 192, 64, 5);
  auto first = run_in(dir, DDPTRAIN_EXE, small({"--data_root", "data", "--save_path", "runs", "--epochs", "1"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string run = only_run_dir(dir + "/runs");
  const auto before = snapshot(dir + "/runs");

  for (const auto& [root, what] :
       std::vector<std::pair<std::string, std::string>>{
           {"other", "the train split 'fashion-mnist (train)' holds other samples (fingerprint "},
           {"fewer", "the train split 'fashion-mnist (train)' has 192 samples, the run's had 256."}}) {
    auto r = run_in(dir, DDPTRAIN_EXE,
                    {"--resume", run, "--data_root", root, "--epochs", "2", "--reschedule", "--progress", "none"});
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
    EXPECT_EQ(lines_after_start(r.output).size(), 1u) << r.output;
    EXPECT_NE(r.output.find("error: checkpoint " + run + "/epoch_1.pt trained on other data than this run reads: "),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("Hint: pass the --data_root the run trained on (" + dir + "/data) or a copy of that "
                            "data, or start a new run without --resume."),
              std::string::npos) << r.output;
    EXPECT_EQ(snapshot(dir + "/runs"), before) << "a refused resume wrote in the run directory";
  }
}

// A program built from the template, with its own data (a CSV read into
// named tensors, no fingerprint): resumed from another working directory
// it finds its relative --data_root; CSVs of another length are refused.
TEST(MovedRun, TemplateProgramResumesFromElsewhereAndRefusesOtherRows) {
  DDP_SKIP_UNLESS_GLOO();
  const auto job = ddp::testing::temp_dir("moved_tabular"), elsewhere = ddp::testing::temp_dir("moved_tabular_away");
  ddp::testing::write_sales_csvs(job + "/sales", 400, 100);
  ddp::testing::write_sales_csvs(job + "/more", 500, 100);
  auto first = run_in(job, EXAMPLE_tabular,
                      {"--data_root", "sales", "--save_path", "runs", "--size", "1", "--backend", "gloo", "--epochs",
                       "1", "--workers", "0", "--progress", "none"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string run = only_run_dir(job + "/runs");

  auto other = run_in(job, EXAMPLE_tabular, {"--resume", run, "--data_root", "more", "--epochs", "2", "--reschedule"});
  EXPECT_EQ(other.exit_code, ddp::exit_code::kUsage) << other.output;
  EXPECT_EQ(lines_after_start(other.output).size(), 1u) << other.output;
  EXPECT_NE(other.output.find("the train split 'sales train.csv' has 500 samples, the run's had 400"), std::string::npos)
      << other.output;

  auto resumed = run_in(elsewhere, EXAMPLE_tabular, {"--resume", run, "--epochs", "2", "--reschedule", "--progress", "none"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(ddp::testing::metrics_jsonl(run).size(), 2u) << resumed.output;
}

}  // namespace moved_run
