// Cross-entropy through ddptrain's fused CUDA kernels
// (include/ddp/cuda/cross_entropy.h), as an autograd function.
//
// next_token_loss (lm_task.h) takes this path for CUDA logits in builds with
// the kernels, unless --ce-kernel native (use_fused_cross_entropy(false));
// elsewhere it runs LibTorch's cross_entropy.
#pragma once

#include <torch/torch.h>

namespace ddp {

/// True when this build has the kernels (a CUDA LibTorch build).
bool have_fused_cross_entropy();
/// Whether next_token_loss uses the kernels where they apply (default: yes).
void use_fused_cross_entropy(bool on);
bool fused_cross_entropy_enabled();

/// Whether an overwriting fused_cross_entropy() runs forward and backward in
/// one pass (default: yes, where it applies; --ce-kernel two-pass: no).
void use_one_pass_cross_entropy(bool on);

/// Whether fused_cross_entropy() takes these: [N, V] contiguous CUDA logits
/// (bf16, fp16 or fp32) and N int64 targets on the same device, in a build
/// with the kernels (whatever use_fused_cross_entropy says).
bool fused_cross_entropy_applies(const torch::Tensor& logits, const torch::Tensor& targets);

/// F::cross_entropy(logits, targets) with ignore_index -100: the mean over
/// the targets not ignored, or their sum with `sum`; an fp32 scalar,
/// differentiable with respect to the logits. The gradient comes in the
/// logits' dtype, computed in fp32 from the logits' own values.
///
/// With `overwrite_logits`, the backward writes the gradient over the
/// logits' memory instead of allocating a second [N, V] tensor: only for a
/// caller that owns the logits and reads them no more (nor anything that
/// shares their memory) once the loss is computed. Backward runs at most
/// once then (retain_graph is refused). Where the logits require a gradient
/// and cuda::cross_entropy_one_pass_supported says so (bf16 or fp32 rows
/// that fit in shared memory), the forward already writes the gradient over
/// them, reading the logits once in all: fused_cross_entropy_takes_one_pass.
torch::Tensor fused_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, bool sum = false,
                                  bool overwrite_logits = false);

/// Whether fused_cross_entropy(logits, targets, sum, overwrite_logits) takes
/// the one-pass path (see there).
bool fused_cross_entropy_takes_one_pass(const torch::Tensor& logits, const torch::Tensor& targets,
                                        bool overwrite_logits);

}  // namespace ddp
