// LayerNorm over the last dimension with the residual add fused in, for a
// Transformer's fp32 residual stream under bf16 autocast (llm.c's "fused
// residual forward"): sum = x + branch and out = LayerNorm(sum) in one pass,
// out written in bf16 for the next matmul.
//
// Why by hand: under autocast LibTorch runs the add (fp32 x + bf16 branch,
// a mixed-dtype pass), layer_norm in fp32 (its output in fp32), and then the
// matmul's cast of that output to bf16: three passes that read and write
// 24 bytes an element, and as many again backward. Here the forward reads x
// (4 bytes) and the branch (2) and writes sum (4) and out (2); the backward
// reads out's gradient, sum's gradient and sum, and writes both inputs'
// gradients. Statistics are fp32 and two-pass, as LibTorch's.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <vector>

namespace ddp::cuda {

/// True where the kernels apply: x fp32 CUDA contiguous with last dimension
/// C >= 1; branch (if defined) bf16 of x's shape, contiguous, same device;
/// weight fp32 [C] and bias (if defined) fp32 [C], contiguous, same device.
bool add_layer_norm_supported(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                              const at::Tensor& bias);

/// True where the forward and the backward take the vectorised kernels: a
/// width of 128 k columns, k <= 6 (GPT-2's 768 among them), and every
/// defined tensor 16-byte aligned (forward: x, branch, weight, bias;
/// backward: dout, dsum, sum, weight). Elsewhere the scalar kernels run.
bool add_layer_norm_vectorised(int64_t cols, std::initializer_list<at::Tensor> tensors);

/// Forward: returns {sum, out, mean, rstd}. sum = x + branch (fp32; x itself
/// when branch is undefined); out = (sum - mean) * rstd * weight + bias in
/// bf16; mean and rstd fp32 [rows], rstd = 1 / sqrt(var + eps) with the
/// biased variance (as torch.layer_norm).
std::vector<at::Tensor> add_layer_norm_forward(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                                               const at::Tensor& bias, double eps);

/// Backward: returns {dx, dbranch, dweight, dbias, dbranch_sum}. dx (fp32) = LayerNorm's
/// input gradient from dout (bf16) plus dsum (fp32, may be undefined: zero);
/// dbranch = dx in bf16 when `with_branch`, else undefined; dbias undefined
/// when `with_bias` is false. dweight and dbias are summed over the rows in
/// a fixed order (deterministic), into dweight_out and dbias_out (contiguous
/// fp32 vectors: gradient slots, param_slots.h) where given. `sum` is the
/// forward's sum.
///
/// With `branch_sums` (and `with_branch`) a fifth result: dbranch's column
/// sums in fp32, the sums of its bf16 values over the rows (the bias
/// gradient of the linear layer whose output was the branch, as column_sum
/// in linear_bias.h gives it), from the same pass; into dbranch_sum_out
/// where given. Else the fifth is undefined.
std::vector<at::Tensor> add_layer_norm_backward(const at::Tensor& dout, const at::Tensor& dsum, const at::Tensor& sum,
                                                const at::Tensor& mean, const at::Tensor& rstd,
                                                const at::Tensor& weight, bool with_branch, bool with_bias,
                                                const at::Tensor& dweight_out = {}, const at::Tensor& dbias_out = {},
                                                bool branch_sums = false, const at::Tensor& dbranch_sum_out = {});

}  // namespace ddp::cuda
