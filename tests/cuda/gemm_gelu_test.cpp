// cuBLASLt's epilogues (cuda/gemm_gelu.h) against LibTorch's linear, tanh
// GELU and its backward computed in float64 on the same bf16 values.
// Bounds: the results are bf16 (8 bits of mantissa), so an element may be
// off by about one bf16 step of its own size, plus the fp32 summation's
// rounding over K products; 2^-7 relative to the larger of the value and
// the tensor's typical size covers both, and a wrong transpose, bias or
// epilogue is off by far more.
#include <gtest/gtest.h>

#include "support/testing.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "ddp/compat.h"
#include "ddp/cuda/gemm_gelu.h"
#endif

namespace {

#ifdef DDP_WITH_CUDA_KERNELS
// The largest |a - b| over max(|b|, rms(b)), in float64.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kDouble).cpu(), y = b.to(torch::kDouble).cpu();
  const double rms = y.pow(2).mean().sqrt().item<double>();
  return ((x - y).abs() / y.abs().clamp_min(rms)).max().item<double>();
}

torch::Tensor bf16(torch::Tensor t) { return t.to(torch::kCUDA).to(torch::kBFloat16).contiguous(); }

// Shapes: GPT-2's MLP at a few tokens, and sizes that fill no tile evenly.
struct GemmShape {
  int64_t m, k, n;
};
const std::vector<GemmShape> kGemmShapes{{64, 768, 3072}, {37, 96, 128}, {1, 64, 8}};

// Restores the matmuls' tuning as it was.
struct TuningAs {
  explicit TuningAs(bool on) : was(ddp::cuda::gemm_tuning()) { ddp::cuda::set_gemm_tuning(on); }
  ~TuningAs() { ddp::cuda::set_gemm_tuning(was); }
  bool was;
};
#endif

TEST(GemmGelu, ForwardIsLinearThenTanhGelu_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
#ifndef DDP_WITH_CUDA_KERNELS
  GTEST_SKIP() << "built without ddptrain's CUDA kernels";
#else
  ASSERT_TRUE(ddp::cuda::gemm_gelu_available()) << "LibTorch's CUDA library should have loaded cuBLASLt";
  torch::manual_seed(3);
  for (const auto& s : kGemmShapes)
    for (bool offset : {false, true}) {
      // offset: x is rows 1.. of a larger matrix, a view whose address is
      // aligned to 2 k bytes only, not to the 256 a fresh tensor has.
      SCOPED_TRACE("m " + std::to_string(s.m) + " k " + std::to_string(s.k) + " n " + std::to_string(s.n) +
                   (offset ? " x at an offset" : ""));
      auto x = bf16(torch::randn({s.m + 1, s.k})).narrow(0, offset ? 1 : 0, s.m);
      auto w = bf16(torch::randn({s.n, s.k}) * 0.05), b = bf16(torch::randn({s.n}) * 0.5);
      auto r = ddp::cuda::linear_gelu_tanh(x, w, b);
      ASSERT_EQ(r.size(), 2u);
      auto pre = torch::linear(x.to(torch::kDouble), w.to(torch::kDouble), b.to(torch::kDouble));
      auto y = torch::gelu(pre, "tanh");
      EXPECT_LT(relative_error(r[1], pre), 1.0 / 128) << "the pre-activation";
      EXPECT_LT(relative_error(r[0], y), 1.0 / 128) << "the GELU";
      EXPECT_EQ(r[0].sizes(), (std::vector<int64_t>{s.m, s.n}));
      EXPECT_EQ(r[0].scalar_type(), torch::kBFloat16);
    }
#endif
}

// The tanh GELU's backward in the matmul's epilogue (DGELU): (g W) times
// gelu_tanh'(pre), against ATen's gelu_backward in float64.
TEST(GemmGelu, GeluBackwardComesOutOfTheMatmulBeforeIt_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
#ifndef DDP_WITH_CUDA_KERNELS
  GTEST_SKIP() << "built without ddptrain's CUDA kernels";
#else
  torch::manual_seed(6);
  for (const auto& s : kGemmShapes) {
    // The MLP's c_proj backward: g [M, N] (N = the model's width), W [N, K]
    // (K = the MLP's width), pre [M, K].
    SCOPED_TRACE("m " + std::to_string(s.m) + " k " + std::to_string(s.n) + " n " + std::to_string(s.k));
    auto g = bf16(torch::randn({s.m, s.k})), w = bf16(torch::randn({s.k, s.n}) * 0.05);
    auto pre = bf16(torch::randn({s.m, s.n}) * 2);
    auto dh = ddp::cuda::matmul_gelu_tanh_backward(g, w, pre);
    ASSERT_TRUE(dh.defined()) << "cuBLASLt should offer DGELU for bf16";
    EXPECT_EQ(dh.sizes(), pre.sizes());
    EXPECT_EQ(dh.scalar_type(), torch::kBFloat16);
    auto want = at::gelu_backward(g.to(torch::kDouble).mm(w.to(torch::kDouble)), pre.to(torch::kDouble), "tanh");
    EXPECT_LT(relative_error(dh, want), 1.0 / 128);
  }
  auto g = bf16(torch::randn({4, 16})), w = bf16(torch::randn({16, 24}));
  EXPECT_THROW(ddp::cuda::matmul_gelu_tanh_backward(g, w, bf16(torch::randn({4, 16}))), c10::Error) << "pre's shape";
#endif
}

// The plain products (a linear layer's forward with and without its bias,
// and its input gradient) against float64, with the algorithm tuned and
// with cuBLASLt's first choice, on fresh tensors and on views at an offset.
TEST(GemmGelu, LinearAndMatmulAreLibTorchsProducts_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
#ifndef DDP_WITH_CUDA_KERNELS
  GTEST_SKIP() << "built without ddptrain's CUDA kernels";
#else
  torch::manual_seed(4);
  for (bool tuned : {true, false}) {
    TuningAs tuning(tuned);
    for (const auto& s : kGemmShapes)
      for (bool offset : {false, true}) {
        SCOPED_TRACE("m " + std::to_string(s.m) + " k " + std::to_string(s.k) + " n " + std::to_string(s.n) +
                     (offset ? " at an offset" : "") + (tuned ? ", tuned" : ", first choice"));
        auto x = bf16(torch::randn({s.m + 1, s.k})).narrow(0, offset ? 1 : 0, s.m);
        auto w = bf16(torch::randn({s.n, s.k}) * 0.05), b = bf16(torch::randn({s.n}) * 0.5);
        auto xd = x.to(torch::kDouble), wd = w.to(torch::kDouble);
        for (bool with_bias : {true, false}) {
          auto y = ddp::cuda::linear(x, w, with_bias ? b : torch::Tensor());
          ASSERT_TRUE(y.defined()) << (with_bias ? "with" : "without") << " a bias";
          EXPECT_EQ(y.sizes(), (std::vector<int64_t>{s.m, s.n}));
          EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
          auto want = with_bias ? torch::linear(xd, wd, b.to(torch::kDouble)) : torch::linear(xd, wd);
          EXPECT_LT(relative_error(y, want), 1.0 / 128) << (with_bias ? "with" : "without") << " a bias";
        }
        auto g = bf16(torch::randn({s.m + 1, s.n})).narrow(0, offset ? 1 : 0, s.m);
        auto dx = ddp::cuda::matmul(g, w);
        ASSERT_TRUE(dx.defined());
        EXPECT_EQ(dx.sizes(), (std::vector<int64_t>{s.m, s.k}));
        EXPECT_LT(relative_error(dx, g.to(torch::kDouble).mm(wd)), 1.0 / 128);
        auto dw = torch::empty({s.n, s.k}, x.options().dtype(torch::kFloat));
        ddp::cuda::weight_grad(g, x, dw);
        EXPECT_LT(relative_error(dw, g.to(torch::kDouble).t().mm(xd)), 1.0 / 128);
      }
  }
  // What cuBLASLt cannot take here is left to LibTorch: undefined.
  auto x = bf16(torch::randn({4, 16})), w12 = bf16(torch::randn({12, 16}));
  EXPECT_FALSE(ddp::cuda::linear(x, w12, torch::Tensor()).defined()) << "12 features";
  EXPECT_FALSE(ddp::cuda::matmul(bf16(torch::randn({4, 16})), bf16(torch::randn({16, 12}))).defined()) << "12 columns";
  auto w = bf16(torch::randn({16, 16}));
  EXPECT_FALSE(ddp::cuda::linear(x, w, bf16(torch::randn({17})).narrow(0, 1, 16)).defined()) << "a misaligned bias";
  EXPECT_THROW(ddp::cuda::linear(x, bf16(torch::randn({16, 8})), torch::Tensor()), c10::Error) << "K differs";
#endif
}

// Tuning: the first eager call of a kind of matmul times cuBLASLt's
// candidates and keeps one; later calls of that kind reuse it, so they give
// the first call's bits. Inside a CUDA graph's capture nothing is timed or
// kept (the first choice runs), and the next eager call tunes.
TEST(GemmGelu, TunedChoiceIsKeptForLaterCalls_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
#ifndef DDP_WITH_CUDA_KERNELS
  GTEST_SKIP() << "built without ddptrain's CUDA kernels";
#else
  TuningAs tuning(true);
  torch::manual_seed(5);
  // Shapes no other test uses, so that this test sees their first call; new
  // rows on each pass (--gtest_repeat), as the choices live for the process.
  static int64_t pass = 0;
  const int64_t m = 1000 + 8 * pass++;
  auto x = bf16(torch::randn({m, 264})), w = bf16(torch::randn({520, 264}) * 0.05), b = bf16(torch::randn({520}));
  const size_t before = ddp::cuda::gemm_tuned_kinds();
  auto first = ddp::cuda::linear(x, w, b);
  EXPECT_EQ(ddp::cuda::gemm_tuned_kinds(), before + 1) << "one new kind, tuned and kept";
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(ddp::cuda::linear(x, w, b), first)) << "call " << i;
  EXPECT_EQ(ddp::cuda::gemm_tuned_kinds(), before + 1) << "no second tuning of a known kind";
  // The same kind with x 16 bytes past a 256-byte boundary (a slice of a
  // flat buffer) keeps the choice where its kernel needs no more than 16
  // bytes (expected: Hopper's TMA loads need 16; this checks it): not
  // tuned again, the same bits.
  auto storage = bf16(torch::zeros({m * 264 + 8}));
  auto x_off = storage.narrow(0, 8, m * 264).view({m, 264});
  x_off.copy_(x);
  EXPECT_TRUE(torch::equal(ddp::cuda::linear(x_off, w, b), first)) << "the choice made at 256-byte alignment";
  EXPECT_EQ(ddp::cuda::gemm_tuned_kinds(), before + 1) << "the first choice kept, not tuned again";
  auto g = bf16(torch::randn({m, 520}));
  torch::Tensor captured;
  {
    const c10::cuda::CUDAStreamGuard side(at::cuda::getStreamFromPool());
    at::cuda::CUDAGraph graph;
    ddp::compat::begin_capture(graph);
    captured = ddp::cuda::matmul(g, w);
    graph.capture_end();
    graph.replay();
    at::cuda::getCurrentCUDAStream().synchronize();
  }
  EXPECT_EQ(ddp::cuda::gemm_tuned_kinds(), before + 1) << "nothing timed or kept while capturing";
  EXPECT_LT(relative_error(captured, g.to(torch::kDouble).mm(w.to(torch::kDouble))), 1.0 / 128);
  auto eager = ddp::cuda::matmul(g, w);
  EXPECT_EQ(ddp::cuda::gemm_tuned_kinds(), before + 2) << "the captured kind tuned by its first eager call";
  EXPECT_TRUE(torch::equal(ddp::cuda::matmul(g, w), eager));
#endif
}

// Wrong shapes and dtypes are refused with what was passed.
TEST(GemmGelu, RefusesWhatItCannotTake_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
#ifndef DDP_WITH_CUDA_KERNELS
  GTEST_SKIP() << "built without ddptrain's CUDA kernels";
#else
  auto x = bf16(torch::randn({4, 16})), w = bf16(torch::randn({12, 16})), b = bf16(torch::randn({12}));
  EXPECT_THROW(ddp::cuda::linear_gelu_tanh(x, w, b), c10::Error);  // 12 features: not a multiple of 8
  EXPECT_THROW(ddp::cuda::linear_gelu_tanh(x.to(torch::kFloat), bf16(torch::randn({16, 16})), bf16(torch::randn({16}))),
               c10::Error);
  auto w16 = bf16(torch::randn({16, 16}));
  EXPECT_NO_THROW(ddp::cuda::linear_gelu_tanh(x, w16, bf16(torch::randn({16}))));
  EXPECT_THROW(ddp::cuda::linear_gelu_tanh(x, w16, bf16(torch::randn({17})).narrow(0, 1, 16)),
               c10::Error);  // a bias 2 bytes off alignment
#endif
}

}  // namespace
