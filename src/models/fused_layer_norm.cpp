// Residual add + LayerNorm as autograd functions (fused_layer_norm.h).

#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/models/fused_layer_norm.h"

#include <atomic>

#include "ddp/compat.h"
#include "ddp/dist/param_slots.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/layer_norm.h"
#endif

namespace ddp::models {
namespace {

std::atomic<bool> g_fused_ln{false};

#ifdef DDP_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// An autograd function's tensor inputs must all be defined (LibTorch 2.x
// refuses an undefined one: FusedLayerNorm.MatchesLibTorchForwardAndBackward_CUDA),
// so a missing bias enters as zeros with with_bias false: the kernels then
// ignore it, and it gets no gradient.
torch::Tensor bias_or_zeros(const torch::Tensor& bias, const torch::Tensor& weight) {
  return bias.defined() ? bias : torch::zeros_like(weight);
}

// Where input `i`'s gradient goes: its slot in the flat gradient buffer
// when it is a parameter that has one (param_slots.h), else undefined (the
// kernels then make a fresh tensor). `present` false: no such input.
torch::Tensor ln_gradient_slot(AutogradContext* ctx, size_t i, const torch::Tensor& param, bool present = true) {
  return present && ctx->needs_input_grad(i) ? param_slots::take_gradient_slot(param) : torch::Tensor();
}

// {x + branch, LayerNorm(x + branch) in bf16}.
struct AddLayerNormFn : torch::autograd::Function<AddLayerNormFn> {
  static variable_list forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor branch, torch::Tensor weight,
                               torch::Tensor bias, double eps, bool with_bias) {
    // {sum, out, mean, rstd}
    auto r = cuda::add_layer_norm_forward(x, branch, weight, with_bias ? bias : torch::Tensor(), eps);
    ctx->save_for_backward({r[0], r[2], r[3], weight, bias});
    ctx->saved_data["bias"] = with_bias;
    return {r[0], r[1]};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const bool with_bias = ctx->saved_data["bias"].toBool();
    if (!grads[1].defined()) return {grads[0], grads[0].defined() ? grads[0].to(torch::kBFloat16) : torch::Tensor(),
                                     torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    auto g = cuda::add_layer_norm_backward(grads[1], grads[0], s[0], s[1], s[2], s[3], /*with_branch=*/true, with_bias,
                                           ln_gradient_slot(ctx, 2, s[3]), ln_gradient_slot(ctx, 3, s[4], with_bias));
    return {g[0], g[1], g[2], g[3], torch::Tensor(), torch::Tensor()};
  }
};

// LayerNorm(x) in bf16, for the first block (no branch to add yet).
struct LayerNormFn : torch::autograd::Function<LayerNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                               double eps, bool with_bias) {
    auto r = cuda::add_layer_norm_forward(x, torch::Tensor(), weight, with_bias ? bias : torch::Tensor(), eps);
    ctx->save_for_backward({x, r[2], r[3], weight, bias});
    ctx->saved_data["bias"] = with_bias;
    return r[1];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const bool with_bias = ctx->saved_data["bias"].toBool();
    auto g = cuda::add_layer_norm_backward(grads[0], torch::Tensor(), s[0], s[1], s[2], s[3], /*with_branch=*/false,
                                           with_bias, ln_gradient_slot(ctx, 1, s[3]),
                                           ln_gradient_slot(ctx, 2, s[4], with_bias));
    return {g[0], g[2], g[3], torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

void use_fused_layer_norm(bool on) { g_fused_ln.store(on); }
bool fused_layer_norm_enabled() { return g_fused_ln.load(); }

bool have_fused_layer_norm() {
#ifdef DDP_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

bool fused_layer_norm_applies(const torch::Tensor& x, const torch::Tensor& branch, const torch::Tensor& weight,
                              const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  return fused_layer_norm_enabled() && x.is_cuda() &&
         compat::autocast_dtype(c10::DeviceType::CUDA) == std::optional<c10::ScalarType>(torch::kBFloat16) &&
         cuda::add_layer_norm_supported(x, branch, weight, bias);
#else
  (void)x, (void)branch, (void)weight, (void)bias;
  return false;
#endif
}

std::pair<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& branch,
                                                       const torch::Tensor& weight, const torch::Tensor& bias,
                                                       double eps) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_layer_norm_applies(x, branch, weight, bias)) {
    if (!branch.defined()) return {x, LayerNormFn::apply(x, weight, bias_or_zeros(bias, weight), eps, bias.defined())};
    auto r = AddLayerNormFn::apply(x, branch, weight, bias_or_zeros(bias, weight), eps, bias.defined());
    return {r[0], r[1]};
  }
#endif
  auto sum = branch.defined() ? x + branch : x;
  return {sum, torch::layer_norm(sum, {weight.size(0)}, weight, bias, eps)};
}

}  // namespace ddp::models
