// The fused cross-entropy as an autograd function (fused_cross_entropy.h).

#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/train/fused_cross_entropy.h"

#include <atomic>

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/cross_entropy.h"
#endif

namespace ddp {
namespace {

std::atomic<bool> g_fused_ce{true};
std::atomic<bool> g_one_pass{true};

#ifdef DDP_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FusedCrossEntropyFn : torch::autograd::Function<FusedCrossEntropyFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor targets, bool sum,
                               bool overwrite_logits) {
    ctx->saved_data["sum"] = sum;
    ctx->saved_data["overwritten"] = false;
    if (fused_cross_entropy_takes_one_pass(logits, targets, overwrite_logits)) {
      // The gradient for an incoming 1 goes over the logits now; the
      // backward only scales it (and nearly always has nothing to do).
      auto out = cuda::cross_entropy_one_pass(logits, targets, sum);
      // As an in-place op would: a node that saved these logits now fails
      // on unpacking instead of reading the gradient as logits.
      logits.unsafeGetTensorImpl()->bump_version();
      ctx->save_for_backward({logits});
      ctx->saved_data["one_pass"] = true;
      return out[0];
    }
    ctx->saved_data["one_pass"] = false;
    auto out = cuda::cross_entropy_forward(logits, targets, sum);
    // {loss, lse, count}: the backward needs the logits, each row's
    // log-sum-exp and the number of targets (for the mean).
    ctx->save_for_backward({logits, targets, out[1], out[2]});
    ctx->saved_data["overwrite"] = overwrite_logits;
    return out[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // A second backward (retain_graph) would read the gradient as logits
    // (or scale it twice).
    TORCH_CHECK(!ctx->saved_data["overwritten"].toBool(),
                "fused_cross_entropy: backward ran twice after overwriting the logits with their gradient; "
                "pass overwrite_logits=false to backpropagate more than once");
    auto s = ctx->get_saved_variables();
    if (ctx->saved_data["one_pass"].toBool()) {
      ctx->saved_data["overwritten"] = true;
      auto dlogits = s[0].detach();
      cuda::scale_unless_one(grads[0], dlogits);
      dlogits.unsafeGetTensorImpl()->bump_version();
      return {dlogits, torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    const bool overwrite = ctx->saved_data["overwrite"].toBool();
    // The gradient is written through the saved tensor's memory (detached:
    // a gradient carries no history of its own).
    auto dlogits = cuda::cross_entropy_backward(grads[0], s[0].detach(), s[1], s[2], s[3],
                                                ctx->saved_data["sum"].toBool(), overwrite);
    if (overwrite) {
      ctx->saved_data["overwritten"] = true;
      // As an in-place op would: any other node that saved these logits now
      // fails on unpacking ("modified by an inplace operation") instead of
      // reading the gradient as logits.
      dlogits.unsafeGetTensorImpl()->bump_version();
    }
    return {dlogits, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

bool have_fused_cross_entropy() {
#ifdef DDP_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

void use_fused_cross_entropy(bool on) { g_fused_ce.store(on); }
bool fused_cross_entropy_enabled() { return g_fused_ce.load(); }
void use_one_pass_cross_entropy(bool on) { g_one_pass.store(on); }

bool fused_cross_entropy_takes_one_pass(const torch::Tensor& logits, const torch::Tensor& targets,
                                        bool overwrite_logits) {
#ifdef DDP_WITH_CUDA_KERNELS
  return overwrite_logits && g_one_pass.load() && logits.requires_grad() &&
         cuda::cross_entropy_one_pass_supported(logits, targets);
#else
  (void)logits, (void)targets, (void)overwrite_logits;
  return false;
#endif
}

bool fused_cross_entropy_applies(const torch::Tensor& logits, const torch::Tensor& targets) {
#ifdef DDP_WITH_CUDA_KERNELS
  return cuda::cross_entropy_supported(logits, targets);
#else
  (void)logits, (void)targets;
  return false;
#endif
}

torch::Tensor fused_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, bool sum,
                                  bool overwrite_logits) {
#ifdef DDP_WITH_CUDA_KERNELS
  TORCH_CHECK(fused_cross_entropy_applies(logits, targets), "fused_cross_entropy: unsupported logits ", logits.sizes(),
              " ", logits.scalar_type(), " on ", logits.device(), " or targets ", targets.sizes(), " ",
              targets.scalar_type());
  return FusedCrossEntropyFn::apply(logits, targets, sum, overwrite_logits);
#else
  (void)logits, (void)targets, (void)sum, (void)overwrite_logits;
  TORCH_CHECK(false, "fused_cross_entropy: this build has no CUDA kernels");
  return {};
#endif
}

}  // namespace ddp
