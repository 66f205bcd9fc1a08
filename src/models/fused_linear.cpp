// Linear layers with kernel-made bias gradients (fused_linear.h).

#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/models/fused_linear.h"

#include <atomic>

#include "ddp/compat.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/gemm_gelu.h"
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

// z = gelu_tanh(x W1^T + b1) W2^T + b2, x and the weights in bf16 (cast by
// the caller), the biases the fp32 parameters. Forward: the first matmul
// with cuBLASLt's GELU_AUX_BIAS epilogue (it keeps pre = x W1^T + b1), the
// second as at::linear. Backward: db2 = column sums of g; dW2 = g^T y;
// dh = (g W2) * gelu_tanh'(pre) and db1, its column sums, in one pass after
// the matmul; dW1 = dh^T x; dx = dh W1.
struct MlpGeluTanhFn : torch::autograd::Function<MlpGeluTanhFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w1, torch::Tensor b1,
                               torch::Tensor w2, torch::Tensor b2) {
    const int64_t in = x.size(-1);
    auto x2 = x.reshape({-1, in}).contiguous();
    auto r = cuda::linear_gelu_tanh(x2, w1, b1.to(x.scalar_type()));
    auto z = at::linear(r[0], w2, b2.to(x.scalar_type()));
    ctx->save_for_backward({x2, w1, w2, r[0], r[1]});
    auto sizes = x.sizes().vec();
    sizes.back() = w2.size(0);
    return z.view(sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &x2 = s[0], &w1 = s[1], &w2 = s[2], &y = s[3], &pre = s[4];
    auto g = grads[0].to(x2.scalar_type()).reshape({-1, w2.size(0)}).contiguous();
    if (!cuda::column_sum_supported(g)) g = g.clone();  // a view at an unaligned offset
    torch::Tensor db2, dw2, dw1;
    if (ctx->needs_input_grad(4)) db2 = cuda::column_sum(g);
    if (ctx->needs_input_grad(3)) dw2 = at::mm(g.t(), y);
    auto r = cuda::gelu_backward_column_sum(at::mm(g, w2), pre, cuda::Gelu::kTanh);
    const auto& dh = r[0];
    if (ctx->needs_input_grad(1)) dw1 = at::mm(dh.t(), x2);
    torch::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      auto sizes = grads[0].sizes().vec();
      sizes.back() = w1.size(1);
      dx = at::mm(dh, w1).view(sizes);
    }
    return {dx, dw1, r[1], dw2, db2};
  }
};
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

torch::Tensor mlp_gelu_tanh(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                            const torch::Tensor& w2, const torch::Tensor& b2) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, w1, b1) && x.size(-1) % 8 == 0 && b2.defined() && b2.scalar_type() == torch::kFloat &&
      w2.dim() == 2 && w2.size(0) % 8 == 0 && w2.size(1) == w1.size(0) && cuda::gemm_gelu_available()) {
    const auto dtype = torch::kBFloat16;
    return MlpGeluTanhFn::apply(x.to(dtype), w1.to(dtype), b1, w2.to(dtype), b2);
  }
#endif
  return torch::linear(torch::gelu(torch::linear(x, w1, b1), "tanh"), w2, b2);
}

torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, weight, bias)) return apply(x, weight, bias, true);
#endif
  return torch::gelu(torch::linear(x, weight, bias));
}

}  // namespace ddp::models
