// ddptrain's fused cross-entropy kernels against LibTorch's cross_entropy
// computed in float64 on the same logits values, forward and backward.
#include "ddp/train/fused_cross_entropy.h"
#include "ddp/train/lm_task.h"
#include "support/testing.h"

#include <cmath>

namespace {

namespace F = torch::nn::functional;

#define SKIP_UNLESS_KERNELS()                                                                          \
  do {                                                                                                 \
    DDP_SKIP_UNLESS_CUDA();                                                                            \
    if (!ddp::have_fused_cross_entropy()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";     \
  } while (0)

// GPT-2's row (V = 50304, a multiple of 8), a V whose rows start off a
// 16-byte boundary (1000 bf16 = 2000 bytes), rows shorter than one vector
// (7, 1), one row and a row count that fills no block evenly.
struct Shape {
  int64_t n, v;
};
const std::vector<Shape> kShapes{{48, 50304}, {1, 50304}, {333, 1000}, {1, 1000}, {333, 7}, {1, 7}, {5, 1}};

// Every 10th target ignored (-100), the rest drawn over the vocabulary.
torch::Tensor make_targets(int64_t n, int64_t v, const torch::Device& dev) {
  auto t = torch::randint(0, v, {n}, torch::kLong);
  for (int64_t i = 3; i < n; i += 10) t[i] = -100;
  return t.to(dev);
}

// Logits with a spread like a language model's (std 3, a few large ones).
torch::Tensor make_logits(int64_t n, int64_t v, torch::ScalarType dtype, const torch::Device& dev) {
  auto x = torch::randn({n, v}, dev) * 3;
  x.index_put_({torch::indexing::Slice(), 0}, 12.0);
  return x.to(dtype);
}

struct Reference {
  double loss;
  torch::Tensor grad;  // float64
};

// LibTorch's cross_entropy in float64 on the logits' values; backward with
// an incoming gradient `g` (what a loss scale makes of 1).
Reference reference(const torch::Tensor& logits, const torch::Tensor& targets, bool sum, double g) {
  auto x = logits.to(torch::kDouble).detach().requires_grad_();
  auto o = F::CrossEntropyFuncOptions();
  if (sum) o.reduction(torch::kSum);
  auto loss = F::cross_entropy(x, targets, o);
  loss.backward(torch::full({}, g, loss.options()));
  return {loss.item<double>(), x.grad()};
}

// Half the spacing of `dtype` at 1 (the relative error of rounding to it),
// and its smallest step near 0 (fp16's subnormals: a 1e-5 probability times
// a mean's 1/300 is below fp16's smallest normal).
double half_ulp(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? std::ldexp(1.0, -8) : dtype == torch::kHalf ? std::ldexp(1.0, -11) : 0.0;
}
double tiny_step(torch::ScalarType dtype) { return dtype == torch::kHalf ? std::ldexp(1.0, -24) : 0.0; }

// Checks the gradient elementwise. The kernel computes each element in fp32
// (exp(x - lse) with lse good to ~1e-6) and rounds once to the dtype, as
// LibTorch's autocast path rounds its fp32 gradient once. So each element
// lies within half a unit in the last place of the exact value (the
// rounding) plus 1e-5 of it (the fp32 arithmetic, which can also tip a
// value at a rounding midpoint to the other neighbour) plus 1e-5 of the
// largest possible magnitude |scale| (where p - 1 cancels at the target),
// plus, for fp16, one subnormal step. For bf16 that is one bf16 ulp.
// `roundings` is 2 where the one-pass path rounds the gradient for an
// incoming 1 and then again after scaling it.
void expect_grad_near(const torch::Tensor& got, const torch::Tensor& ref, torch::ScalarType dtype, double scale,
                      int roundings = 1) {
  auto g = got.to(torch::kCPU).to(torch::kDouble), r = ref.to(torch::kCPU);
  auto err = (g - r).abs();
  auto tol = r.abs() * (roundings * half_ulp(dtype) + 1e-5) + (1e-5 * std::abs(scale) + tiny_step(dtype));
  const auto bad = (err > tol).sum().item<int64_t>();
  EXPECT_EQ(bad, 0) << bad << " of " << g.numel() << " gradient elements off; worst error/tolerance "
                    << (err / tol).max().item<double>();
}

void expect_loss_near(double got, double ref) {
  EXPECT_LE(std::abs(got - ref), 1e-5 * std::max(1.0, std::abs(ref))) << got << " vs " << ref;
}

int64_t kept(const torch::Tensor& targets) { return (targets != -100).sum().item<int64_t>(); }

// Through fused_cross_entropy (the autograd function), every dtype,
// reduction and shape, with and without the in-place backward, for an
// incoming gradient of 1 (nothing scales the loss) and of 0.75. The logits
// are a non-leaf (x * 1, as a model's output), so that the gradient reaching
// the leaf is a copy of what the loss wrote: and with overwrite_logits, the
// logits' memory must hold that gradient afterwards. In place, bf16 and fp32
// take the one-pass path (every row here fits in shared memory), fp16 the
// two-pass one.
TEST(FusedCrossEntropy, MatchesFloat64LibTorch_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(5);
  for (const auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat})
    for (const auto& s : kShapes) {
      auto logits = make_logits(s.n, s.v, dtype, gpu);
      auto targets = make_targets(s.n, s.v, gpu);
      for (const bool sum : {false, true})
        for (const bool in_place : {false, true})
          for (const double g : {1.0, 0.75}) {
            SCOPED_TRACE(c10::str(dtype, " N=", s.n, " V=", s.v, sum ? " sum" : " mean", in_place ? " in place" : "",
                                  " g=", g));
            const auto ref = reference(logits, targets, sum, g);
            auto leaf = logits.clone().requires_grad_();
            auto x = leaf * 1;
            ASSERT_TRUE(ddp::fused_cross_entropy_applies(x, targets));
            const bool one_pass = ddp::fused_cross_entropy_takes_one_pass(x, targets, in_place);
            EXPECT_EQ(one_pass, in_place && dtype != torch::kHalf);
            auto loss = ddp::fused_cross_entropy(x, targets, sum, in_place);
            EXPECT_EQ(loss.scalar_type(), torch::kFloat);
            EXPECT_EQ(loss.dim(), 0);
            loss.backward(torch::full({}, g, loss.options()));
            expect_loss_near(loss.item<double>(), ref.loss);
            ASSERT_TRUE(leaf.grad().defined());
            EXPECT_EQ(leaf.grad().scalar_type(), dtype);
            const double scale = sum ? g : g / static_cast<double>(kept(targets));
            expect_grad_near(leaf.grad(), ref.grad, dtype, scale, one_pass && g != 1.0 ? 2 : 1);
            // Ignored rows get exactly 0.
            auto ignored = (targets == -100).nonzero().squeeze(1);
            if (ignored.numel() > 0) {
              EXPECT_EQ(leaf.grad().index_select(0, ignored).abs().max().item<double>(), 0.0);
            }
            if (in_place) {
              EXPECT_TRUE(torch::equal(x.detach(), leaf.grad())) << "the logits do not hold the gradient";
            } else {
              EXPECT_TRUE(torch::equal(x.detach(), logits)) << "the logits changed";
            }
          }
    }
}

// The loss and gradient of one pass against the two-pass kernels, to the
// bit: the same row sums in the same order, and the same fp32 arithmetic
// rounded once, for an incoming gradient of 1 and of a power of 2 (an exact
// scale, so rounding before or after it gives the same bits). Rows of every
// alignment (V = 7 bf16 rows start every 14 bytes) and GPT-2's row.
TEST(FusedCrossEntropy, OnePassEqualsTwoPassToTheBit_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(11);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat})
    for (const auto& s : kShapes) {
      auto logits = make_logits(s.n, s.v, dtype, gpu);
      auto targets = make_targets(s.n, s.v, gpu);
      for (const bool sum : {false, true})
        for (const double g : {1.0, 0.5}) {
          SCOPED_TRACE(c10::str(dtype, " N=", s.n, " V=", s.v, sum ? " sum" : " mean", " g=", g));
          auto run = [&](bool one_pass) {
            ddp::use_one_pass_cross_entropy(one_pass);
            auto leaf = logits.clone().requires_grad_();
            auto x = leaf * 1;
            EXPECT_EQ(ddp::fused_cross_entropy_takes_one_pass(x, targets, true), one_pass);
            auto loss = ddp::fused_cross_entropy(x, targets, sum, true);
            loss.backward(torch::full({}, g, loss.options()));
            ddp::use_one_pass_cross_entropy(true);
            return std::make_pair(loss.detach(), leaf.grad());
          };
          const auto [loss1, grad1] = run(true);
          const auto [loss2, grad2] = run(false);
          EXPECT_TRUE(torch::equal(loss1, loss2)) << loss1.item<double>() << " vs " << loss2.item<double>();
          EXPECT_TRUE(torch::equal(grad1, grad2))
              << (grad1 != grad2).sum().item<int64_t>() << " of " << grad1.numel() << " gradient elements differ";
        }
    }
}

// The one-pass path stays out where it must: a row too long for shared
// memory (400,000 bytes of bf16), fp16, logits that need no gradient (an
// evaluation) and a caller that keeps its logits; each still gives the loss.
TEST(FusedCrossEntropy, OnePassOnlyWhereItApplies_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(12);
  auto check = [&](const torch::Tensor& logits, const torch::Tensor& targets, bool requires_grad, bool overwrite) {
    auto leaf = logits.clone().requires_grad_(requires_grad);
    auto x = leaf * 1;
    EXPECT_FALSE(ddp::fused_cross_entropy_takes_one_pass(x, targets, overwrite));
    auto loss = ddp::fused_cross_entropy(x, targets, false, overwrite);
    const auto ref = reference(logits, targets, false, 1.0);
    expect_loss_near(loss.item<double>(), ref.loss);
    if (requires_grad) {
      loss.backward();
      expect_grad_near(leaf.grad(), ref.grad, logits.scalar_type(), 1.0 / static_cast<double>(kept(targets)));
    } else {
      EXPECT_TRUE(torch::equal(x, logits)) << "logits that need no gradient were overwritten";
    }
  };
  {
    SCOPED_TRACE("V = 200,000 bf16");
    check(make_logits(3, 200000, torch::kBFloat16, gpu), make_targets(3, 200000, gpu), true, true);
  }
  {
    SCOPED_TRACE("fp16");
    check(make_logits(16, 1000, torch::kHalf, gpu), make_targets(16, 1000, gpu), true, true);
  }
  {
    SCOPED_TRACE("no gradient wanted");
    check(make_logits(16, 1000, torch::kBFloat16, gpu), make_targets(16, 1000, gpu), false, true);
  }
  {
    SCOPED_TRACE("logits kept");
    check(make_logits(16, 1000, torch::kBFloat16, gpu), make_targets(16, 1000, gpu), true, false);
  }
}

// Logits that start 2 bytes past a 16-byte boundary: every row has an
// unaligned head, and out of place the output (freshly allocated, aligned)
// is aligned differently from the input.
TEST(FusedCrossEntropy, UnalignedLogits_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(6);
  for (const int64_t v : {int64_t{50304}, int64_t{1000}, int64_t{7}}) {
    const int64_t n = 37;
    auto storage = make_logits(1, n * v + 1, torch::kBFloat16, gpu).reshape({-1});
    auto targets = make_targets(n, v, gpu);
    const auto ref = reference(storage.narrow(0, 1, n * v).view({n, v}), targets, false, 1.0);
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE(c10::str("V=", v, in_place ? " in place" : ""));
      auto leaf = storage.clone().requires_grad_();
      auto x = leaf.narrow(0, 1, n * v).view({n, v});  // a non-leaf view, 2 bytes off alignment
      ASSERT_NE(reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16, 0u);
      auto loss = ddp::fused_cross_entropy(x, targets, false, in_place);
      loss.backward();
      expect_loss_near(loss.item<double>(), ref.loss);
      auto grad = leaf.grad().narrow(0, 1, n * v).view({n, v});
      expect_grad_near(grad, ref.grad, torch::kBFloat16, 1.0 / static_cast<double>(kept(targets)));
      EXPECT_EQ(leaf.grad()[0].item<double>(), 0.0);
    }
  }
}

// Every target ignored: the mean is 0/0 = NaN and the sum 0, as LibTorch's;
// the gradient is 0.
TEST(FusedCrossEntropy, AllTargetsIgnored_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  auto logits = make_logits(4, 100, torch::kBFloat16, gpu);
  auto targets = torch::full({4}, -100, torch::TensorOptions().dtype(torch::kLong).device(gpu));
  for (const bool sum : {false, true}) {
    auto leaf = logits.clone().requires_grad_();
    auto loss = ddp::fused_cross_entropy(leaf * 1, targets, sum, true);
    loss.backward();
    auto o = F::CrossEntropyFuncOptions();
    if (sum) o.reduction(torch::kSum);
    const double ref = F::cross_entropy(logits.to(torch::kFloat), targets, o).item<double>();
    if (sum) {
      EXPECT_EQ(loss.item<double>(), 0.0);
      EXPECT_EQ(ref, 0.0);
    } else {
      EXPECT_TRUE(std::isnan(loss.item<double>()));
      EXPECT_TRUE(std::isnan(ref));
    }
    EXPECT_EQ(leaf.grad().abs().max().item<double>(), 0.0);
  }
}

// The same loss twice gives the same bits (no atomics in the reduction).
TEST(FusedCrossEntropy, Deterministic_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(8);
  auto logits = make_logits(2048, 50304, torch::kBFloat16, gpu);
  auto targets = make_targets(2048, 50304, gpu);
  const auto a = ddp::fused_cross_entropy(logits, targets).item<float>();
  const auto b = ddp::fused_cross_entropy(logits, targets).item<float>();
  EXPECT_EQ(a, b);
}

// After the gradient has gone over the logits a second backward would read
// it as logits: refused. Out of place, backward may run twice.
TEST(FusedCrossEntropy, SecondBackwardAfterOverwriteIsRefused_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  auto logits = make_logits(8, 64, torch::kBFloat16, gpu);
  auto targets = make_targets(8, 64, gpu);
  {
    auto leaf = logits.clone().requires_grad_();
    auto loss = ddp::fused_cross_entropy(leaf * 1, targets, false, /*overwrite_logits=*/true);
    loss.backward({}, /*retain_graph=*/true);
    EXPECT_ANY_THROW(loss.backward());
  }
  {
    auto leaf = logits.clone().requires_grad_();
    auto loss = ddp::fused_cross_entropy(leaf * 1, targets, false, /*overwrite_logits=*/false);
    loss.backward({}, /*retain_graph=*/true);
    auto once = leaf.grad().clone();
    loss.backward();
    EXPECT_TRUE(torch::equal(leaf.grad(), once * 2));
  }
}

// next_token_loss takes the kernels for B x T x V CUDA logits, and
// LibTorch's path when they are turned off (--ce-kernel native): the same
// loss either way (fp32 logits: LibTorch's cross_entropy on bf16 logits
// outside autocast rounds its log-probabilities to bf16). Non-contiguous logits are not the kernels'.
TEST(FusedCrossEntropy, NextTokenLossPicksThePath_CUDA) {
  SKIP_UNLESS_KERNELS();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(9);
  auto logits = make_logits(4 * 16, 1000, torch::kFloat, gpu).view({4, 16, 1000});
  auto targets = torch::randint(0, 1000, {4, 16}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
  const double fused = ddp::next_token_loss(logits, targets).item<double>();
  ddp::use_fused_cross_entropy(false);
  const double native = ddp::next_token_loss(logits, targets).item<double>();
  ddp::use_fused_cross_entropy(true);
  EXPECT_NEAR(fused, native, 1e-5 * native);
  EXPECT_TRUE(ddp::fused_cross_entropy_applies(logits.view({-1, 1000}), targets.view({-1})));
  EXPECT_FALSE(ddp::fused_cross_entropy_applies(logits.view({-1, 1000}).t(), targets.view({-1})));
  EXPECT_FALSE(ddp::fused_cross_entropy_applies(logits.view({-1, 1000}).cpu(), targets.view({-1}).cpu()));
}

}  // namespace
