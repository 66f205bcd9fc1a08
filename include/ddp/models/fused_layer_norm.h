// The GPT's residual add + LayerNorm, through ddptrain's fused CUDA kernels
// (cuda/layer_norm.h) where they apply, else LibTorch's ops.
//
// They apply on CUDA under bf16 autocast, to an fp32 residual stream, when
// --ln-kernel auto turned them on (use_fused_layer_norm). Then the
// normalised output comes back in bf16, the dtype the next matmul casts it
// to anyway. ddptrain turns them on unless --ln-kernel native; in a program
// of your own they stay off until use_fused_layer_norm(true). On the H200
// they take config (e)'s step from 38.70 to 35.46 ms, with the same
// validation loss (bench/RESULTS.md, session 11).
#pragma once

#include <torch/torch.h>

#include <utility>

namespace ddp::models {

/// --ln-kernel: auto turns the kernels on (process-wide), native off.
void use_fused_layer_norm(bool on);
bool fused_layer_norm_enabled();
/// True when this build has the kernels (a CUDA build).
bool have_fused_layer_norm();

/// {x + branch, LayerNorm(x + branch)} over the last dimension (eps as
/// torch.layer_norm's); with `branch` undefined, {x, LayerNorm(x)}. With the
/// kernels the LayerNorm comes back in bf16, else as LibTorch gives it.
///
/// `branch_bias`, where defined, is the bias of the linear layer whose
/// output the branch is, added there with its gradient left to this
/// function (fused_linear.h: BiasGrad::kInTheAdd): its gradient is the
/// column sums of the branch's gradient, which the kernels take in the
/// LayerNorm's backward pass instead of a pass of their own. The forward's
/// values do not depend on it (where the kernels do not apply, LibTorch's
/// ops add branch_bias - branch_bias.detach(), a zero that autograd
/// differentiates).
std::pair<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& branch,
                                                       const torch::Tensor& weight, const torch::Tensor& bias,
                                                       double eps = 1e-5, const torch::Tensor& branch_bias = {});

/// Whether add_layer_norm(x, branch, ...) takes the kernels now.
bool fused_layer_norm_applies(const torch::Tensor& x, const torch::Tensor& branch, const torch::Tensor& weight,
                              const torch::Tensor& bias);

}  // namespace ddp::models
