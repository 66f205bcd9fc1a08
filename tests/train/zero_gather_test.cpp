// ZeRO-1's parameter gather (--shard-optimizer), started by the optimizer
// step and waited for by the parameters' readers: real Gloo ranks over TCP
// through the test worker (tests/worker/testworker.cpp: zero_async,
// zero_gather_dead).
#include <filesystem>
#include <functional>
#include <sstream>

#include "support/testing.h"

namespace {

using ddp::testing::run_process;

ddp::testing::ProcessResult run_workers(int n, const std::vector<std::string>& args,
                                        std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv{DDP_TESTWORKER, "--launch", std::to_string(n)};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, env, 120);
}

// Runs SCENARIO on 2 and then 3 ranks; calls check(numbers, where) with
// the numbers each rank wrote to PREFIX_rankR.txt.
void on_2_and_3_ranks(const std::string& scenario, const std::string& prefix,
                      const std::function<void(const std::vector<long long>&, const std::string&)>& check) {
  for (int ranks : {2, 3}) {
    const auto dir = ddp::testing::temp_dir(scenario + std::to_string(ranks));
    auto r = run_workers(ranks, {scenario, dir});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (int rank = 0; rank < ranks; ++rank) {
      std::istringstream in(ddp::testing::read_file(dir + "/" + prefix + "_rank" + std::to_string(rank) + ".txt"));
      std::vector<long long> numbers;
      for (long long x; in >> x;) numbers.push_back(x);
      check(numbers, std::to_string(ranks) + " ranks, rank " + std::to_string(rank));
    }
  }
}

// On 2 and 3 ranks (3 cuts both flat buffers unevenly), 5 AdamW steps:
// every run() returns with the gather pending and a checkpoint of the state
// refused until it is waited for; once waited for (by wait_for_parameters(),
// by gather_optimizer_state() or by the next run()), the parameters are the
// unsharded run's bit for bit, each step's gather was waited for once per
// flat buffer, and no forward began with it pending.
TEST(ZeroGather, PendingAfterStepAndUnshardedBitsOnceWaitedFor) {
  DDP_SKIP_UNLESS_GLOO();
  on_2_and_3_ranks("zero_async", "zero_async", [](const std::vector<long long>& n, const std::string& where) {
    ASSERT_EQ(n.size(), 6u) << where;
    const long long pending = n[0], refused = n[1], equal = n[2], waited = n[3], buffers = n[4], saw_pending = n[5];
    EXPECT_EQ(pending, 5) << where << ": run() waited for its own gather";
    EXPECT_EQ(refused, 5) << where << ": a checkpoint was written with the gather in flight";
    EXPECT_EQ(equal, 5) << where << ": the waited-for parameters differ from the unsharded run's";
    EXPECT_EQ(buffers, 2) << where;  // weights, and the 1-D parameters apart (no_decay_1d)
    EXPECT_EQ(waited, 5 * buffers) << where;
    EXPECT_EQ(saw_pending, 0) << where << ": a forward began before the last step's gather was waited for";
  });
}

// ddptrain's GPT (3 blocks) under LmTask, on 2 and 3 ranks: a forward
// that begins with the gather pending waits for it part by part (the
// embeddings, then block 0, 1, 2, then the rest before the head), each
// wait leaving fewer pieces pending and block 0 starting with later
// blocks' pieces still pending; the weights equal the unsharded run's bit
// for bit.
TEST(ZeroGather, GptForwardWaitsBlockByBlock) {
  DDP_SKIP_UNLESS_GLOO();
  on_2_and_3_ranks("zero_gpt_parts", "gpt_parts", [](const std::vector<long long>& n, const std::string& where) {
    ASSERT_EQ(n.size(), 5u) << where;
    const long long equal = n[0], forwards = n[1], in_order = n[2], first_block_left = n[3], last_left = n[4];
    EXPECT_EQ(equal, 3) << where << ": the weights differ from the unsharded run's";
    EXPECT_EQ(forwards, 3) << where << ": steps 2, 4 and 6 begin with the last step's gather pending";
    EXPECT_EQ(in_order, 3) << where << ": the gather was not started in the forward's order, or the parts were "
                                       "not waited for one by one, in order, each for its own pieces";
    // Blocks 1 and 2 (and the final norm) at least: one piece each.
    EXPECT_GE(first_block_left, 3) << where << ": block 0 waited for later blocks' pieces";
    EXPECT_EQ(last_left, 0) << where << ": the head ran before the whole gather was waited for";
  });
}

// The trainer's other readers of the parameters (the --ema update right
// after each step, its swap for validation, evaluation, checkpoints) on a
// 2-rank run of the CNN with and without --shard-optimizer: the same
// weights, byte for byte as exported.
TEST(ZeroGather, EmaRunEqualsUnsharded_BitExact) {
  DDP_SKIP_UNLESS_GLOO();
  std::string exported[2];
  for (int sharded : {0, 1}) {
    const auto dir = ddp::testing::temp_dir("zero_ema" + std::to_string(sharded));
    std::vector<std::string> args{DDPTRAIN_EXE, "--save_path", dir, "--dataset", "synthetic", "--size", "2",
                                  "--backend", "gloo", "--epochs", "2", "--train-samples", "256", "--test-samples",
                                  "64", "--ema", "0.9", "--progress", "none"};
    if (sharded) args.push_back("--shard-optimizer");
    auto r = run_process(args, {}, 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("parameter gather in the background, waited for before the next forward") !=
                  std::string::npos,
              sharded == 1)
        << r.output;
    auto ex = run_process({DDPTRAIN_EXE, "export", ddp::testing::find_file(dir, "epoch_2.pt"), dir + "/w.pt"});
    ASSERT_EQ(ex.exit_code, 0) << ex.output;
    exported[sharded] = ddp::testing::read_file(dir + "/w.pt");
  }
  ASSERT_FALSE(exported[0].empty());
  EXPECT_TRUE(exported[0] == exported[1]) << "the sharded run's weights differ";
}

// A rank that never joins the gather: rank 0's step returns at once (the
// gather is asynchronous), and its wait ends the job with the one-line
// collective error naming the gather within --timeout, not a hang.
TEST(ZeroGather, StalledRankDuringTheGatherIsReportedWithinTimeout) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("zero_gather_stall");
  auto r = run_workers(2, {"zero_gather_dead", dir, "stall"}, {{"DDP_TEST_TIMEOUT_MS", "3000"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 20) << r.output;
  EXPECT_EQ(ddp::testing::read_file(dir + "/returned"), "1\n") << "rank 0's step did not return with its gather pending";
  const std::string line =
      "rank 0 of 2: collective 'the sharded optimizer's parameter gather (--shard-optimizer)' failed";
  const auto at = r.output.find(line);
  ASSERT_NE(at, std::string::npos) << r.output;
  // One line: the error and its hint, no backtrace.
  const auto eol = r.output.find('\n', at);
  EXPECT_NE(r.output.substr(at, eol - at).find("Hint: another rank probably died or stalled"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 0 exited with code 4"), std::string::npos) << r.output;  // kPeerFailed
}

// A rank that dies instead: the job ends at once, naming that rank's error.
TEST(ZeroGather, DeadRankDuringTheGatherEndsTheJob) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("zero_gather_throw");
  auto r = run_workers(2, {"zero_gather_dead", dir, "throw"}, {{"DDP_TEST_TIMEOUT_MS", "60000"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 15) << r.output;
  EXPECT_NE(r.output.find("injected failure on rank 1 before the gather"), std::string::npos) << r.output;
}

}  // namespace
