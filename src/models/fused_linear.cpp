// Linear layers with kernel-made bias gradients (fused_linear.h).

#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/models/fused_linear.h"

#include <atomic>

#include "ddp/compat.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/linear_bias.h"
#endif

namespace ddp::models {
namespace {

std::atomic<bool> g_fused_linear{false};

#ifdef DDP_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = x W^T + b (then gelu(y) with `gelu`), x and W in bf16 (cast by the
// caller, so that W's cast is on autograd's tape as autocast's is), b the
// fp32 parameter. Backward: dx = g W and dW = g^T x, the matmuls autograd
// runs for at::linear; db = the column sums of g in fp32; with `gelu`, g is
// first the GELU's backward, in the same pass as db.
struct LinearBiasFn : torch::autograd::Function<LinearBiasFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w, torch::Tensor b, bool gelu) {
    auto h = at::linear(x, w, b.to(x.scalar_type()));
    ctx->saved_data["gelu"] = gelu;
    if (!gelu) {
      ctx->save_for_backward({x, w});
      return h;
    }
    ctx->save_for_backward({x, w, h});
    return at::gelu(h);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto& x = s[0];
    const auto& w = s[1];
    auto g = grads[0].to(x.scalar_type()).contiguous();
    if (!cuda::column_sum_supported(g)) g = g.clone();  // a view at an unaligned offset
    torch::Tensor db;
    if (ctx->saved_data["gelu"].toBool()) {
      auto r = cuda::gelu_backward_column_sum(g, s[2]);
      g = r[0];
      db = r[1];
    } else {
      db = cuda::column_sum(g);
    }
    const int64_t out = w.size(0), in = w.size(1);
    auto g2 = g.view({-1, out});
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = at::mm(g2, w).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = at::mm(g2.t(), x.reshape({-1, in}));
    return {dx, dw, db, torch::Tensor()};
  }
};

torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, bool gelu) {
  const auto dtype = torch::kBFloat16;
  return LinearBiasFn::apply(x.to(dtype), weight.to(dtype), bias, gelu);
}
#endif

}  // namespace

void use_fused_linear(bool on) { g_fused_linear.store(on); }
bool fused_linear_enabled() { return g_fused_linear.load(); }

bool fused_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  return g_fused_linear.load() && x.is_cuda() && x.dim() >= 2 && bias.defined() &&
         bias.scalar_type() == torch::kFloat && weight.dim() == 2 && weight.size(0) % 8 == 0 &&
         x.size(-1) == weight.size(1) && compat::autocast_dtype(c10::DeviceType::CUDA) == torch::kBFloat16;
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

torch::Tensor linear_bias(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, weight, bias)) return apply(x, weight, bias, false);
#endif
  return torch::linear(x, weight, bias);
}

torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, weight, bias)) return apply(x, weight, bias, true);
#endif
  return torch::gelu(torch::linear(x, weight, bias));
}

}  // namespace ddp::models
