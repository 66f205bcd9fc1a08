// Training-mode batch norm for channels-last bf16 activations on CUDA.
//
// Why by hand: for bf16, LibTorch runs ATen's own channels-last kernels
// (cuDNN refuses bf16 batch norm), and batch norm was the largest share of a
// ResNet-50 step. On an H200 (bench/bn_kernels.py, 2026-12-02) one
// ResNet-50's batch norms, forward and backward, take 22.5 ms here against
// ATen's 29.1 ms; fp16 is left to cuDNN's NHWC kernels (18.5 ms).
//
// The kernels make the minimum number of passes over memory (forward: read
// x for the statistics, read x and write y; backward: read x and dy for two
// sums, read them again and write dx), with 16-byte loads and fp32
// arithmetic (statistics as sums about a pivot taken from the data). Fused
// variants add a residual and apply a ReLU in the same passes.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp::cuda {

/// True where the kernels apply: a CUDA, 4-D, channels-last-contiguous bf16
/// tensor with a multiple of 8 channels and 16-byte-aligned data.
bool bn_nhwc_supported(const at::Tensor& x);

/// Forward over the batch: returns {y, mean, invstd, scale_shift} (fp32
/// [C], [C] and [2, C]: y = x * scale + shift before any residual or ReLU),
/// and updates the running statistics (fp32, unbiased variance) in place.
/// With `residual` (a tensor like x), y = bn(x) + residual; with `relu`,
/// y = max(that, 0): the residual networks' tails in one pass, rounded as
/// the separate ops round (bn's output to bf16 before the add).
std::vector<at::Tensor> bn_nhwc_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                        const at::Tensor& running_mean, const at::Tensor& running_var,
                                        double momentum, double eps, const at::Tensor& residual = {},
                                        bool relu = false);

/// Backward: returns {dx, dweight, dbias, dz} for the forward's saved
/// mean/invstd. With `relu_output` (the forward's y when it applied the
/// ReLU), dy is first masked where y <= 0. dz is the gradient after the
/// mask, which is also the residual's gradient (dy itself without a mask).
/// need_dz = false (with relu_output) says the caller has no use for dz:
/// dx is then written over it (one activation-sized buffer less) and the
/// returned dz is undefined. Results are the same bits either way.
/// dy2 (with relu_output): a second gradient of the same output, from a
/// second consumer; the kernels use bf16(dy + dy2), the bits autograd's add
/// of the two gives, without a pass of their own. Either may be undefined.
std::vector<at::Tensor> bn_nhwc_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                         const at::Tensor& mean, const at::Tensor& invstd,
                                         const at::Tensor& relu_output = {}, bool need_dz = true,
                                         const at::Tensor& dy2 = {});

/// Backward of relu(bn(x)) with no residual, from the forward's x and
/// scale_shift instead of its output: the ReLU mask is recomputed (bit for
/// bit the forward's y > 0), so the forward need not keep y alive, and no
/// dz is written. Returns {dx, dweight, dbias}, the same bits as
/// bn_nhwc_backward(dy, x, weight, mean, invstd, y).
std::vector<at::Tensor> bn_nhwc_relu_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& mean, const at::Tensor& invstd,
                                              const at::Tensor& scale_shift);

}  // namespace ddp::cuda
