// Gradient synchronisation and SyncBatchNorm, proven with real processes over
// a real Gloo group on loopback, started by the real launcher.
#include "ddp/dist/grad_sync.h"
#include "ddp/dist/world.h"
#include "support/testing.h"

namespace {

using ddp::testing::run_process;

torch::Tensor load(const std::string& path) {
  torch::Tensor t;
  torch::load(t, path);
  return t;
}

// Relative agreement, scaled by the magnitude of the reference.
void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  double diff = (a - b).abs().max().item<double>();
  double scale = std::max(1.0, b.abs().max().item<double>());
  EXPECT_LE(diff, rtol * scale) << what << ": max abs diff " << diff;
}

ddp::testing::ProcessResult run_workers(int n, const std::vector<std::string>& args,
                                        std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv{DDP_TESTWORKER, "--launch", std::to_string(n)};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, env, 120);
}

class Equivalence : public ::testing::TestWithParam<int> {};

// 2 ranks x 8 samples with SyncBatchNorm == 1 rank x 16 samples: same
// parameters and running statistics after 5 SGD steps (with momentum).
TEST_P(Equivalence, TwoRanksEqualOneRankOnTheGlobalBatch) {
  DDP_SKIP_UNLESS_GLOO();
  const int accum = GetParam();
  auto one = ddp::testing::temp_dir("eq1"), two = ddp::testing::temp_dir("eq2");
  auto r1 = run_workers(1, {"equivalence", one, std::to_string(accum)});
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  auto r2 = run_workers(2, {"equivalence", two, std::to_string(accum)});
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto ref = load(one + "/state_rank0.pt");
  auto a = load(two + "/state_rank0.pt"), b = load(two + "/state_rank1.pt");
  expect_close(a, ref, 1e-5, "rank 0 vs single rank");
  expect_close(b, ref, 1e-5, "rank 1 vs single rank");
  EXPECT_TRUE(torch::equal(a, b)) << "ranks must end bit-identical";
  // The run must have moved the parameters at all, or the test proves nothing.
  EXPECT_GT(ref.abs().sum().item<double>(), 0);
}

// The control: without SyncBatchNorm each rank normalises over its own 8
// samples, so the result must differ. This shows the test above can fail.
TEST(GradSync, LocalBatchNormIsNotEquivalent) {
  DDP_SKIP_UNLESS_GLOO();
  auto one = ddp::testing::temp_dir("ctl1"), two = ddp::testing::temp_dir("ctl2");
  ASSERT_EQ(run_workers(1, {"equivalence", one, "1"}).exit_code, 0);
  auto r = run_workers(2, {"equivalence", two, "1", "local-bn"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto diff = (load(two + "/state_rank0.pt") - load(one + "/state_rank0.pt")).abs().max().item<double>();
  EXPECT_GT(diff, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Accumulation, Equivalence, ::testing::Values(1, 2),
                         [](const auto& info) { return "accum" + std::to_string(info.param); });

TEST(SyncBatchNorm, UnequalRankBatchesMatchOneBigBatch) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("unequal");
  auto r = run_workers(2, {"syncbn_unequal", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::istringstream in(ddp::testing::read_file(dir + "/unequal_rank" + std::to_string(rank) + ".txt"));
    double dy = 1, dx = 1, dm = 1, dv = 1;
    in >> dy >> dx >> dm >> dv;
    EXPECT_LT(dy, 1e-5) << "forward, rank " << rank;
    EXPECT_LT(dx, 1e-5) << "input gradient, rank " << rank;
    EXPECT_LT(dm, 1e-5) << "running mean, rank " << rank;
    EXPECT_LT(dv, 1e-5) << "running var, rank " << rank;
  }
}

// In eval mode without running statistics each rank normalises its own
// batches: unequal batch counts per rank must neither hang nor mix ranks.
TEST(SyncBatchNorm, EvalWithoutRunningStatsIsLocalAndDoesNotCommunicate) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("bn_eval");
  auto r = run_workers(2, {"syncbn_eval", dir}, {{"DDP_TEST_TIMEOUT_MS", "10000"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::istringstream in(ddp::testing::read_file(dir + "/eval_rank" + std::to_string(rank) + ".txt"));
    double worst = 1;
    in >> worst;
    EXPECT_LT(worst, 1e-5) << "rank " << rank;
  }
}

// Buckets launched inside backward, per rank, and the number of buckets.
std::vector<std::pair<size_t, size_t>> overlap_counts(const std::string& variant) {
  auto dir = ddp::testing::temp_dir("overlap" + variant);
  std::vector<std::string> args{"overlap", dir};
  if (!variant.empty()) args.push_back(variant);
  auto r = run_workers(2, args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::pair<size_t, size_t>> out;
  for (int rank = 0; rank < 2; ++rank) {
    std::istringstream in(ddp::testing::read_file(dir + "/overlap_rank" + std::to_string(rank) + ".txt"));
    size_t during = 0, buckets = 0;
    in >> during >> buckets;
    out.emplace_back(during, buckets);
  }
  return out;
}

TEST(GradSync, BucketAllReduceStartsBeforeBackwardReturns) {
  DDP_SKIP_UNLESS_GLOO();
  for (const auto& [during, buckets] : overlap_counts("")) {
    EXPECT_GE(buckets, 6u);
    EXPECT_GE(during, 1u) << "no bucket was launched inside backward";
  }
}

// Under ddp::recompute the parameters' gradients land during the
// recomputed backward, and their buckets start there as without it.
TEST(GradSync, BucketsStartInsideARecomputedBackward) {
  DDP_SKIP_UNLESS_GLOO();
  const auto plain = overlap_counts(""), again = overlap_counts("recompute");
  for (size_t rank = 0; rank < 2; ++rank) {
    EXPECT_GE(again[rank].first, 1u) << "no bucket was launched inside backward";
    EXPECT_EQ(again[rank], plain[rank]) << "rank " << rank;
  }
}

TEST(GradSync, UnusedParametersDoNotHangAndAgree) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("unused");
  auto r = run_workers(2, {"unused", dir}, {{"DDP_TEST_TIMEOUT_MS", "20000"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30);
  auto a = load(dir + "/grads_rank0.pt"), b = load(dir + "/grads_rank1.pt");
  EXPECT_TRUE(torch::equal(a, b));
  // fc1 is used on rank 0 only, so the averaged gradient is half of rank 0's
  // and not zero; fc2 is used nowhere, so its gradient is exactly zero.
  const int64_t fc = 4 * 4 + 4;
  EXPECT_GT(a.narrow(0, fc, fc).abs().sum().item<double>(), 0);
  EXPECT_EQ(a.narrow(0, 2 * fc, fc).abs().sum().item<double>(), 0);
}

// The parts a sharded optimizer steps: in rank order, each starting where
// the previous ends, ceil(n / ranks) long but the last ones, covering the
// buffer; more ranks than elements leave the last parts empty.
TEST(ShardRange, PartsTileTheBufferInRankOrder) {
  for (int64_t n : {0, 1, 2, 5, 64, 100, 129, 320})
    for (int ranks : {1, 2, 3, 4, 7}) {
      const int64_t chunk = (n + ranks - 1) / ranks;
      int64_t at = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto part = ddp::shard_range(n, ranks, r);
        EXPECT_EQ(part.lo, at) << n << " over " << ranks << ", rank " << r;
        EXPECT_GE(part.len, 0);
        EXPECT_LE(part.len, chunk);
        if (part.lo + chunk <= n) {
          EXPECT_EQ(part.len, chunk) << n << " over " << ranks << ", rank " << r;
        }
        at += part.len;
      }
      EXPECT_EQ(at, n) << n << " over " << ranks;
    }
  EXPECT_EQ(ddp::shard_range(320, 3, 2).lo, 214);
  EXPECT_EQ(ddp::shard_range(320, 3, 2).len, 106);
  EXPECT_EQ(ddp::shard_range(2, 3, 2).len, 0);
}

// Reduce-scattered buckets (GradientReduction::kReduceScatter; on Gloo one
// reduce per rank's part, Gloo having no reduce_scatter), and ZeRO-2
// (shard_gradients) over an all-reduce and over a reduce-scatter: on 2 and
// 3 ranks, each rank's part of the gradients equals the all-reduced
// average bit for bit (exact integer sums), the ranks' parts cut inside
// buckets; the used flags (one parameter unused on rank 1) agree; ZeRO-2
// leaves .grad none, keeps the parameters' norms bit for bit where asked,
// and holds 1/N of the gradient bytes plus, on a rank that used every
// parameter, at most 3 buckets in flight.
TEST(GradSync, ReduceScatterGivesEachRankTheAverageOverItsPart) {
  DDP_SKIP_UNLESS_GLOO();
  for (int n : {2, 3}) {
    auto dir = ddp::testing::temp_dir("reduce_scatter" + std::to_string(n));
    auto r = run_workers(n, {"reduce_scatter", dir}, {{"DDP_TEST_TIMEOUT_MS", "20000"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (int rank = 0; rank < n; ++rank) {
      double diff = -1;
      int flags = -1;
      const auto text = ddp::testing::read_file(dir + "/rs_rank" + std::to_string(rank) + ".txt");
      long long mine = 0, whole = 0, peak = 0, bucket = 0;
      ASSERT_EQ(std::sscanf(text.c_str(), "%lf %d %lld %lld %lld %lld", &diff, &flags, &mine, &whole, &peak, &bucket), 6)
          << text;
      EXPECT_EQ(diff, 0) << n << " ranks, rank " << rank;
      EXPECT_EQ(flags, 1) << n << " ranks, rank " << rank;
      // 5 buckets of 64 floats: ceil(320 / N) floats each, the last rank's fewer.
      EXPECT_EQ(whole, 5 * bucket);
      EXPECT_EQ(mine, 4 * std::min<long long>((320 + n - 1) / n, 320 - rank * ((320 + n - 1) / n))) << text;
      EXPECT_GT(peak, 0);
      if (rank == 0) {
        // The last bucket carries the 5 parameters' used flags (floats) too.
        EXPECT_LE(peak, 3 * bucket + 5 * 4) << "more than 3 buckets in flight on a rank that used every parameter";
      }
    }
  }
}

// ZeRO-2's memory, measured by the CPU allocator in each rank of a real
// TrainStep (32 Linear(128, 128) layers, 2.1 MB of gradients, buckets of a
// layer), against ZeRO-1's on 2 and 3 ranks: once the step is made, each
// rank holds the gradient bytes outside its part less, (N-1)/N of them to
// 5% (the process allocates other things too: 64 KB more on one rank of 3
// in one run, seen); over 3 steps its peak is lower by at least half of that (the buckets
// in flight and autograd's gradients before they are copied take the rest).
TEST(GradSync, ShardedGradientsHoldOneNthOfTheGradientBytes) {
  DDP_SKIP_UNLESS_GLOO();
  const double grads = 32 * (128 * 128 + 128) * 4.0;
  for (int n : {2, 3}) {
    auto dir = ddp::testing::temp_dir("zero_memory" + std::to_string(n));
    for (const std::string stage : {"zero1", "zero2"}) {
      auto r = run_workers(n, {"zero_memory", dir, stage});
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    for (int rank = 0; rank < n; ++rank) {
      long long live1 = 0, peak1 = 0, live2 = 0, peak2 = 0;
      const auto at = [&](const std::string& stage) {
        return ddp::testing::read_file(dir + "/mem_" + stage + "_rank" + std::to_string(rank) + ".txt");
      };
      ASSERT_EQ(std::sscanf(at("zero1").c_str(), "%lld %lld", &live1, &peak1), 2);
      ASSERT_EQ(std::sscanf(at("zero2").c_str(), "%lld %lld", &live2, &peak2), 2);
      const double saved = grads * (n - 1) / n;
      std::printf("%d ranks, rank %d: live %lld -> %lld, peak %lld -> %lld bytes (gradients %.0f, (N-1)/N of them %.0f)\n",
                  n, rank, live1, live2, peak1, peak2, grads, saved);
      EXPECT_NEAR(static_cast<double>(live1 - live2), saved, 0.05 * grads) << n << " ranks, rank " << rank;
      EXPECT_GE(static_cast<double>(peak1 - peak2), 0.5 * saved) << n << " ranks, rank " << rank;
    }
  }
}

// The same over NCCL on 2 GPUs: NCCL's reduce_scatter of uneven parts
// (LibTorch 2.3+; older: one reduce per part).
TEST(GradSync, ReduceScatterGivesEachRankTheAverageOverItsPart_MultiCUDA) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto dir = ddp::testing::temp_dir("reduce_scatter_cuda");
  auto r = run_workers(2, {"reduce_scatter", dir}, {{"DDP_TEST_TIMEOUT_MS", "60000"}, {"DDP_TEST_CUDA", "1"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_EQ(ddp::testing::read_file(dir + "/rs_rank" + std::to_string(rank) + ".txt"), "0 1\n") << rank;
}

// Issue 44 item 6: with SyncBatchNorm, a parameter that one rank's batch
// uses and the other's does not must not put the ranks' collectives out of
// order (the bucket of the unused one is ready before backward starts, as
// in PyTorch): 2 ranks equal 1 rank on the global batch, bit-identical.
TEST(SyncBatchNorm, BranchUsedOnOneRankKeepsCollectivesInOrder) {
  DDP_SKIP_UNLESS_GLOO();
  auto one = ddp::testing::temp_dir("branch1"), two = ddp::testing::temp_dir("branch2");
  auto r1 = run_workers(1, {"syncbn_branch", one});
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  auto r2 = run_workers(2, {"syncbn_branch", two}, {{"DDP_TEST_TIMEOUT_MS", "20000"}});
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto ref = load(one + "/state_rank0.pt");
  auto a = load(two + "/state_rank0.pt"), b = load(two + "/state_rank1.pt");
  expect_close(a, ref, 1e-5, "rank 0 vs single rank");
  EXPECT_TRUE(torch::equal(a, b)) << "ranks must end bit-identical";
}

// Rank 1 builds a model whose last layer has another shape: the job stops
// at GradSync's construction, naming the parameter and the rank, with no hang.
TEST(GradSync, DifferentModelOnOneRankIsNamed) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("mismatch");
  auto r = run_workers(2, {"mismatch", dir}, {{"DDP_TEST_TIMEOUT_MS", "60000"}});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_LT(r.seconds, 20) << r.output;
  EXPECT_NE(r.output.find("the model on rank 1 differs from rank 0's at parameter 2 '1.weight': [5, 4] Float on rank 1, "
                          "[3, 4] Float on rank 0."),
            std::string::npos)
      << r.output;
}

// Two ranks, AdamW with weight decay: a frozen layer stays bit-identical
// (GradSync leaves it out of the flat buffers that the optimizer steps).
TEST(GradSync, FrozenParametersAreNotUpdated) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("frozen");
  auto r = run_workers(2, {"frozen", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::istringstream in(ddp::testing::read_file(dir + "/frozen_rank" + std::to_string(rank) + ".txt"));
    int fc0 = 1, fc2 = 1;
    in >> fc0 >> fc2;
    EXPECT_EQ(fc0, 0) << "frozen fc0 changed on rank " << rank;
  }
}

// A layer that gets no gradient on any rank must stay unchanged, as in
// PyTorch (its .grad is None): no AdamW decay, no moment update (issue 13,
// item 6).
TEST(GradSync, ParametersUnusedOnEveryRankAreNotUpdated) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("unused_all");
  auto r = run_workers(2, {"frozen", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::istringstream in(ddp::testing::read_file(dir + "/frozen_rank" + std::to_string(rank) + ".txt"));
    int fc0 = 1, fc2 = 1;
    in >> fc0 >> fc2;
    EXPECT_EQ(fc2, 0) << "unused fc2 changed on rank " << rank;
  }
}

TEST(Launcher, WorkerExceptionStopsAllAndNamesTheRank) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("throw");
  auto r = run_workers(2, {"throw", dir}, {{"DDP_TEST_TIMEOUT_MS", "60000"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 10) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("injected failure on rank 1"), std::string::npos) << r.output;
}

TEST(Launcher, StalledRankIsReportedAfterTimeout) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("stall");
  auto r = run_workers(2, {"stall", dir}, {{"DDP_TEST_TIMEOUT_MS", "3000"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 15) << r.output;
  EXPECT_NE(r.output.find("rank 0 of 2: collective 'waiting for the stalled rank' failed"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 0 exited with code 4"), std::string::npos) << r.output;  // kPeerFailed
  // The launcher names the rank that was not in the collective.
  EXPECT_NE(r.output.find("rank 1 was still running outside that collective: probably stalled"), std::string::npos)
      << r.output;
}

// A rank that never joins the gradient all-reduce: the others fail within
// --timeout, naming the collective, and the job ends (Gloo: our own timed
// wait names the bucket).
TEST(GradSync, StalledRankInGradientSyncIsReportedWithinTimeout) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("stall_grad");
  auto r = run_workers(2, {"stall_grad", dir}, {{"DDP_TEST_TIMEOUT_MS", "3000"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 20) << r.output;
  EXPECT_NE(r.output.find("rank 0 of 2: collective 'gradient all-reduce (bucket"), std::string::npos) << r.output;
}

// The same over NCCL, where the wait is stream-ordered (no host polling):
// the group's own timeout (NCCL's watchdog) must still end the job and name
// the collective.
TEST(GradSync, StalledRankInGradientSyncIsReportedWithinTimeout_MultiCUDA) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto dir = ddp::testing::temp_dir("stall_grad_cuda");
  auto r = run_workers(2, {"stall_grad", dir}, {{"DDP_TEST_TIMEOUT_MS", "5000"}, {"DDP_TEST_CUDA", "1"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 60) << r.output;
  EXPECT_NE(r.output.find("ALLREDUCE"), std::string::npos) << r.output;
}

}  // namespace

namespace {

// optimizer.zero_grad() sets gradients to None on LibTorch 2.x (set_to_none
// is its default there). The next backward must still land in GradSync's
// flat buffer, which is what gets all-reduced and stepped.
TEST(GradSync, GradientsSetToNoneFlowBackIntoTheFlatBuffer) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = ddp::testing::one_rank_world();
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 3);
  ddp::GradSync sync(*lin, *world);
  const auto x = torch::randn({5, 4});
  for (int round = 0; round < 2; ++round) {
    for (auto& p : lin->parameters()) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none=true)
    lin->forward(x).sum().backward();
    sync.finish();
    const auto& flat = sync.flat_grads().at(0);
    const auto* lo = static_cast<const char*>(flat.data_ptr());
    const auto* hi = lo + flat.numel() * flat.element_size();
    for (auto& p : lin->parameters()) {
      const auto* at = static_cast<const char*>(p.grad().data_ptr());
      EXPECT_TRUE(at >= lo && at < hi) << "round " << round << ": .grad left the flat buffer";
    }
    // d(sum)/dW = ones(3) x sum_b x_b; d/db = 5: in the flat buffer too.
    const auto expected_w = torch::ones({3, 1}) * x.sum(0).unsqueeze(0);
    EXPECT_TRUE(torch::allclose(lin->weight.grad(), expected_w));
    EXPECT_NEAR(flat.sum().item<double>(), expected_w.sum().item<double>() + 3 * 5.0, 1e-4);
  }
}

// A parameter whose gradient was set to none and that gets none in the next
// backward must not be stepped (or all-reduced) with the gradient an older
// step left in its slice. zero_grad(set_to_none) then hands the next
// gradients over without adding them to zeros: equal to one backward's.
TEST(GradSync, SetToNoneLeavesNoStaleGradientBehind) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = ddp::testing::one_rank_world();
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::Linear(4, 2));
  auto a = net[0]->as<torch::nn::Linear>(), b = net[1]->as<torch::nn::Linear>();
  ddp::GradSync sync(*net, *world);
  const auto x = torch::randn({5, 4});
  const auto want_a = torch::ones({3, 1}) * x.sum(0).unsqueeze(0);
  (a->forward(x).sum() + b->forward(x).sum()).backward();
  sync.finish();
  ASSERT_GT(b->weight.grad().abs().sum().item<double>(), 0.0);

  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();  // as a user's zero_grad(set_to_none=true)
  a->forward(x).sum().backward();
  sync.finish();
  EXPECT_EQ(sync.usage().unused_here.size(), 2u) << "b's weight and bias";
  ASSERT_TRUE(b->weight.grad().defined());
  EXPECT_EQ(b->weight.grad().abs().sum().item<double>(), 0.0) << "b's slice kept the first step's gradient";
  EXPECT_EQ(b->bias.grad().abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(a->weight.grad(), want_a));

  sync.zero_grad(/*set_to_none=*/true);
  for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  (a->forward(x).sum() + b->forward(x).sum()).backward();
  sync.finish();
  EXPECT_TRUE(torch::equal(a->weight.grad(), want_a)) << "handed over, not added to the last step's";
  const auto& flat = sync.flat_grads().at(0);
  for (auto& p : net->parameters()) {
    const auto* at = static_cast<const char*>(p.grad().data_ptr());
    const auto* lo = static_cast<const char*>(flat.data_ptr());
    EXPECT_TRUE(at >= lo && at < lo + flat.numel() * flat.element_size()) << ".grad left the flat buffer";
  }
  EXPECT_NEAR(flat.sum().item<double>(), 5 * x.sum().item<double>() + 5.0 * 5, 1e-4)  // 3 + 2 rows of x's sums, 5 per bias
      << "the flat buffer holds the step's gradients";

  sync.zero_grad();  // in place: the views again, zeroed
  for (auto& p : net->parameters()) EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
}

}  // namespace

namespace {

// --sync-bn off (what --cuda-graph needs): like PyTorch DDP's
// broadcast_buffers=True, rank 0's BatchNorm statistics reach every rank,
// so after an epoch all ranks hold the same model (evaluation and best.pt
// agree with rank 0).
TEST(GradSync, LocalBatchNormBuffersAreRank0sOnEveryRank) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("local_bn_buffers");
  auto r = ddp::testing::run_process({DDP_TESTWORKER, "--launch", "2", "local_bn_buffers", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  torch::Tensor a, b;
  torch::load(a, dir + "/buffers_rank0.pt");
  torch::load(b, dir + "/buffers_rank1.pt");
  EXPECT_TRUE(torch::equal(a, b)) << "largest difference " << (a - b).abs().max().item<double>();
}

}  // namespace

namespace {

// A step that throws in backward after some buckets were launched (issue 13,
// item 4, the part a CPU shows): after GradSync::abandon_step() the next
// steps are those of a run that never had the failed step, bit for bit, on
// both ranks.
TEST(GradSync, AbandonedStepLeavesNoTrace) {
  DDP_SKIP_UNLESS_GLOO();
  const auto skip = ddp::testing::temp_dir("abandon_skip"), reset = ddp::testing::temp_dir("abandon_reset");
  auto a = run_workers(2, {"abandon", skip, "skip"});
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run_workers(2, {"abandon", reset, "reset"});
  ASSERT_EQ(b.exit_code, 0) << b.output;
  for (int rank = 0; rank < 2; ++rank) {
    const auto want = load(skip + "/params_rank" + std::to_string(rank) + ".pt");
    const auto got = load(reset + "/params_rank" + std::to_string(rank) + ".pt");
    EXPECT_TRUE(torch::equal(got, want)) << "rank " << rank << ": largest difference "
                                         << (got - want).abs().max().item<double>();
  }
}

// The control: without abandon_step() the buckets launched by the failed
// step count as done in the next one, whose early buckets then keep each
// rank's own gradient, halved, and its later ones add the failed step's.
TEST(GradSync, StepAfterAnUnabandonedFailureIsWrong) {
  DDP_SKIP_UNLESS_GLOO();
  const auto skip = ddp::testing::temp_dir("noreset_skip"), kept = ddp::testing::temp_dir("noreset_kept");
  ASSERT_EQ(run_workers(2, {"abandon", skip, "skip"}).exit_code, 0);
  auto r = run_workers(2, {"abandon", kept, "no-reset"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto want = load(skip + "/params_rank0.pt"), got = load(kept + "/params_rank0.pt");
  EXPECT_GT((got - want).abs().max().item<double>(), 1e-4);
}

}  // namespace
