// ddptrain under a real torchrun (Debian's python3-torch, which
// `./setup.sh --tests` installs): the README's command trains one job, and
// bad input that every rank meets is printed once, not once per rank.
#include <filesystem>
#include <string>
#include <vector>

#include "ddp/dist/launch.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::run_process;

constexpr const char* kTorchrun = "/usr/bin/torchrun";

// The README's command. torchrun 1.13 spells its flags with underscores
// only (2.x takes both). Debian's 1.13 on Python 3.11 cannot turn its default
// "--redirects 0" into a value (enum iteration changed in 3.11: the
// AttributeError 'NoneType' object has no attribute 'get'), so stderr is
// redirected and teed (2), which it can; that also prefixes each line with
// the rank.
std::vector<std::string> torchrun(int ranks, std::vector<std::string> flags) {
  std::vector<std::string> a{kTorchrun, "--nproc_per_node", std::to_string(ranks), "--master_port",
                             std::to_string(ddp::find_free_port()), "--redirects", "2", "--tee", "2", "--no_python", DDPTRAIN_EXE,
                             "--backend", "gloo", "--progress", "plain", "--timeout", "60"};
  a.insert(a.end(), flags.begin(), flags.end());
  return a;
}

using ddp::testing::count;

#define SKIP_UNLESS_TORCHRUN()                                                                     \
  do {                                                                                             \
    DDP_SKIP_UNLESS_GLOO();                                                                        \
    if (!fs::exists(kTorchrun)) GTEST_SKIP() << "no " << kTorchrun << " (./setup.sh --tests installs python3-torch)"; \
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
                                    "--test-samples", "128", "--save_path", dir}),
                       {{"DDPTRAIN_FAIL_AT_STEP", "1:1:user"}}, 240);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("injected bad input (DDPTRAIN_FAIL_AT_STEP) on rank 1"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, ": error: "), 1u) << r.output;
}

}  // namespace
