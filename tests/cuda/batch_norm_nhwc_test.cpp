// ddptrain's channels-last batch-norm kernels against LibTorch's batch norm,
// through ddp::BatchNorm (the path models take), forward and backward.
#include "ddp/dist/sync_batchnorm.h"
#include "support/testing.h"

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
  const std::vector<std::vector<int64_t>> shapes{{32, 64, 28, 28}, {16, 256, 14, 14}, {8, 2048, 7, 7},
                                                 {3, 8, 5, 7},     {2, 24, 1, 1},     {5, 96, 9, 3}};
  {
    const auto dtype = torch::kBFloat16;
    const double eps = 1.0 / 128;  // one unit of bf16 rounding
    for (const auto& shape : shapes) {
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
