// Parameters that get no gradient in a step are left alone, as PyTorch does
// (their .grad is None, so torch.optim skips them): checked against values
// that PyTorch itself produced (tools/gen_unused_params_testdata.py ->
// tests/testdata/unused_params.json), on one rank and on two ranks with
// DistributedDataParallel(find_unused_parameters=True), where on some steps
// the branch is used on one rank only (and is stepped) and on one step on
// neither (and is skipped).
#include <nlohmann/json.hpp>

#include "support/testing.h"

namespace {

struct UnusedCase {
  std::string optimizer;
  int world_size;
};

void PrintTo(const UnusedCase& c, std::ostream* os) { *os << c.optimizer << " on " << c.world_size << " rank(s)"; }

class UnusedParameters : public ::testing::TestWithParam<UnusedCase> {};

// Runs the reference scenario on `world_size` ranks and compares every
// rank's final parameters with PyTorch's, to `tolerance`; returns rank 0's.
// `variant`: "recompute" runs parts of the model under ddp::recompute,
// "shard" shards the optimizer state over the ranks.
torch::Tensor expect_pytorch(const std::string& optimizer, int world_size, bool cuda, double tolerance,
                             const std::string& variant = "") {
  const std::string json = DDP_TEST_DATA_DIR "/unused_params.json";
  const auto dir = ddp::testing::temp_dir("unused_ref_" + optimizer + std::to_string(world_size) + variant);
  std::map<std::string, std::string> env;
  if (cuda) env["DDP_TEST_CUDA"] = "1";
  std::vector<std::string> args{DDP_TESTWORKER, "--launch", std::to_string(world_size), "unused_reference", dir, json, optimizer};
  if (!variant.empty()) args.push_back(variant);
  auto r = ddp::testing::run_process(args, env, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return torch::Tensor();
  const auto data = nlohmann::json::parse(ddp::testing::read_file(json));
  const auto& expected = data["world" + std::to_string(world_size)][optimizer];
  const auto& initial = data["initial"];
  torch::Tensor first;
  for (int rank = 0; rank < world_size; ++rank) {
    torch::Tensor got;
    torch::load(got, dir + "/params_rank" + std::to_string(rank) + ".pt");
    if (rank == 0) first = got;
    else EXPECT_TRUE(torch::equal(got, first)) << "ranks must end bit-identical";
    int64_t at = 0;
    for (const char* name : {"fc0.weight", "fc0.bias", "head.weight", "head.bias", "branch.weight", "branch.bias",
                             "late.weight", "late.bias"}) {
      const auto want = torch::tensor(expected[name].get<std::vector<double>>(), torch::kDouble);
      const auto start = torch::tensor(initial[name].get<std::vector<double>>(), torch::kDouble);
      const auto mine = got.narrow(0, at, want.numel());
      at += want.numel();
      const double diff = (mine - want).abs().max().item<double>();
      EXPECT_LE(diff, tolerance) << optimizer << ", " << name << " on rank " << rank << ": max abs diff " << diff;
      // Every layer is used at some point, so all must have moved.
      EXPECT_GT((want - start).abs().max().item<double>(), 1e-3) << name;
    }
    EXPECT_EQ(at, got.numel());
  }
  return first;
}

TEST_P(UnusedParameters, MatchPyTorch) {
  DDP_SKIP_UNLESS_GLOO();
  expect_pytorch(GetParam().optimizer, GetParam().world_size, /*cuda=*/false, 1e-5);
}

// Under ddp::recompute (the trunk and both optional branches), the branch
// used on one rank only on some steps and on neither on one: PyTorch's
// values still, and the run without recompute's bit for bit (the buckets'
// hooks fire from the recomputed backward, and expect_gradients_from sees
// the parameters through the recompute nodes).
TEST(UnusedParameters, RecomputeEqualsPlainBitForBit) {
  DDP_SKIP_UNLESS_GLOO();
  for (int world_size : {1, 2}) {
    const auto plain = expect_pytorch("adamw", world_size, /*cuda=*/false, 1e-5);
    const auto again = expect_pytorch("adamw", world_size, /*cuda=*/false, 1e-5, "recompute");
    ASSERT_TRUE(plain.defined() && again.defined());
    EXPECT_TRUE(torch::equal(plain, again)) << world_size << " rank(s): max diff "
                                            << (plain - again).abs().max().item<double>();
  }
}

// ZeRO-1 (--shard-optimizer) on 2 ranks: parameters that no rank or one
// rank used, fixed up on each rank's part of the flat buffers (their slices
// cut by the parts' edges): PyTorch's values, and the unsharded run's bits.
TEST(UnusedParameters, ShardedOptimizerEqualsUnshardedBitForBit) {
  DDP_SKIP_UNLESS_GLOO();
  for (const std::string name : {"sgd", "adam", "adamw"}) {
    const auto plain = expect_pytorch(name, 2, /*cuda=*/false, 1e-5);
    const auto sharded = expect_pytorch(name, 2, /*cuda=*/false, 1e-5, "shard");
    ASSERT_TRUE(plain.defined() && sharded.defined());
    EXPECT_TRUE(torch::equal(plain, sharded)) << name << ": max diff " << (plain - sharded).abs().max().item<double>();
  }
}

// The gradients reduce-scattered (on Gloo: one reduce per rank's part),
// and ZeRO-2 (each rank keeping only its part of the gradients), each rank
// stepping from its part only: still PyTorch's values and the unsharded
// run's bits (a sum of 2 is the same in any order).
TEST(UnusedParameters, ShardedGradientsEqualUnshardedBitForBit) {
  DDP_SKIP_UNLESS_GLOO();
  for (const std::string name : {"sgd", "adam", "adamw"}) {
    const auto plain = expect_pytorch(name, 2, /*cuda=*/false, 1e-5);
    for (const std::string variant : {"shard-rs", "shard-grads"}) {
      const auto sharded = expect_pytorch(name, 2, /*cuda=*/false, 1e-5, variant);
      ASSERT_TRUE(plain.defined() && sharded.defined());
      EXPECT_TRUE(torch::equal(plain, sharded))
          << name << ", " << variant << ": max diff " << (plain - sharded).abs().max().item<double>();
    }
  }
}

// The same on 2 GPUs over NCCL (the fused kernels on each rank's part;
// "shard" takes NCCL's reduce_scatter there, LibTorch 2.3+).
TEST(UnusedParameters, ShardedOptimizerOnTwoGpus_MultiCUDA) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  for (const std::string name : {"sgd", "adam", "adamw"}) {
    const auto plain = expect_pytorch(name, 2, /*cuda=*/true, 5e-5);
    for (const std::string variant : {"shard", "shard-grads"}) {
      const auto sharded = expect_pytorch(name, 2, /*cuda=*/true, 5e-5, variant);
      ASSERT_TRUE(plain.defined() && sharded.defined());
      EXPECT_TRUE(torch::equal(plain, sharded)) << name << ", " << variant;
    }
  }
}

// The fused kernels' path (saved slices, a select on the device), on one
// GPU; the fused arithmetic differs from torch.optim's in the last bits.
TEST(UnusedParameters, MatchPyTorchOnOneGpu_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  for (const std::string name : {"sgd", "adam", "adamw"}) expect_pytorch(name, 1, /*cuda=*/true, 5e-5);
}

// The ranks' flags over NCCL, with the branch used on one rank only on
// some steps and on neither on one.
TEST(UnusedParameters, MatchPyTorchDdpOnTwoGpus_MultiCUDA) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  for (const std::string name : {"sgd", "adam", "adamw"}) expect_pytorch(name, 2, /*cuda=*/true, 5e-5);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, UnusedParameters,
                         ::testing::Values(UnusedCase{"sgd", 1}, UnusedCase{"adam", 1}, UnusedCase{"adamw", 1}, UnusedCase{"sgd", 2},
                                           UnusedCase{"adam", 2}, UnusedCase{"adamw", 2}),
                         [](const auto& info) {
                           return info.param.optimizer + "_world" + std::to_string(info.param.world_size);
                         });

}  // namespace
