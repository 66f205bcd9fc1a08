// ddptrain's Adam/AdamW kernel (cuda/adamw.h) against torch::optim's
// per-tensor Adam and AdamW: the same trajectory within fp32 rounding over
// steps with clipping coefficients, the gradients left clipped, the bf16
// copy the same bits as a cast, a found_inf that changes nothing; the
// vector path and the scalar one (an odd size, an unaligned start).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "support/testing.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/adamw.h"
#endif

namespace {

#ifdef DDP_WITH_CUDA_KERNELS
struct AdamCase {
  bool decoupled;
  double weight_decay;
  int64_t offset;  // into a larger buffer: 1 makes the start unaligned
};

TEST(AdamStep, FollowsTorchOptimWithClippingAndWritesTheBf16Copy_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  // More elements than one wave of blocks takes (the grid-stride loop runs
  // more than once), and odd (a tail).
  const int64_t n = 4000003;
  for (auto c : {AdamCase{true, 0.1, 0}, AdamCase{false, 0.01, 0}, AdamCase{true, 0.1, 1}}) {
    SCOPED_TRACE(std::string(c.decoupled ? "adamw" : "adam") + " offset " + std::to_string(c.offset));
    torch::manual_seed(17);
    auto start = torch::randn({n}, opts);
    auto buf = [&](const torch::Tensor& init) {
      auto b = torch::zeros({n + c.offset}, opts);
      b.narrow(0, c.offset, n).copy_(init);
      return b.narrow(0, c.offset, n);
    };
    auto p = buf(start), g = buf(torch::zeros({n}, opts)), m = buf(torch::zeros({n}, opts)),
         v = buf(torch::zeros({n}, opts));
    auto p16 = torch::empty({n}, opts.dtype(torch::kBFloat16));
    auto step = torch::zeros({}, opts), lr = torch::full({}, 0.01, opts);
    auto ref = start.clone().requires_grad_();
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (c.decoupled) opt = std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{ref},
                                                                  torch::optim::AdamWOptions(0.01).weight_decay(c.weight_decay));
    else opt = std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{ref},
                                                    torch::optim::AdamOptions(0.01).weight_decay(c.weight_decay));
    for (int s = 0; s < 6; ++s) {
      auto grad = torch::randn({n}, opts) * (s % 2 == 0 ? 10.0 : 0.1);
      const double k = s % 2 == 0 ? 0.03 : 1.0;  // a clipping coefficient, then none
      g.copy_(grad);
      step.add_(1);
      ddp::cuda::adam_step(p, g, m, v, step, lr, {0.9, 0.999, c.weight_decay, 1e-8, c.decoupled},
                           torch::full({}, k, opts), torch::Tensor(), p16);
      EXPECT_TRUE(torch::equal(g, grad * static_cast<float>(k))) << "left clipped, step " << s;
      ref.mutable_grad() = grad * static_cast<float>(k);
      opt->step();
      EXPECT_TRUE(torch::equal(p16, p.to(torch::kBFloat16))) << "the bf16 copy, step " << s;
    }
    const double moved = (ref.detach() - start).abs().max().item<double>();
    EXPECT_GT(moved, 1e-3);
    // fp32 rounding of the same arithmetic, as FlatOptimizerEquals allows the
    // fused kernels.
    EXPECT_LE((p - ref.detach()).abs().max().item<double>(), 2e-5);
    // A found_inf: nothing changes, bit for bit, and the copy is p's.
    auto before = torch::stack({p, g, m, v}).clone();
    p16.zero_();
    g.copy_(torch::randn({n}, opts));
    auto g_before = g.clone();
    ddp::cuda::adam_step(p, g, m, v, step, lr, {0.9, 0.999, c.weight_decay, 1e-8, c.decoupled},
                         torch::full({}, 0.5, opts), torch::ones({1}, opts), p16);
    EXPECT_TRUE(torch::equal(p, before[0]) && torch::equal(m, before[2]) && torch::equal(v, before[3]));
    EXPECT_TRUE(torch::equal(g, g_before));
    EXPECT_TRUE(torch::equal(p16, p.to(torch::kBFloat16)));
  }
}
// The clipping coefficient over several buffers (an aligned one, one that
// starts off 16 bytes, one shorter than a block, one empty) is
// clip_grad_norm_'s rule on their float64 norm, to fp32 rounding; above
// the norm it is 1; the same bits on a second call.
// store_clipped_grad = false: the same update, bit for bit, and the
// gradient left as it was (vector and scalar paths).
TEST(AdamStep, ClipsWithoutStoringTheGradientWhenAsked_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  const int64_t n = 100004;  // offset 0: every row 16-byte aligned (the vector path); 1: none (scalar)
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    torch::manual_seed(18);
    auto init = torch::randn({4, n + offset}, opts);
    init.select(0, 3).abs_();  // v, a second moment: never negative (else sqrt gives NaNs, which equal nothing)
    auto stored = init.clone(), kept = init.clone();
    auto part = [&](torch::Tensor& all, int64_t row) { return all.select(0, row).narrow(0, offset, n); };
    auto step = torch::ones({}, opts), lr = torch::full({}, 0.01, opts), coef = torch::full({}, 0.25, opts);
    auto p16_a = torch::empty({n}, opts.dtype(torch::kBFloat16)), p16_b = torch::empty_like(p16_a);
    ddp::cuda::adam_step(part(stored, 0), part(stored, 1), part(stored, 2), part(stored, 3), step, lr,
                         {0.9, 0.999, 0.1, 1e-8, true, true}, coef, torch::Tensor(), p16_a);
    ddp::cuda::adam_step(part(kept, 0), part(kept, 1), part(kept, 2), part(kept, 3), step, lr,
                         {0.9, 0.999, 0.1, 1e-8, true, false}, coef, torch::Tensor(), p16_b);
    ASSERT_TRUE(torch::isfinite(part(kept, 0)).all().item<bool>());
    for (int64_t row : {0, 2, 3}) EXPECT_TRUE(torch::equal(part(stored, row), part(kept, row))) << "row " << row;
    EXPECT_TRUE(torch::equal(p16_a, p16_b));
    EXPECT_TRUE(torch::equal(part(kept, 1), part(init, 1))) << "the gradient as it was";
    EXPECT_TRUE(torch::equal(part(stored, 1), part(init, 1) * 0.25f)) << "the control: stored clipped";
  }
}
#endif

}  // namespace
