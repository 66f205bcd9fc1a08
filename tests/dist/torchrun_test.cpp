// ddptrain under a real torchrun (Debian's python3-torch 1.13, which
// `./setup.sh --tests` installs, or the first torchrun on PATH, e.g. the CUDA
// wheel's 2.x on the GPU machine): the README's command trains one job, and
// bad input that every rank meets is printed once, not once per rank.
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "ddp/dist/launch.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::run_process;

// Debian's torchrun if installed, else the first one on PATH ("" if none).
const std::string& torchrun_exe() {
  static const std::string exe = [] {
    if (fs::exists("/usr/bin/torchrun")) return std::string("/usr/bin/torchrun");
    const char* path = std::getenv("PATH");
    std::istringstream dirs(path ? path : "");
    for (std::string d; std::getline(dirs, d, ':');)
      if (!d.empty() && fs::exists(d + "/torchrun")) return d + "/torchrun";
    return std::string();
  }();
  return exe;
}

// The README's command. torchrun 1.13 spells its flags with underscores
// only (2.x takes both). Debian's 1.13 on Python 3.11 cannot turn its default
// "--redirects 0" into a value (enum iteration changed in 3.11: the
// AttributeError 'NoneType' object has no attribute 'get'), so stderr is
// redirected and teed (2), which it can; that also prefixes each line with
// the rank.
std::vector<std::string> torchrun(int ranks, std::vector<std::string> flags, const std::string& backend = "gloo") {
  std::vector<std::string> a{torchrun_exe(), "--nproc_per_node", std::to_string(ranks), "--master_port",
                             std::to_string(ddp::find_free_port()), "--redirects", "2", "--tee", "2", "--no_python", DDPTRAIN_EXE,
                             "--backend", backend, "--progress", "plain", "--timeout", "60"};
  a.insert(a.end(), flags.begin(), flags.end());
  return a;
}

// The ranks the documented commands run with here: 2 CPU ranks over Gloo
// (Debian's LibTorch and torchrun 1.13), or, where LibTorch has no Gloo
// (the CUDA wheel's, whose torchrun is 2.x), one NCCL rank per GPU, at most 2.
struct DocumentedRanks {
  int count;
  std::string backend;
};
DocumentedRanks documented_ranks() {
  if (ddp::compat::kHasGloo) return {2, "gloo"};
  return {static_cast<int>(std::min<int64_t>(2, static_cast<int64_t>(torch::cuda::device_count()))), "nccl"};
}

using ddp::testing::count;

#define SKIP_UNLESS_TORCHRUN()                                                                     \
  do {                                                                                             \
    DDP_SKIP_UNLESS_GLOO();                                                                        \
    if (torchrun_exe().empty()) GTEST_SKIP() << "no torchrun (./setup.sh --tests installs python3-torch)"; \
  } while (0)

// The documented commands: on Gloo ranks, or on NCCL ranks where there is no Gloo.
#define SKIP_UNLESS_TORCHRUN_AND_RANKS()                                                           \
  do {                                                                                             \
    if (documented_ranks().count == 0) GTEST_SKIP() << "neither Gloo nor a GPU here";              \
    if (torchrun_exe().empty()) GTEST_SKIP() << "no torchrun (./setup.sh --tests installs python3-torch)"; \
  } while (0)

// The README's `torchrun --nproc_per_node N --no_python ./build/ddptrain`.
TEST(Torchrun, TwoRanksTrainOneJob) {
  SKIP_UNLESS_TORCHRUN();
  const auto dir = ddp::testing::temp_dir("torchrun_train");
  auto r = run_process(torchrun(2, {"--dataset", "synthetic", "--epochs", "1", "--train-samples", "512",
                                    "--test-samples", "128", "--save_path", dir}),
                       {}, 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("world: 2 rank(s)"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "train_loss"), 1u) << "one epoch line, from rank 0 only:\n" << r.output;
  EXPECT_EQ(ddp::testing::metrics_jsonl(dir).size(), 1u) << r.output;
  // Resuming takes the launcher again; export and report need no ranks, so
  // their commands are the program alone (under torchrun they ran twice).
  EXPECT_NE(r.output.find("resume:   torchrun --nproc_per_node 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(std::string("export:   ") + DDPTRAIN_EXE + " export "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(std::string("view:     ") + DDPTRAIN_EXE + " report "), std::string::npos) << r.output;
}

// Every rank meets the same bad --data_root; the user reads it once. (Each
// rank printed it: torchrun's agent stops the others only when it next
// polls them, every 5 s in torch 1.13.)
TEST(Torchrun, BadInputOnEveryRankIsPrintedOnce) {
  SKIP_UNLESS_TORCHRUN();
  const auto dir = ddp::testing::temp_dir("torchrun_bad");
  auto r = run_process(torchrun(2, {"--data_root", dir + "/no_such_data", "--epochs", "1", "--save_path", dir}), {},
                       240);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, ": error: "), 1u) << r.output;
  EXPECT_NE(r.output.find(dir + "/no_such_data"), std::string::npos) << r.output;
}

// Bad input on rank 1 only: its line is the error, and rank 0's follow-on
// collective failure is not printed (it came second, and torchrun named
// rank 0 the root cause).
TEST(Torchrun, BadInputOnOneRankIsTheOnlyErrorPrinted) {
  SKIP_UNLESS_TORCHRUN();
  const auto dir = ddp::testing::temp_dir("torchrun_one_bad");
  auto r = run_process(torchrun(2, {"--dataset", "synthetic", "--epochs", "1", "--train-samples", "512",
                                    "--test-samples", "128", "--save_path", dir, "--inject-fault", "1:1:user"}),
                       {}, 240);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("injected bad input (--inject-fault) on rank 1"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, ": error: "), 1u) << r.output;
}

// ---- The documented commands, as written (issue 43, item 8) ----------------

// The lines of `file` that run torchrun (in a shell block or a comment).
std::vector<std::string> torchrun_lines(const std::string& file) {
  std::vector<std::string> out;
  std::istringstream in(ddp::testing::read_file(file));
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("torchrun --");
    if (at != std::string::npos && line.find("--no") != std::string::npos) out.push_back(line.substr(at));
  }
  return out;
}

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line.substr(0, line.find('#')));
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// A documented command, run with this build's `program` in place of the one
// it names, documented_ranks(), a free port, and a short run after its own
// flags.
ddp::testing::ProcessResult run_as_written(std::vector<std::string> cmd, const std::string& program,
                                           const std::string& dir, std::vector<std::string> extra = {},
                                           bool short_run = true) {
  const auto ranks = documented_ranks();
  for (size_t i = 0; i + 1 < cmd.size(); ++i)
    if (cmd[i].rfind("--nproc", 0) == 0) cmd[i + 1] = std::to_string(ranks.count);
  for (auto& w : cmd)
    if (w.rfind("./build/", 0) == 0) w = program;
  cmd[0] = torchrun_exe();
  cmd.insert(cmd.begin() + 1, {"--master_port", std::to_string(ddp::find_free_port())});
  if (short_run) {
    cmd.insert(cmd.end(), {"--backend", ranks.backend});
    for (const char* f : {"--progress", "plain", "--timeout", "60", "--epochs", "1", "--train-samples", "256",
                          "--test-samples", "64", "--workers", "0", "--save_path"})
      cmd.push_back(f);
    cmd.push_back(dir);
  }
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return run_process(cmd, {}, 240);
}

// Each torchrun command of the README and the template runs on Debian's
// torchrun 1.13 as written. (The template's --nproc-per-node/--no-python was
// "unrecognized", the README's form crashed with 'NoneType' object has no
// attribute 'get'.)
TEST(Torchrun, DocumentedCommandsRunAsWritten) {
  SKIP_UNLESS_TORCHRUN_AND_RANKS();
  const std::vector<std::pair<std::string, std::string>> docs = {
      {DDP_SOURCE_DIR "/README.md", DDPTRAIN_EXE}, {DDP_SOURCE_DIR "/template/train.cpp", EXAMPLE_regression}};
  for (const auto& [file, program] : docs) {
    const auto lines = torchrun_lines(file);
    EXPECT_FALSE(lines.empty()) << file;
    for (const auto& line : lines) {
      const bool ddptrain = program == DDPTRAIN_EXE;
      auto r = run_as_written(words(line), program, ddp::testing::temp_dir("torchrun_doc"),
                              ddptrain ? std::vector<std::string>{"--dataset", "synthetic"} : std::vector<std::string>{});
      EXPECT_EQ(r.exit_code, 0) << file << ": " << line << "\n" << r.output;
    }
  }
}

// Stopped under torchrun, the run prints a resume command that is a
// torchrun command, and that command resumes it. torchrun itself exits 1
// (the rank's 75 is in its report), as the README says.
TEST(Torchrun, PreemptedRunPrintsATorchrunResumeCommand) {
  SKIP_UNLESS_TORCHRUN_AND_RANKS();
  const auto dir = ddp::testing::temp_dir("torchrun_preempt");
  const auto ranks = documented_ranks();
  auto args = torchrun(ranks.count, {"--dataset", "synthetic", "--epochs", "3", "--train-samples", "2048", "--test-samples",
                                     "64", "--workers", "0", "--save_path", dir}, ranks.backend);
  auto child = ddp::testing::start_process(args);
  ASSERT_TRUE(ddp::testing::wait_for_output(child, "world: ")) << "training never started";
  std::this_thread::sleep_for(std::chrono::seconds(1));
  kill(child.pid, SIGTERM);
  auto r = ddp::testing::finish_process(child, 240);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::string said = "Resume: ";
  const auto at = r.output.find(said);
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string command = r.output.substr(at + said.size(), r.output.find('\n', at) - at - said.size());
  EXPECT_EQ(command.rfind("torchrun --nproc_per_node " + std::to_string(ranks.count) +
                              " --redirects 2 --tee 2 --no_python " + std::string(DDPTRAIN_EXE) +
                              " --resume ",
                          0),
            0u)
      << r.output;
  auto again = run_as_written(words(command), DDPTRAIN_EXE, dir, {}, /*short_run=*/false);
  EXPECT_EQ(again.exit_code, 0) << command << "\n" << again.output;
  EXPECT_NE(again.output.find("resume: "), std::string::npos) << again.output;
  EXPECT_EQ(ddp::testing::metrics_jsonl(dir).size(), 3u) << again.output;
}

}  // namespace
