// The GPT's residual add + LayerNorm (src/models/fused_layer_norm.cpp,
// src/cuda/layer_norm.cu): CPU tensors and runs without bf16 autocast keep
// LibTorch's ops; on a GPU the kernels give LibTorch's sum exactly, its
// LayerNorm within bf16 rounding, its gradients within fp32 rounding, and a
// GPT trained with them follows LibTorch's trajectory.
#include "ddp/models/fused_layer_norm.h"

#include "ddp/compat.h"
#include "ddp/models/fused_linear.h"
#include "ddp/models/gpt.h"
#include "ddp/train/lm_task.h"
#include "support/small_gpt.h"
#include "support/testing.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/layer_norm.h"
#endif

namespace ddp::models {
namespace {

using ddp::testing::FusedLayerNormOn;
using ddp::testing::FusedLinearOn;

TEST(FusedLayerNorm, OffByDefaultAndCpuTensorsTakeLibTorchsOps) {
  EXPECT_FALSE(fused_layer_norm_enabled());
  FusedLayerNormOn on;
  torch::manual_seed(3);
  auto x = torch::randn({2, 3, 8}), branch = torch::randn({2, 3, 8}).to(torch::kBFloat16);
  auto w = torch::randn({8}), b = torch::randn({8});
  EXPECT_FALSE(fused_layer_norm_applies(x, branch, w, b));
  auto [sum, out] = add_layer_norm(x, branch, w, b);
  const auto want = x + branch;
  EXPECT_TRUE(torch::equal(sum, want));
  EXPECT_TRUE(torch::equal(out, torch::layer_norm(want, {8}, w, b, 1e-5)));
  auto [same, normed] = add_layer_norm(x, torch::Tensor(), w, torch::Tensor());
  EXPECT_TRUE(torch::equal(same, x));
  EXPECT_TRUE(torch::equal(normed, torch::layer_norm(x, {8}, w, torch::Tensor(), 1e-5)));
}

// The kernels against LibTorch in fp32, forward and backward, for GPT-2's
// width and odd ones, with and without a branch and a bias.
TEST(FusedLayerNorm, MatchesLibTorchForwardAndBackward_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!have_fused_layer_norm()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  const auto f32 = torch::TensorOptions().device(gpu);
  FusedLayerNormOn on;
  // Widths of 128 k columns, k <= 6, take the vectorised kernels (65,536
  // rows of 128: more than the GPU holds warps, whatever the registers, so a
  // warp walks several); other widths, and x 4 bytes off 16-byte alignment
  // ("shifted"), the scalar ones.
  struct Case {
    std::vector<int64_t> shape;
    bool shifted = false;
  };
  for (const auto& [shape, shifted] : std::vector<Case>{{{4, 64, 768}},
                                                        {{16, 256, 768}},
                                                        {{9, 640}},
                                                        {{2, 5, 128}},
                                                        {{64, 1024, 128}},
                                                        {{3, 11, 384}},
                                                        {{3, 1024}},
                                                        {{4, 64, 768}, true},
                                                        {{3, 7, 100}},
                                                        {{5, 33}},
                                                        {{2, 1}}})
    for (bool with_branch : {true, false})
      for (bool with_bias : {true, false}) {
        SCOPED_TRACE(::testing::PrintToString(shape) + (shifted ? " shifted" : "") + " branch=" +
                     std::to_string(with_branch) + " bias=" + std::to_string(with_bias));
        torch::manual_seed(7);
        const int64_t c = shape.back();
        auto x = torch::randn(shape, f32) * 3 + 1;
        if (shifted) {
          auto storage = torch::empty({x.numel() + 1}, f32);
          x = storage.narrow(0, 1, x.numel()).view(shape).copy_(x);
        }
        x.requires_grad_();
        auto branch = with_branch ? torch::randn(shape, f32).to(torch::kBFloat16).requires_grad_() : torch::Tensor();
        auto w = (torch::rand({c}, f32) + 0.5).requires_grad_();
        auto b = with_bias ? torch::randn({c}, f32).requires_grad_() : torch::Tensor();
        // Output gradients that bf16 holds exactly, so both sides see the same.
        const auto g_out = torch::randn(shape, f32).to(torch::kBFloat16).to(torch::kFloat);
        const auto g_sum = torch::randn(shape, f32);

#ifdef DDP_WITH_CUDA_KERNELS
        const bool want_vectorised = c % 128 == 0 && c / 128 <= 6 && !shifted;
        EXPECT_EQ(cuda::add_layer_norm_vectorised(c, {x, branch, w, b}), want_vectorised);
#endif
        torch::Tensor sum, out;
        {
          compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
          ASSERT_TRUE(fused_layer_norm_applies(x, branch, w, b));
          std::tie(sum, out) = add_layer_norm(x, branch, w, b);
        }
        ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
        ((out.to(torch::kFloat) * g_out).sum() + (with_branch ? (sum * g_sum).sum() : torch::zeros({}, f32))).backward();

        auto rx = x.detach().clone().requires_grad_();
        auto rbranch = with_branch ? branch.detach().clone().requires_grad_() : torch::Tensor();
        auto rw = w.detach().clone().requires_grad_();
        auto rb = with_bias ? b.detach().clone().requires_grad_() : torch::Tensor();
        auto rsum = with_branch ? rx + rbranch : rx;
        auto rout = torch::layer_norm(rsum, {c}, rw, rb, 1e-5);
        ((rout * g_out).sum() + (with_branch ? (rsum * g_sum).sum() : torch::zeros({}, f32))).backward();

        EXPECT_TRUE(torch::equal(sum, rsum.detach())) << "x + branch in fp32, exactly";
        // bf16 keeps 8 significant bits: within one unit of the last place.
        const auto bound = rout.detach().abs() * (1.0 / 128) + 1e-6;
        EXPECT_TRUE((out.to(torch::kFloat) - rout.detach()).abs().le(bound).all().item<bool>())
            << (out.to(torch::kFloat) - rout.detach()).abs().max().item<double>();
        auto close = [](const torch::Tensor& got, const torch::Tensor& want, double rel, double floor = 0) {
          const double scale = want.abs().max().item<double>() + floor + 1e-12;
          return (got.to(torch::kFloat) - want).abs().max().item<double>() / scale <= rel;
        };
        // The input gradient is rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w*xhat)):
        // a difference of terms of size rstd * |dy*w|, which cancel to zero
        // when C = 1. Its rounding scales with those terms, not with the result.
        const double terms = (1.0 / torch::sqrt(rsum.detach().var(-1, /*unbiased=*/false) + 1e-5)).max().item<double>() *
                             (g_out.abs().max() * w.detach().abs().max()).item<double>();
        EXPECT_TRUE(close(x.grad(), rx.grad(), 1e-4, terms)) << (x.grad() - rx.grad()).abs().max().item<double>();
        if (with_branch) {
          EXPECT_EQ(branch.grad().scalar_type(), torch::kBFloat16);
          EXPECT_TRUE(close(branch.grad(), rbranch.grad(), 1.0 / 128));
        }
        EXPECT_TRUE(close(w.grad(), rw.grad(), 1e-4));
        if (with_bias) {
          EXPECT_TRUE(close(b.grad(), rb.grad(), 1e-4));
        }
      }
}

// A linear layer's bias left to the residual add (BiasGrad::kInTheAdd, then
// add_layer_norm's branch_bias) gets the gradient it gets from the layer
// (kHere), and nothing else changes: on CPU tensors (LibTorch's ops, the
// bias through a zero autograd differentiates) and, with a GPU, under bf16
// autocast with the kernels (the vectorised LayerNorm backward's sums in
// shared memory, the scalar one's at::sum), with the LayerNorm's output
// unused, and with the sum unused (autograd hands the function zeros for
// its gradient, as for the GPT's last LayerNorm).
TEST(FusedLayerNorm, BranchBiasGetsTheLinearsBiasGradient) {
  struct Case {
    torch::Device device;
    std::vector<int64_t> shape;  // x's: [..., C]
    bool use_out, use_sum;       // which outputs the loss reads
  };
  std::vector<Case> cases{{torch::kCPU, {2, 3, 8}, true, true}, {torch::kCPU, {4, 5, 16}, false, true},
                          {torch::kCPU, {2, 3, 8}, true, false}};
  if (torch::cuda::is_available() && have_fused_layer_norm())
    for (auto shape : std::vector<std::vector<int64_t>>{{4, 64, 768}, {16, 256, 768}, {3, 11, 384}, {3, 7, 96}})
      for (auto [use_out, use_sum] : std::vector<std::pair<bool, bool>>{{true, true}, {false, true}, {true, false}})
        cases.push_back({torch::Device(torch::kCUDA, 0), shape, use_out, use_sum});
  FusedLayerNormOn on;
  FusedLinearOn linear_on;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.device.str() + " " + ::testing::PrintToString(c.shape) + (c.use_out ? "" : " output unused") +
                 (c.use_sum ? "" : " sum unused"));
    const auto f32 = torch::TensorOptions().device(c.device);
    const int64_t width = c.shape.back(), in = 24;
    torch::manual_seed(11);
    auto x0 = torch::randn(c.shape, f32), y0 = torch::randn({c.shape[0], c.shape[1], in}, f32);
    auto w0 = torch::randn({width, in}, f32) * 0.2, b0 = torch::randn({width}, f32);
    auto lw0 = torch::rand({width}, f32) + 0.5, lb0 = torch::randn({width}, f32);
    auto g_out = torch::randn(c.shape, f32).to(torch::kBFloat16).to(torch::kFloat), g_sum = torch::randn(c.shape, f32);
    std::vector<std::vector<torch::Tensor>> grads;
    for (auto mode : {BiasGrad::kHere, BiasGrad::kInTheAdd}) {
      std::vector<torch::Tensor> p;
      for (const auto& t : {x0, y0, w0, b0, lw0, lb0}) p.push_back(t.clone().requires_grad_());
      torch::Tensor sum, out;
      {
        compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, c.device.is_cuda());
        auto branch = linear_bias(p[1], p[2], p[3], mode);
        if (c.device.is_cuda()) EXPECT_TRUE(fused_layer_norm_applies(p[0], branch, p[4], p[5]));
        std::tie(sum, out) =
            add_layer_norm(p[0], branch, p[4], p[5], 1e-5, mode == BiasGrad::kInTheAdd ? p[3] : torch::Tensor());
      }
      if (c.device.is_cuda())  // the kernels' function, not the fallback (which would give the same gradient)
        EXPECT_NE(sum.grad_fn()->name().find("AddLayerNormFn"), std::string::npos) << sum.grad_fn()->name();
      auto loss = torch::zeros({}, f32);
      if (c.use_sum) loss = loss + (sum * g_sum).sum();
      if (c.use_out) loss = loss + (out.to(torch::kFloat) * g_out).sum();
      loss.backward();
      std::vector<torch::Tensor> g;
      for (const auto& t : p) g.push_back(t.grad());
      grads.push_back(g);
    }
    const char* names[] = {"x", "y", "w", "b", "ln weight", "ln bias"};
    for (size_t i = 0; i < grads[0].size(); ++i) {
      SCOPED_TRACE(names[i]);
      ASSERT_EQ(grads[0][i].defined(), grads[1][i].defined());
      if (!grads[0][i].defined()) continue;
      // b: the same bf16 (CPU: fp32) values summed in another order; the
      // rest: the same arithmetic (another kernel variant may contract
      // another multiply-add).
      const double scale = grads[0][i].abs().max().item<double>();
      if (c.use_out || i < 4) EXPECT_GT(scale, 0);  // an unused LayerNorm output gives its weight and bias no gradient or zeros
      EXPECT_LE((grads[1][i] - grads[0][i]).abs().max().item<double>(), (i == 3 ? 1e-5 : 1e-6) * scale);
    }
  }
  EXPECT_THROW(add_layer_norm(torch::randn({2, 8}), torch::Tensor(), torch::ones({8}), torch::Tensor(), 1e-5,
                              torch::zeros({8})),
               c10::Error);  // a branch bias needs a branch
}

// Losses of `steps` bf16 AdamW steps of a small GPT, with the kernels or
// LibTorch's ops. Width 64 takes the scalar kernels, 128 the vectorised ones.
std::vector<double> layer_norm_gpt_losses(bool fused, bool graph, int steps, int64_t width) {
  use_fused_layer_norm(fused);
  auto losses = ddp::testing::small_gpt_bf16_losses(
      GptOptions().n_layer(3).n_head(4).n_embd(width).block_size(32).vocab_size(97), graph, steps);
  use_fused_layer_norm(false);
  return losses;
}

using ddp::testing::max_rel_diff;

// The same model and batches: the first loss differs only by where the
// LayerNorm's output is rounded to bf16 (the same place: the kernel writes
// bf16, LibTorch's matmul casts to it), so it agrees to bf16 tolerance, and
// the trajectories follow each other while the loss falls.
TEST(FusedLayerNorm, GptTrainsAsWithLibTorchsOps_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!have_fused_layer_norm()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  for (int64_t width : {64, 128}) {
    SCOPED_TRACE("n_embd " + std::to_string(width));
    auto fused = layer_norm_gpt_losses(true, false, 12, width);
    auto native = layer_norm_gpt_losses(false, false, 12, width);
    EXPECT_LT(fused.back(), fused.front()) << ::testing::PrintToString(fused);
    EXPECT_NEAR(fused[0], native[0], 1e-3 * native[0]);
    EXPECT_LE(max_rel_diff(fused, native), 2e-2) << ::testing::PrintToString(fused) << " vs "
                                                 << ::testing::PrintToString(native);
  }
}

TEST(FusedLayerNorm, GptGraphedEqualsEager_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!have_fused_layer_norm()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  for (int64_t width : {64, 128}) {
    SCOPED_TRACE("n_embd " + std::to_string(width));
    auto eager = layer_norm_gpt_losses(true, false, 8, width);
    auto graphed = layer_norm_gpt_losses(true, true, 8, width);
    EXPECT_LE(max_rel_diff(graphed, eager), 2e-2) << ::testing::PrintToString(graphed) << " vs "
                                                  << ::testing::PrintToString(eager);
  }
}

}  // namespace
}  // namespace ddp::models
