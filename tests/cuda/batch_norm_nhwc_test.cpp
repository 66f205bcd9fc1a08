// ddptrain's channels-last batch-norm kernels against LibTorch's batch norm,
// through ddp::BatchNorm (the path models take), forward and backward.
#include "ddp/dist/sync_batchnorm.h"
#include "ddp/models/resnet.h"
#include "support/testing.h"

#include <cmath>
#include <tuple>

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/batch_norm_nhwc.h"
#endif

namespace {

struct Result {
  torch::Tensor y, dx, dw, db, running_mean, running_var;
};

Result run_bn(bool kernels, const torch::Tensor& x, const torch::Tensor& dy, const torch::Tensor& w,
              const torch::Tensor& b, const torch::Tensor& rm, const torch::Tensor& rv) {
  ddp::use_nhwc_batchnorm_kernels(kernels);
  ddp::BatchNorm bn(x.size(1));
  bn->to(x.device());
  {
    torch::NoGradGuard no_grad;
    bn->weight.copy_(w);
    bn->bias.copy_(b);
    bn->running_mean.copy_(rm);
    bn->running_var.copy_(rv);
  }
  bn->train();
  auto xg = x.clone().requires_grad_();
  auto y = bn(xg);
  y.backward(dy);
  ddp::use_nhwc_batchnorm_kernels(true);
  return {y.detach(), xg.grad(), bn->weight.grad(), bn->bias.grad(), bn->running_mean.clone(), bn->running_var.clone()};
}

// ResNet-50's batch-norm shapes at a smaller batch, and odd ones (8 channels,
// 1 x 1 images, rows not a multiple of the block).
const std::vector<std::vector<int64_t>> kBatchNormShapes{{32, 64, 28, 28}, {16, 256, 14, 14}, {8, 2048, 7, 7},
                                                {3, 8, 5, 7},     {2, 24, 1, 1},     {5, 96, 9, 3}};

// Largest difference relative to the reference's largest magnitude.
double rel(const torch::Tensor& got, const torch::Tensor& ref) {
  auto r = ref.to(torch::kDouble), g = got.to(torch::kDouble);
  return ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item<double>();
}

TEST(BatchNormNhwc, MatchesLibTorchForwardAndBackward_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(3);
  {
    const auto dtype = torch::kBFloat16;
    const double eps = 1.0 / 128;  // one unit of bf16 rounding
    for (const auto& shape : kBatchNormShapes) {
      SCOPED_TRACE(c10::str(dtype, " ", shape));
      const int64_t c = shape[1];
      auto x = (torch::randn(shape, gpu) * 3 + 2).to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
      auto dy = torch::randn(shape, gpu).to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
      auto w = torch::rand({c}, gpu) + 0.5, b = torch::randn({c}, gpu);
      auto rm = torch::randn({c}, gpu), rv = torch::rand({c}, gpu) + 0.5;
#ifdef DDP_WITH_CUDA_KERNELS
      EXPECT_TRUE(ddp::cuda::bn_nhwc_supported(x));
#endif
      auto ours = run_bn(true, x, dy, w, b, rm, rv);
      auto ref = run_bn(false, x, dy, w, b, rm, rv);
      EXPECT_TRUE(ours.y.is_contiguous(at::MemoryFormat::ChannelsLast));
      EXPECT_LE(rel(ours.y, ref.y), 2 * eps);
      EXPECT_LE(rel(ours.dx, ref.dx), 4 * eps);
      EXPECT_LE(rel(ours.dw, ref.dw), 1e-3);
      EXPECT_LE(rel(ours.db, ref.db), 1e-3);
      EXPECT_LE(rel(ours.running_mean, ref.running_mean), 1e-5);
      EXPECT_LE(rel(ours.running_var, ref.running_var), 1e-4);
    }
  }
}

// The statistics are sums about a pivot from the data: they must hold where
// the mean is far from 0 against the spread (sums about 0 would cancel),
// and where the pivot row is an outlier of its channel.
TEST(BatchNormNhwc, StatisticsHoldForALargeMeanAndAnOutlierPivot_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(11);
  const double eps = 1.0 / 128;
  const std::vector<int64_t> shape{64, 64, 28, 28};
  const int64_t c = shape[1];
  for (const bool outlier : {false, true}) {
    SCOPED_TRACE(outlier ? "outlier in the first row" : "mean 1000, std 8");
    auto x = torch::randn(shape, gpu) * 8 + 1000;
    if (outlier) x.select(0, 0).select(1, 0).select(1, 0).fill_(2000);  // row 0 (n=0, h=0, w=0), every channel
    x = x.to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
    auto dy = torch::randn(shape, gpu).to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
    auto w = torch::rand({c}, gpu) + 0.5, b = torch::randn({c}, gpu);
    auto rm = torch::zeros({c}, gpu), rv = torch::ones({c}, gpu);
    auto ours = run_bn(true, x, dy, w, b, rm, rv);
    auto ref = run_bn(false, x, dy, w, b, rm, rv);
    EXPECT_LE(rel(ours.running_mean, ref.running_mean), 1e-5);
    EXPECT_LE(rel(ours.running_var, ref.running_var), 1e-4);
    EXPECT_LE(rel(ours.y, ref.y), 2 * eps);
    EXPECT_LE(rel(ours.dx, ref.dx), 4 * eps);
  }
}

// A NaN in a channel's input reaches its output and both running
// statistics, as with LibTorch's batch norm; the other channels are finite.
TEST(BatchNormNhwc, NaNInputReachesTheRunningStatistics_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(12);
  const std::vector<int64_t> shape{8, 16, 5, 5};
  auto x = torch::randn(shape, gpu);
  x.select(0, 3).select(0, 2).select(0, 1).select(0, 4).fill_(std::nan(""));  // channel 2 only
  x = x.to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
  auto dy = torch::randn(shape, gpu).to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
  auto w = torch::ones({16}, gpu), b = torch::zeros({16}, gpu);
  auto rm = torch::zeros({16}, gpu), rv = torch::ones({16}, gpu);
  for (const bool kernels : {true, false}) {
    SCOPED_TRACE(kernels ? "ddptrain's kernels" : "LibTorch's");
    auto r = run_bn(kernels, x, dy, w, b, rm, rv);
    EXPECT_TRUE(std::isnan(r.running_mean[2].item<float>()));
    EXPECT_TRUE(std::isnan(r.running_var[2].item<float>()));
    EXPECT_TRUE(torch::isnan(r.y.select(1, 2)).all().item<bool>());
    EXPECT_TRUE(torch::isfinite(r.running_var.index_select(0, torch::tensor({0, 1, 3}, gpu))).all().item<bool>());
  }
}

// relu(bn(x) + residual) through BatchNorm::forward_relu, three ways.
struct FusedResult {
  torch::Tensor y, dx, dres, dw, db, running_mean;
};

enum class Path { kFused, kUnfused, kNative };

FusedResult run_fused(Path path, const torch::Tensor& x, const torch::Tensor& res, const torch::Tensor& dy,
                      const torch::Tensor& w, const torch::Tensor& b) {
  ddp::use_nhwc_batchnorm_kernels(path != Path::kNative);
  ddp::use_fused_batchnorm_relu(path == Path::kFused);
  ddp::BatchNorm bn(x.size(1));
  bn->to(x.device());
  {
    torch::NoGradGuard no_grad;
    bn->weight.copy_(w);
    bn->bias.copy_(b);
  }
  bn->train();
  auto xg = x.clone().requires_grad_();
  auto rg = res.defined() ? res.clone().requires_grad_() : torch::Tensor();
  auto y = bn->forward_relu(xg, rg);
  y.backward(dy);
  ddp::use_nhwc_batchnorm_kernels(true);
  ddp::use_fused_batchnorm_relu(true);
  return {y.detach(), xg.grad(), rg.defined() ? rg.grad() : torch::Tensor(), bn->weight.grad(), bn->bias.grad(),
          bn->running_mean.clone()};
}

bool equal_bits(const torch::Tensor& a, const torch::Tensor& b) { return torch::equal(a, b); }

// The fused kernels give exactly the unfused ops' bits (the same roundings,
// the same mask, the same sums), and both match a float64 reference.
TEST(BatchNormNhwc, FusedReluAndResidualEqualTheSeparateOps_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(5);
  const double eps = 1.0 / 128;
  for (const auto& shape : kBatchNormShapes) {
    for (const bool with_residual : {false, true}) {
      SCOPED_TRACE(c10::str(shape, with_residual ? " with residual" : " relu only"));
      const int64_t c = shape[1];
      auto cl = [&](torch::Tensor t) { return t.to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast); };
      auto x = cl(torch::randn(shape, gpu) * 3 + 2);
      auto res = with_residual ? cl(torch::randn(shape, gpu)) : torch::Tensor();
      auto dy = cl(torch::randn(shape, gpu));
      auto w = torch::rand({c}, gpu) + 0.5, b = torch::randn({c}, gpu);
      auto fused = run_fused(Path::kFused, x, res, dy, w, b);
      auto unfused = run_fused(Path::kUnfused, x, res, dy, w, b);
      auto native = run_fused(Path::kNative, x, res, dy, w, b);
      EXPECT_TRUE(fused.y.is_contiguous(at::MemoryFormat::ChannelsLast));
      EXPECT_TRUE(equal_bits(fused.y, unfused.y));
      EXPECT_TRUE(equal_bits(fused.dx, unfused.dx));
      EXPECT_TRUE(equal_bits(fused.dw, unfused.dw));
      EXPECT_TRUE(equal_bits(fused.db, unfused.db));
      EXPECT_TRUE(equal_bits(fused.running_mean, unfused.running_mean));
      if (with_residual) {
        EXPECT_TRUE(equal_bits(fused.dres, unfused.dres));
      }
      EXPECT_LE(rel(fused.y, native.y), 2 * eps);
      // LibTorch's batch norm rounds a few outputs near 0 to the other side
      // of the ReLU; there the gradient is dy against 0, which says nothing
      // about either kernel. Compare dx where the masks agree, and require
      // them to disagree only rarely. (The float64 check below is exact.)
      auto agree = (fused.y > 0) == (native.y > 0);
      EXPECT_LT(1.0 - agree.to(torch::kDouble).mean().item<double>(), 1e-3);
      EXPECT_LE(rel(fused.dx.masked_fill(agree.logical_not(), 0), native.dx.masked_fill(agree.logical_not(), 0)), 4 * eps);

      // float64, with the bf16 rounding of bn's output before the add and
      // the ReLU mask of the bf16 output (where float64 would round
      // differently at 0, the mask is not the thing under test).
      auto xd = x.to(torch::kDouble).requires_grad_();
      auto wd = w.to(torch::kDouble).requires_grad_(), bd = b.to(torch::kDouble).requires_grad_();
      auto yd = torch::batch_norm(xd, wd, bd, {}, {}, true, 0.1, 1e-5, false);
      if (with_residual) yd = yd + res.to(torch::kDouble);
      auto mask = (fused.y > 0).to(torch::kDouble);
      (yd * mask).backward(dy.to(torch::kDouble));
      EXPECT_LE(rel(fused.y, torch::relu(yd).detach()), 2 * eps);
      EXPECT_LE(rel(fused.dx, xd.grad()), 4 * eps);
      EXPECT_LE(rel(fused.dw, wd.grad()), 1e-3);
      EXPECT_LE(rel(fused.db, bd.grad()), 1e-3);
      if (with_residual) {
        EXPECT_LE(rel(fused.dres, dy.to(torch::kDouble) * mask), 1e-6);
      }
    }
  }
}

#ifdef DDP_WITH_CUDA_KERNELS
// The memory-saving backward variants give the same bits as the plain one:
// dx written over dz (need_dz = false), and the ReLU mask recomputed from x
// and the forward's scale/shift instead of read from y.
TEST(BatchNormNhwc, BackwardWithoutDzOrYGivesTheSameBits_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(6);
  auto cl = [&](torch::Tensor t) { return t.to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast); };
  for (const auto& shape : kBatchNormShapes) {
    for (const bool with_residual : {false, true}) {
      SCOPED_TRACE(c10::str(shape, with_residual ? " with residual" : " relu only"));
      const int64_t c = shape[1];
      // Half of the outputs near the ReLU's kink: the mask is what is tested.
      auto x = cl(torch::randn(shape, gpu) * 3 + 2);
      auto res = with_residual ? cl(torch::randn(shape, gpu)) : torch::Tensor();
      auto dy = cl(torch::randn(shape, gpu));
      auto w = torch::rand({c}, gpu) + 0.5, b = torch::randn({c}, gpu) * 1e-3;
      auto rm = torch::zeros({c}, gpu), rv = torch::ones({c}, gpu);
      auto out = ddp::cuda::bn_nhwc_forward(x, w, b, rm, rv, 0.1, 1e-5, res, true);
      ASSERT_EQ(out.size(), 4u);
      auto y = out[0];
      auto keep = ddp::cuda::bn_nhwc_backward(dy, x, w, out[1], out[2], y, /*need_dz=*/true);
      auto over = ddp::cuda::bn_nhwc_backward(dy, x, w, out[1], out[2], y, /*need_dz=*/false);
      EXPECT_FALSE(over[3].defined());
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(equal_bits(keep[i], over[i])) << "output " << i;
      EXPECT_TRUE(equal_bits(keep[3], dy.masked_fill(y <= 0, 0)));
      if (!with_residual) {
        auto from_x = ddp::cuda::bn_nhwc_relu_backward(dy, x, w, out[1], out[2], out[3]);
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(equal_bits(keep[i], from_x[i])) << "output " << i;
        // The scale/shift it got are the forward's: y = relu(x * scale + shift).
        auto ss = out[3];
        auto yref = torch::relu(x.to(torch::kFloat) * ss[0].view({1, c, 1, 1}) + ss[1].view({1, c, 1, 1}));
        EXPECT_LE((yref.to(torch::kBFloat16).to(torch::kFloat) - y.to(torch::kFloat)).abs().max().item<double>(),
                  1e-2 * yref.abs().max().item<double>());
      }
    }
  }
}
#endif

// An output with two consumers: forward_relu_split hands the two gradients
// to the batch norm's backward, which adds them as it reads them. The
// bits must be those of autograd adding them to one output's gradient.
TEST(BatchNormNhwc, SplitOutputAddsBothGradientsAsAutogradDoes_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(8);
  auto cl = [&](torch::Tensor t) { return t.to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast); };
  for (const auto& shape : kBatchNormShapes) {
    SCOPED_TRACE(c10::str(shape));
    const int64_t c = shape[1];
    auto x = cl(torch::randn(shape, gpu) * 3 + 2), res = cl(torch::randn(shape, gpu));
    auto ga = cl(torch::randn(shape, gpu)), gb = cl(torch::randn(shape, gpu));
    auto w = torch::rand({c}, gpu) + 0.5, b = torch::randn({c}, gpu);
    struct Grads {
      torch::Tensor dx, dres, dw, db;
    };
    auto run = [&](bool split, bool second_used) {
      ddp::BatchNorm bn(c);
      bn->to(gpu);
      {
        torch::NoGradGuard no_grad;
        bn->weight.copy_(w);
        bn->bias.copy_(b);
      }
      auto xg = x.clone().requires_grad_(), rg = res.clone().requires_grad_();
      torch::Tensor y1, y2;
      if (split) {
        std::tie(y1, y2) = bn->forward_relu_split(xg, rg);
      } else {
        y1 = y2 = bn->forward_relu(xg, rg);
      }
      // Gradient ga into the first handle, gb into the second.
      auto loss = (y1 * ga).sum();
      if (second_used) loss = loss + (y2 * gb).sum();
      loss.backward();
      return Grads{xg.grad(), rg.grad(), bn->weight.grad(), bn->bias.grad()};
    };
    for (const bool second_used : {true, false}) {
      SCOPED_TRACE(second_used ? "both handles used" : "second handle unused");
      auto one = run(false, second_used), two = run(true, second_used);
      EXPECT_TRUE(equal_bits(one.dx, two.dx));
      EXPECT_TRUE(equal_bits(one.dres, two.dres));
      EXPECT_TRUE(equal_bits(one.dw, two.dw));
      EXPECT_TRUE(equal_bits(one.db, two.db));
    }
  }
}

// The same through a whole ResNet-50 step: ResNet hands each block's output
// on twice (forward_relu_split); every gradient equals the one of the plain
// path (one output, autograd adding its gradients), bit for bit.
TEST(BatchNormNhwc, ResNetGradientsEqualWithAndWithoutSplitOutputs_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(9);
  auto input = torch::randn({4, 3, 64, 64}, gpu).contiguous(at::MemoryFormat::ChannelsLast);
  auto target = torch::randint(0, 10, {4}, torch::TensorOptions().device(gpu).dtype(torch::kLong));
  auto grads = [&](bool split) {
    ddp::use_split_residual_output(split);
    torch::manual_seed(1);
    ddp::models::ResNet model(ddp::models::ResNetOptions(50).num_classes(10));
    model->to(gpu);
    for (auto& p : model->parameters())
      if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
    model->train();
    torch::Tensor loss;
    {
      ddp::compat::AutocastGuard amp(torch::kCUDA, torch::kBFloat16, true);
      loss = torch::nn::functional::cross_entropy(model->forward(input), target);
    }
    loss.backward();
    ddp::use_split_residual_output(true);
    std::vector<torch::Tensor> g;
    for (auto& p : model->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto plain = grads(false), split = grads(true);
  ASSERT_EQ(plain.size(), split.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(equal_bits(plain[i], split[i])) << "parameter " << i;
}

// Inputs the kernels do not take run through LibTorch's batch norm.
TEST(BatchNormNhwc, OtherInputsTakeLibTorchsPath_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
#ifdef DDP_WITH_CUDA_KERNELS
  const torch::Device gpu(torch::kCUDA, 0);
  auto cl = torch::randn({4, 16, 5, 5}, gpu).to(torch::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
  EXPECT_TRUE(ddp::cuda::bn_nhwc_supported(cl));
  EXPECT_FALSE(ddp::cuda::bn_nhwc_supported(cl.contiguous()));                           // NCHW
  EXPECT_FALSE(ddp::cuda::bn_nhwc_supported(cl.to(torch::kFloat)));                      // fp32
  EXPECT_FALSE(ddp::cuda::bn_nhwc_supported(cl.to(torch::kHalf)));                       // fp16: cuDNN's
  EXPECT_FALSE(ddp::cuda::bn_nhwc_supported(torch::randn({4, 12, 5, 5}, gpu).to(torch::kBFloat16)
                                                .contiguous(at::MemoryFormat::ChannelsLast)));  // C % 8
  EXPECT_FALSE(ddp::cuda::bn_nhwc_supported(cl.cpu()));
  ddp::BatchNorm bn(16);
  bn->to(gpu);
  bn->train();
  EXPECT_EQ(bn(cl.contiguous()).sizes(), cl.sizes());  // NCHW falls back and still works
#endif
}

}  // namespace
