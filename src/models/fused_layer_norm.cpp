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

// {x + branch, LayerNorm(x + branch) in bf16}. With `branch_sums`,
// branch_bias gets the column sums of the branch's gradient from the same
// backward pass (without, it is the weight again, unused).
struct AddLayerNormFn : torch::autograd::Function<AddLayerNormFn> {
  static variable_list forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor branch, torch::Tensor weight,
                               torch::Tensor bias, torch::Tensor branch_bias, double eps, bool with_bias,
                               bool branch_sums) {
    // {sum, out, mean, rstd}
    auto r = cuda::add_layer_norm_forward(x, branch, weight, with_bias ? bias : torch::Tensor(), eps);
    // An unused output's gradient stays undefined (the backward takes that),
    // not a tensor of zeros to write and read: the GPT's last sum is unused.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({r[0], r[2], r[3], weight, bias, branch_bias});
    ctx->saved_data["bias"] = with_bias;
    ctx->saved_data["branch_sums"] = branch_sums;
    return {r[0], r[1]};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const bool with_bias = ctx->saved_data["bias"].toBool();
    const bool sums = ctx->saved_data["branch_sums"].toBool() && ctx->needs_input_grad(4);
    if (!grads[1].defined()) {  // the LayerNorm's output unused: the sum's gradient goes to both
      auto dbranch = grads[0].defined() ? grads[0].to(torch::kBFloat16) : torch::Tensor();
      torch::Tensor dbb;
      if (sums && dbranch.defined()) dbb = dbranch.reshape({-1, dbranch.size(-1)}).sum(0, false, torch::kFloat);
      return {grads[0], dbranch, torch::Tensor(), torch::Tensor(), dbb, torch::Tensor(), torch::Tensor(),
              torch::Tensor()};
    }
    auto g = cuda::add_layer_norm_backward(grads[1], grads[0], s[0], s[1], s[2], s[3], /*with_branch=*/true, with_bias,
                                           ln_gradient_slot(ctx, 2, s[3]), ln_gradient_slot(ctx, 3, s[4], with_bias),
                                           sums, ln_gradient_slot(ctx, 4, s[5], sums));
    return {g[0], g[1], g[2], g[3], g[4], torch::Tensor(), torch::Tensor(), torch::Tensor()};
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
                                                       double eps, const torch::Tensor& branch_bias) {
  TORCH_CHECK(!branch_bias.defined() || (branch.defined() && branch_bias.dim() == 1 &&
                                         branch_bias.size(0) == branch.size(-1)),
              "add_layer_norm: branch_bias must be a vector of the branch's width, and needs a branch");
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_layer_norm_applies(x, branch, weight, bias)) {
    if (!branch.defined()) return {x, LayerNormFn::apply(x, weight, bias_or_zeros(bias, weight), eps, bias.defined())};
    const bool sums = branch_bias.defined() && branch_bias.scalar_type() == torch::kFloat &&
                      branch_bias.device() == x.device();
    if (sums || !branch_bias.defined()) {
      auto r = AddLayerNormFn::apply(x, branch, weight, bias_or_zeros(bias, weight), sums ? branch_bias : weight, eps,
                                     bias.defined(), sums);
      return {r[0], r[1]};
    }
  }
#endif
  auto sum = branch.defined() ? x + branch : x;
  // The branch bias's gradient, the column sums of sum's: through a zero
  // that autograd differentiates (the forward's values are unchanged).
  if (branch_bias.defined()) sum = sum + (branch_bias - branch_bias.detach());
  return {sum, torch::layer_norm(sum, {weight.size(0)}, weight, bias, eps)};
}

}  // namespace ddp::models
