// ddptrain's channels-last max pool against ATen's max_pool2d, forward and
// backward, bit for bit; and the ResNet stem with and without it.
#include "ddp/models/max_pool.h"
#include "ddp/models/resnet.h"
#include "support/testing.h"

#include <array>

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/max_pool_nhwc.h"
#endif

namespace {

struct Pooled {
  torch::Tensor y, dx;
};

// Through ddp::models::max_pool2d (the path the ResNet takes), with the
// kernels on or off (off: torch::max_pool2d).
Pooled pool(bool kernels, const torch::Tensor& x, const torch::Tensor& dy, int64_t k, int64_t s, int64_t p) {
  ddp::models::use_nhwc_max_pool_kernels(kernels);
  EXPECT_EQ(ddp::models::nhwc_max_pool_applies(x, k, s, p), kernels);
  auto xg = x.clone(at::MemoryFormat::ChannelsLast).requires_grad_();
  auto y = ddp::models::max_pool2d(xg, k, s, p);
  y.backward(dy);
  ddp::models::use_nhwc_max_pool_kernels(true);
  return {y.detach(), xg.grad()};
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && torch::equal(a, b);
}

// Equal values, and NaN exactly where the other has NaN.
bool same_with_nans(const torch::Tensor& a, const torch::Tensor& b) {
  auto na = a.isnan(), nb = b.isnan();
  return torch::equal(na, nb) && torch::equal(a.masked_fill(na, 0), b.masked_fill(nb, 0));
}

torch::Tensor cl(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
}

enum class Input { kRandom, kQuantised, kConstant, kNegInf };

torch::Tensor make_input(Input kind, const std::vector<int64_t>& shape, const torch::Device& dev) {
  auto x = torch::randn(shape, dev);
  switch (kind) {
    case Input::kRandom: return x;
    case Input::kQuantised: return (x * 1.5).round();  // a handful of values: many ties in a window
    case Input::kConstant: return torch::full(shape, 0.75, x.options());
    case Input::kNegInf: {
      // -inf scattered, plus whole windows of it: the top rows (windows
      // holding the plane's element (0, 0)) and a band of rows lower down
      // (windows that do not), where ATen's index 0 decides the gradient.
      x = x.masked_fill(torch::rand(shape, dev) < 0.3, -INFINITY);
      const int64_t H = shape[2];
      x.narrow(2, 0, std::min<int64_t>(2, H)).fill_(-INFINITY);
      if (H >= 8) x.narrow(2, H / 2, 3).fill_(-INFINITY);
      return x;
    }
  }
  return x;
}

const std::vector<std::vector<int64_t>> kPoolShapes{{2, 8, 7, 7},   {4, 64, 112, 112}, {2, 72, 113, 97},
                                                {3, 8, 1, 1},   {2, 64, 9, 8},     {1, 16, 2, 3}};

TEST(MaxPoolNhwc, MatchesATenBitForBit_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(7);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat}) {
    for (const auto& shape : kPoolShapes) {
      for (const auto kind : {Input::kRandom, Input::kQuantised, Input::kConstant, Input::kNegInf}) {
        SCOPED_TRACE(c10::str(dtype, " ", shape, " input kind ", static_cast<int>(kind)));
        auto x = cl(make_input(kind, shape, gpu), dtype);
        const int64_t OH = (shape[2] + 2 - 3) / 2 + 1, OW = (shape[3] + 2 - 3) / 2 + 1;
        auto dy = cl(torch::randn({shape[0], shape[1], OH, OW}, gpu), dtype);
        auto ours = pool(true, x, dy, 3, 2, 1);
        auto ref = pool(false, x, dy, 3, 2, 1);
        EXPECT_TRUE(ours.y.is_contiguous(at::MemoryFormat::ChannelsLast));
        EXPECT_TRUE(ours.dx.is_contiguous(at::MemoryFormat::ChannelsLast));
        EXPECT_TRUE(same_bits(ours.y, ref.y));
        EXPECT_TRUE(same_bits(ours.dx, ref.dx));
      }
    }
  }
}

// Other kernel sizes, strides and paddings (the runtime-k kernel, k = 3
// with other strides, windows that overlap more or not at all).
TEST(MaxPoolNhwc, OtherWindowsMatchATen_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(8);
  const std::vector<std::array<int64_t, 3>> windows{{2, 2, 0}, {3, 1, 1}, {3, 3, 0}, {5, 2, 2}, {4, 3, 1}, {1, 1, 0}};
  for (const auto dtype : {torch::kBFloat16, torch::kFloat}) {
    for (const auto& [k, s, p] : windows) {
      for (const auto kind : {Input::kRandom, Input::kQuantised, Input::kNegInf}) {
        const std::vector<int64_t> shape{2, 24, 17, 12};
        SCOPED_TRACE(c10::str(dtype, " k", k, " s", s, " p", p, " input kind ", static_cast<int>(kind)));
        auto x = cl(make_input(kind, shape, gpu), dtype);
        const int64_t OH = (shape[2] + 2 * p - k) / s + 1, OW = (shape[3] + 2 * p - k) / s + 1;
        auto dy = cl(torch::randn({shape[0], shape[1], OH, OW}, gpu), dtype);
        auto ours = pool(true, x, dy, k, s, p);
        auto ref = pool(false, x, dy, k, s, p);
        EXPECT_TRUE(same_bits(ours.y, ref.y));
        EXPECT_TRUE(same_bits(ours.dx, ref.dx));
      }
    }
  }
}

// A NaN is a maximum (ATen: the last NaN in the window wins): the output
// has NaN in the same places and the gradient goes to the same elements.
TEST(MaxPoolNhwc, NaNPropagatesAsInATen_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(9);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat}) {
    SCOPED_TRACE(c10::str(dtype));
    auto x = torch::randn({2, 16, 15, 14}, gpu);
    x = x.masked_fill(torch::rand(x.sizes(), gpu) < 0.1, NAN);
    x = cl(x, dtype);
    auto dy = cl(torch::randn({2, 16, 8, 7}, gpu), dtype);
    auto ours = pool(true, x, dy, 3, 2, 1);
    auto ref = pool(false, x, dy, 3, 2, 1);
    EXPECT_GT(ours.y.isnan().sum().item<int64_t>(), 0);
    EXPECT_TRUE(same_with_nans(ours.y, ref.y));
    EXPECT_TRUE(same_bits(ours.dx, ref.dx));
  }
}

// Inputs the kernels do not take run through ATen's max_pool2d.
TEST(MaxPoolNhwc, OtherInputsTakeATensPath_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  auto x = cl(torch::randn({2, 16, 9, 9}, gpu), torch::kBFloat16);
  using ddp::models::nhwc_max_pool_applies;
  EXPECT_TRUE(nhwc_max_pool_applies(x, 3, 2, 1));
  EXPECT_TRUE(nhwc_max_pool_applies(x.to(torch::kFloat), 3, 2, 1));
  EXPECT_FALSE(nhwc_max_pool_applies(x.contiguous(), 3, 2, 1));           // NCHW
  EXPECT_FALSE(nhwc_max_pool_applies(x.to(torch::kHalf), 3, 2, 1));       // fp16
  EXPECT_FALSE(nhwc_max_pool_applies(x.cpu(), 3, 2, 1));
  EXPECT_FALSE(nhwc_max_pool_applies(cl(torch::randn({2, 12, 9, 9}, gpu), torch::kBFloat16), 3, 2, 1));  // C % 8
  EXPECT_FALSE(nhwc_max_pool_applies(x, 3, 2, 2));                         // padding > kernel / 2
  EXPECT_FALSE(nhwc_max_pool_applies(x, 17, 1, 8));                        // 289 window offsets
  ddp::models::use_nhwc_max_pool_kernels(false);
  EXPECT_FALSE(nhwc_max_pool_applies(x, 3, 2, 1));
  ddp::models::use_nhwc_max_pool_kernels(true);
  // NCHW falls back and still works.
  EXPECT_TRUE(torch::equal(ddp::models::max_pool2d(x.contiguous(), 3, 2, 1), torch::max_pool2d(x, 3, 2, 1)));
#ifdef DDP_WITH_CUDA_KERNELS
  // The argmax is one byte per output element.
  auto out = ddp::cuda::max_pool_nhwc_forward(x, 3, 2, 1);
  EXPECT_EQ(out[1].scalar_type(), torch::kByte);
  EXPECT_EQ(out[1].numel(), out[0].numel());
#endif
}

// The ImageNet stem (conv 7x7/2, batch norm + ReLU, max pool 3x3/2) and the
// rest of a ResNet-18, in training mode, with and without the kernel: the
// same logits and the same gradients, bit for bit, in bf16 (convolutions
// and fc in bf16, batch norms fp32 as under autocast, so the batch norm
// kernels run too) and in fp32.
TEST(MaxPoolNhwc, ResNetStemSameWithAndWithoutKernel_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  auto& ctx = at::globalContext();
  const bool det = ctx.deterministicCuDNN(), bench = ctx.benchmarkCuDNN();
  ctx.setDeterministicCuDNN(true);  // otherwise conv weight gradients may differ run to run
  ctx.setBenchmarkCuDNN(false);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat}) {
    SCOPED_TRACE(c10::str(dtype));
    torch::manual_seed(11);
    ddp::models::ResNet net(ddp::models::ResNetOptions(18).num_classes(10));
    net->to(gpu);
    for (auto& m : net->modules(/*include_self=*/false)) {
      if (auto* c = m->as<torch::nn::Conv2d>()) {
        c->to(dtype);
        c->weight.set_data(c->weight.contiguous(at::MemoryFormat::ChannelsLast));
      }
      if (auto* l = m->as<torch::nn::Linear>()) l->to(dtype);
    }
    net->train();
    auto x = cl(torch::randn({4, 3, 64, 64}, gpu), dtype);
    auto stem = [&](bool kernels) {
      ddp::models::use_nhwc_max_pool_kernels(kernels);
      net->zero_grad();
      auto xg = x.clone(at::MemoryFormat::ChannelsLast).requires_grad_();
      auto y = net->forward(xg);
      y.to(torch::kFloat).square().sum().backward();
      std::vector<torch::Tensor> grads{xg.grad()};
      for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
      ddp::models::use_nhwc_max_pool_kernels(true);
      return std::pair{y.detach(), grads};
    };
    // The stem's pool input: 64 channels at 32x32, which the kernel takes.
    EXPECT_TRUE(ddp::models::nhwc_max_pool_applies(cl(torch::zeros({4, 64, 32, 32}, gpu), dtype), 3, 2, 1));
    auto [y1, g1] = stem(true);
    auto [y2, g2] = stem(false);
    EXPECT_TRUE(same_bits(y1, y2));
    ASSERT_EQ(g1.size(), g2.size());
    for (size_t i = 0; i < g1.size(); ++i) EXPECT_TRUE(same_bits(g1[i], g2[i])) << "gradient " << i;
  }
  ctx.setDeterministicCuDNN(det);
  ctx.setBenchmarkCuDNN(bench);
}

}  // namespace
