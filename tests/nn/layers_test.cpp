// ddp::nn layers against LibTorch's: the same options, initial weights and
// state_dict names; on CPU the same outputs and gradients to the bit (their
// forward there is LibTorch's arithmetic); on CUDA under bf16 autocast the
// kernels, to stated tolerances (the _CUDA tests).
#include <gtest/gtest.h>

#include "ddp/compat.h"
#include "ddp/nn.h"
#include "ddp/error.h"
#include "ddp/models/fused_layer_norm.h"
#include "ddp/models/fused_linear.h"
#include "ddp/models/max_pool.h"
#include "ddp/train/fused_cross_entropy.h"
#include "support/testing.h"

namespace {

namespace F = torch::nn::functional;
using ddp::nn::Activation;

std::vector<std::string> state_names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  for (const auto& b : m.named_buffers()) out.push_back(b.key());
  return out;
}

// Forward and backward of `a` and `b` on the same input and upstream
// gradient: outputs, input gradients and each parameter's gradient equal
// to the bit.
template <typename A, typename B>
void expect_same_bits(A& a, B& b, const torch::Tensor& input, torch::Tensor (*call_a)(A&, const torch::Tensor&),
                      torch::Tensor (*call_b)(B&, const torch::Tensor&)) {
  auto xa = input.clone().requires_grad_(input.is_floating_point());
  auto xb = input.clone().requires_grad_(input.is_floating_point());
  auto ya = call_a(a, xa), yb = call_b(b, xb);
  ASSERT_EQ(ya.sizes(), yb.sizes());
  EXPECT_TRUE(torch::equal(ya, yb)) << (ya - yb).abs().max();
  auto g = torch::randn_like(ya);
  ya.backward(g);
  yb.backward(g);
  if (input.is_floating_point()) {
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
  }
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::equal(p.value().grad(), pb[p.key()].grad())) << p.key();
  }
}

TEST(NnLinear, IsTorchsLinearWithTheSameInitialWeightsNamesAndBits) {
  for (bool bias : {true, false}) {
    torch::manual_seed(7);
    torch::nn::Linear plain(torch::nn::LinearOptions(24, 40).bias(bias));
    torch::manual_seed(7);
    ddp::nn::Linear fast(torch::nn::LinearOptions(24, 40).bias(bias));
    EXPECT_EQ(state_names(*plain), state_names(*fast));
    for (const auto& p : plain->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), fast->named_parameters()[p.key()]));
    // A ddp::nn::Linear is a torch::nn::Linear to code that asks for one.
    EXPECT_NE(fast->as<torch::nn::Linear>(), nullptr);
    expect_same_bits(plain, fast, torch::randn({5, 3, 24}),
                     +[](torch::nn::Linear& m, const torch::Tensor& x) { return m(x); },
                     +[](ddp::nn::Linear& m, const torch::Tensor& x) { return m(x); });
  }
}

TEST(NnLinear, ActivationsAreTheComposedOps) {
  const std::pair<Activation, torch::Tensor (*)(const torch::Tensor&)> cases[] = {
      {Activation::kRelu, +[](const torch::Tensor& y) { return torch::relu(y); }},
      {Activation::kGelu, +[](const torch::Tensor& y) { return torch::gelu(y); }},
      {Activation::kGeluTanh, +[](const torch::Tensor& y) { return torch::gelu(y, "tanh"); }},
  };
  for (const auto& [activation, composed] : cases) {
    torch::manual_seed(3);
    torch::nn::Linear plain(16, 32);
    torch::manual_seed(3);
    ddp::nn::Linear fast(16, 32, activation);
    auto x = torch::randn({8, 16});
    auto xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
    auto ya = composed(plain(xa)), yb = fast(xb);
    EXPECT_TRUE(torch::equal(ya, yb)) << ddp::nn::activation_name(activation);
    auto g = torch::randn_like(ya);
    ya.backward(g);
    yb.backward(g);
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad())) << ddp::nn::activation_name(activation);
    EXPECT_TRUE(torch::equal(plain->weight.grad(), fast->weight.grad())) << ddp::nn::activation_name(activation);
    EXPECT_TRUE(torch::equal(plain->bias.grad(), fast->bias.grad())) << ddp::nn::activation_name(activation);
  }
}

TEST(NnLinear, CloneIsADeepCopyAndDrawsNoRandomNumbers) {
  ddp::nn::Linear fast(8, 4, Activation::kRelu);
  torch::manual_seed(11);
  auto copy = std::dynamic_pointer_cast<ddp::nn::LinearImpl>(fast->clone());
  const auto next = torch::rand({1});
  torch::manual_seed(11);
  EXPECT_TRUE(torch::equal(next, torch::rand({1}))) << "clone() moved the generator";
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(copy->activation, Activation::kRelu);
  EXPECT_TRUE(torch::equal(copy->weight, fast->weight));
  copy->weight.data().add_(1);
  EXPECT_FALSE(torch::equal(copy->weight, fast->weight)) << "clone() shares the weight";
}

TEST(NnLayerNorm, IsTorchsLayerNormAndForwardAddIsTheAddThenTheNorm) {
  torch::nn::LayerNorm plain(torch::nn::LayerNormOptions({32}).eps(1e-6));
  ddp::nn::LayerNorm fast(torch::nn::LayerNormOptions({32}).eps(1e-6));
  {
    torch::NoGradGuard no_grad;
    for (auto* m : {plain.ptr().get(), static_cast<torch::nn::LayerNormImpl*>(fast.ptr().get())}) {
      torch::manual_seed(5);  // the same non-trivial affine in both
      m->weight.copy_(torch::randn({32}));
      m->bias.copy_(torch::randn({32}));
    }
  }
  EXPECT_EQ(state_names(*plain), state_names(*fast));
  expect_same_bits(plain, fast, torch::randn({4, 6, 32}),
                   +[](torch::nn::LayerNorm& m, const torch::Tensor& x) { return m(x); },
                   +[](ddp::nn::LayerNorm& m, const torch::Tensor& x) { return m(x); });
  // forward_add: {x + branch, norm(x + branch)}, both differentiable.
  auto x = torch::randn({4, 32}, torch::requires_grad()), branch = torch::randn({4, 32}, torch::requires_grad());
  auto [sum, normed] = fast->forward_add(x, branch);
  EXPECT_TRUE(torch::equal(sum, x + branch));
  EXPECT_TRUE(torch::equal(normed, plain(x + branch)));
  // A 2-D normalized shape takes LibTorch's path.
  torch::nn::LayerNorm plain2(torch::nn::LayerNormOptions({3, 8}));
  ddp::nn::LayerNorm fast2(torch::nn::LayerNormOptions({3, 8}));
  auto y = torch::randn({2, 3, 8});
  EXPECT_TRUE(torch::equal(plain2(y), fast2(y)));
}

TEST(NnEmbedding, IsTorchsEmbeddingAndHeadIsTheTiedProjection) {
  torch::manual_seed(9);
  torch::nn::Embedding plain(50, 16);
  torch::manual_seed(9);
  ddp::nn::Embedding fast(50, 16);
  EXPECT_EQ(state_names(*plain), state_names(*fast));
  EXPECT_TRUE(torch::equal(plain->weight, fast->weight));
  auto idx = torch::randint(0, 50, {4, 7}, torch::kLong);
  idx[0][0] = idx[1][1] = 3;  // a repeated row: its gradients add
  // embed then the tied head, against LibTorch's lookup and linear on one weight.
  auto la = F::linear(torch::tanh(plain(idx)), plain->weight);
  auto lb = fast->head(torch::tanh(fast(idx)));
  EXPECT_TRUE(torch::equal(la, lb));
  auto g = torch::randn_like(la);
  la.backward(g);
  lb.backward(g);
  EXPECT_TRUE(torch::allclose(plain->weight.grad(), fast->weight.grad(), 0, 0));
  // With a padding row, LibTorch's own path (that row gets no gradient).
  ddp::nn::Embedding padded(torch::nn::EmbeddingOptions(10, 4).padding_idx(0));
  padded(torch::tensor({0, 1, 0})).sum().backward();
  EXPECT_TRUE(torch::equal(padded->weight.grad()[0], torch::zeros({4})));
}

TEST(NnCrossEntropyLoss, IsTorchsCrossEntropyForEveryOption) {
  auto logits = torch::randn({12, 9});
  for (auto options : {torch::nn::CrossEntropyLossOptions(),
                       torch::nn::CrossEntropyLossOptions().reduction(torch::kSum),
                       torch::nn::CrossEntropyLossOptions().label_smoothing(0.1),
                       torch::nn::CrossEntropyLossOptions().ignore_index(4).weight(torch::rand({9}))}) {
    auto target = torch::randint(0, 9, {12}, torch::kLong);
    target[2] = options.ignore_index();  // one ignored row
    torch::nn::CrossEntropyLoss plain(options);
    ddp::nn::CrossEntropyLoss fast(options);
    auto a = logits.clone().requires_grad_(), b = logits.clone().requires_grad_();
    auto la = plain(a, target), lb = fast(b, target);
    EXPECT_TRUE(torch::equal(la, lb));
    la.backward();
    lb.backward();
    EXPECT_TRUE(torch::equal(a.grad(), b.grad()));
  }
}

TEST(NnBatchNorm, IsTorchsBatchNormWithTheReluFolded) {
  torch::nn::BatchNorm2d plain(torch::nn::BatchNorm2dOptions(6).momentum(0.2).eps(1e-4));
  auto fast = ddp::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(6).momentum(0.2).eps(1e-4), Activation::kRelu);
  EXPECT_EQ(state_names(*plain), state_names(*fast));
  auto x = torch::randn({4, 6, 5, 5});
  auto xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
  auto ya = torch::relu(plain(xa)), yb = fast(xb);
  EXPECT_TRUE(torch::equal(ya, yb));
  auto g = torch::randn_like(ya);
  ya.backward(g);
  yb.backward(g);
  EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
  EXPECT_TRUE(torch::equal(plain->weight.grad(), fast->weight.grad()));
  EXPECT_TRUE(torch::equal(plain->running_mean, fast->running_mean));
  EXPECT_TRUE(torch::equal(plain->running_var, fast->running_var));
  EXPECT_TRUE(torch::equal(plain->num_batches_tracked, fast->num_batches_tracked));
  // A cumulative average (momentum nullopt) is refused, naming the fix.
  const auto err = ddp::testing::user_error(
      [] { ddp::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(3).momentum(c10::nullopt)); });
  EXPECT_NE(err.find("momentum"), std::string::npos) << err;
}

TEST(NnMaxPool2d, IsTorchsMaxPool) {
  for (auto options : {torch::nn::MaxPool2dOptions(3).stride(2).padding(1), torch::nn::MaxPool2dOptions({2, 3}),
                       torch::nn::MaxPool2dOptions(2).ceil_mode(true)}) {
    torch::nn::MaxPool2d plain(options);
    ddp::nn::MaxPool2d fast(options);
    expect_same_bits(plain, fast, torch::randn({2, 4, 9, 9}),
                     +[](torch::nn::MaxPool2d& m, const torch::Tensor& x) { return m(x); },
                     +[](ddp::nn::MaxPool2d& m, const torch::Tensor& x) { return m(x); });
  }
}

#ifdef DDP_WITH_CUDA_KERNELS
// On CUDA under bf16 autocast the layers take ddptrain's kernels; against
// LibTorch's ops on the same values: outputs within bf16 rounding (the
// kernels' products and sums are fp32, as cuBLAS's and ATen's), parameter
// gradients (fp32 here, bf16-rounded by autocast there) to 2e-2 relative.
void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, const std::string& what) {
  const double scale = b.abs().max().item<double>() + 1e-6;
  EXPECT_LE((a.to(torch::kFloat) - b.to(torch::kFloat)).abs().max().item<double>(), rtol * scale) << what;
}

#endif

TEST(NnLayers, TakeTheKernelsUnderBf16Autocast_CUDA) {
#ifndef DDP_WITH_CUDA_KERNELS
  GTEST_SKIP() << "a build without ddptrain's CUDA kernels";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA);
  ddp::models::use_fused_linear(true);
  ddp::models::use_fused_layer_norm(true);
  ddp::compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
  // Without an activation, against LibTorch's linear.
  torch::manual_seed(1);
  torch::nn::Linear plain(256, 512);
  torch::manual_seed(1);
  ddp::nn::Linear fast(256, 512);
  plain->to(cuda);
  fast->to(cuda);
  auto x = torch::randn({4, 64, 256}, cuda);
  EXPECT_TRUE(ddp::models::fused_linear_applies(x, fast->weight, fast->bias));
  auto ya = plain(x), yb = fast(x);
  expect_close(yb, ya, 1e-2, "linear output");
  auto g = torch::randn_like(ya);
  ya.backward(g);
  yb.backward(g);
  expect_close(fast->weight.grad(), plain->weight.grad(), 2e-2, "linear weight grad");
  expect_close(fast->bias.grad(), plain->bias.grad(), 2e-2, "linear bias grad");
  // Each activation inside the layer, against the same layer's output
  // (the same products, so the same ReLU mask) then LibTorch's activation.
  for (auto activation : {Activation::kRelu, Activation::kGelu, Activation::kGeluTanh}) {
    const std::string what = ddp::nn::activation_name(activation);
    torch::manual_seed(2);
    ddp::nn::Linear bare(256, 512);
    torch::manual_seed(2);
    ddp::nn::Linear with(256, 512, activation);
    bare->to(cuda);
    with->to(cuda);
    auto h = bare(x);
    auto za = activation == Activation::kRelu   ? torch::relu(h)
              : activation == Activation::kGelu ? torch::gelu(h)
                                                : torch::gelu(h, "tanh");
    auto zb = with(x);
    expect_close(zb, za, 1e-2, what + " output");
    auto gz = torch::randn_like(za);
    za.backward(gz);
    zb.backward(gz);
    expect_close(with->weight.grad(), bare->weight.grad(), 2e-2, what + " weight grad");
    expect_close(with->bias.grad(), bare->bias.grad(), 2e-2, what + " bias grad");
  }
  torch::nn::LayerNorm plain_ln(torch::nn::LayerNormOptions({768}));
  ddp::nn::LayerNorm fast_ln(torch::nn::LayerNormOptions({768}));
  plain_ln->to(cuda);
  fast_ln->to(cuda);
  // The residual stream in fp32, the branch in bf16 (a matmul's output):
  // the case the kernels take.
  auto stream = torch::randn({8, 128, 768}, cuda), branch = torch::randn({8, 128, 768}, cuda).to(torch::kBFloat16);
  EXPECT_TRUE(ddp::models::fused_layer_norm_applies(stream, branch, fast_ln->weight, fast_ln->bias));
  auto [sum, normed] = fast_ln->forward_add(stream, branch);
  EXPECT_EQ(normed.scalar_type(), torch::kBFloat16) << "the kernels' output is bf16";
  expect_close(sum, stream + branch, 0, "residual sum");
  expect_close(normed, plain_ln(stream + branch), 1e-2, "layer norm");
  // The stem's max pool on channels-last bf16: the kernel, the same bits.
  auto image = torch::randn({8, 64, 56, 56}, cuda).to(torch::kBFloat16).contiguous(torch::MemoryFormat::ChannelsLast);
  ddp::nn::MaxPool2d pool(torch::nn::MaxPool2dOptions(3).stride(2).padding(1));
  EXPECT_TRUE(ddp::models::nhwc_max_pool_applies(image, 3, 2, 1));
  EXPECT_TRUE(torch::equal(pool(image), torch::max_pool2d(image, 3, 2, 1)));
  ddp::nn::CrossEntropyLoss ce;
  auto logits = torch::randn({64, 1000}, cuda).to(torch::kBFloat16);
  auto target = torch::randint(0, 1000, {64}, torch::TensorOptions(cuda).dtype(torch::kLong));
  expect_close(ce(logits, target), F::cross_entropy(logits.to(torch::kFloat), target), 1e-5, "cross-entropy");
#endif
}

}  // namespace
