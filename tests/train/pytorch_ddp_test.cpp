// A whole ddptrain run against PyTorch's own DistributedDataParallel, to
// the bit: 2 Gloo ranks train the cnn on 1200 Fashion-MNIST images for 2
// epochs with clip_grad_norm_ (every step is clipped) and label smoothing,
// from the same initial weights, and must end with the same weights and
// BatchNorm buffers. tests/testdata/ddp_clip_ls/ holds what PyTorch 1.13
// wrote (tools/gen_pytorch_ddp_testdata.py says how and what).
//
// Issue 44 item 9 asked for clipping that matches clip_grad_norm_, tested
// against values PyTorch writes. Clipping did match; what differed was the
// label-smoothed loss, written as eps * mean(mean(-logp)), which rounds
// otherwise than F.cross_entropy's on batches of other sizes than 2^k (the
// epoch's last batch of 24 here): the gradients differed in the last bits,
// and these weights by up to 1.8e-7 after 2 epochs (1e-3 in the loss on the
// full data set). loss.cpp now calls F::cross_entropy.
//
// To the bit needs the same thread count as the reference's (1 a rank):
// ATen's reductions split work by thread, and ddptrain gives each rank
// cores / ranks threads. On a machine of more than 3 cores the test checks
// the weights to 1e-5 (other thread counts move them by about 1e-6) and
// then skips the bitwise check, saying why.
#include <algorithm>
#include <map>
#include <thread>

#include "ddp/io/torch_pickle.h"
#include "support/testing.h"

namespace {

constexpr const char* kPyTorchDdpData = DDP_TEST_DATA_DIR "/ddp_clip_ls";

// ddptrain's intra-op threads per rank for `ranks` ranks on this machine (src/app.cpp).
int ddptrain_threads_per_rank(int ranks) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / ranks);
}

std::map<std::string, torch::Tensor> pytorch_ddp_tensors(const std::string& path) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : ddp::read_state_dict(path)) out[name] = t;
  return out;
}

TEST(PyTorchDdp, ClippedLabelSmoothedTrainingEqualsPyTorchToTheBit) {
  DDP_SKIP_UNLESS_GLOO();
  const auto root = ddp::testing::fashion_mnist_root();
  if (root.empty()) GTEST_SKIP() << "needs Fashion-MNIST (the reference trained on its first 1200 images)";
  const auto dir = ddp::testing::temp_dir("pytorch_ddp");
  const std::string init = std::string(kPyTorchDdpData) + "/init.pt";
  // The generator's settings, flag for flag; what is not PyTorch's default
  // DDP (sync-bn, channels-last, augmentation, a sanity pass) is off.
  auto run = ddp::testing::run_process(
      {DDPTRAIN_EXE, "--size", "2", "--backend", "gloo", "--model", "cnn", "--dataset", "fashion-mnist",
       "--data_root", root, "--pretrain", init, "--train-samples", "1200", "--test-samples", "64", "--epochs", "2",
       "--batch", "64", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0", "--weight-decay", "0",
       "--schedule", "constant", "--label-smoothing", "0.1", "--clip-grad-norm", "0.5", "--sync-bn", "off",
       "--channels-last", "off", "--augment", "none", "--workers", "0", "--sanity-val-steps", "0", "--seed", "0",
       "--timeout", "120", "--progress", "plain", "--save_path", dir},
      {}, 300);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto checkpoint = ddp::testing::find_file(dir, "epoch_2.pt");
  ASSERT_FALSE(checkpoint.empty()) << run.output;
  auto exported = ddp::testing::run_process({DDPTRAIN_EXE, "export", checkpoint, dir + "/weights.pt"});
  ASSERT_EQ(exported.exit_code, 0) << exported.output;

  const auto want = pytorch_ddp_tensors(std::string(kPyTorchDdpData) + "/final.pt");
  const auto got = pytorch_ddp_tensors(dir + "/weights.pt");
  ASSERT_EQ(want.size(), 16u);  // 4 layers' weights and biases, 2 BatchNorms' affine and buffers
  EXPECT_EQ(got.size(), want.size());
  const int threads = ddptrain_threads_per_rank(2);
  for (const auto& [name, expected] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << name << " is missing from ddptrain's weights";
      continue;
    }
    const auto& mine = it->second;
    ASSERT_EQ(mine.sizes().vec(), expected.sizes().vec()) << name;
    ASSERT_EQ(mine.scalar_type(), expected.scalar_type()) << name;
    const double diff = (mine.to(torch::kDouble) - expected.to(torch::kDouble)).abs().max().item<double>();
    if (threads == 1) EXPECT_TRUE(torch::equal(mine, expected)) << name << ": max abs diff " << diff;
    else EXPECT_LE(diff, 1e-5) << name << " (" << threads << " threads a rank)";
  }
  if (threads != 1 && !HasFailure())
    GTEST_SKIP() << "bitwise check skipped: ddptrain runs " << threads
                 << " threads a rank here, the reference 1 (the weights matched to 1e-5)";
}

}  // namespace
