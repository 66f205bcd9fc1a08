// 2-D max pooling over channels-last activations on CUDA, for the ResNet
// stem (kernel 3, stride 2, padding 1 over [N, 64, 112, 112]).
//
// Why by hand: ATen's channels-last max pool stores the argmax as an int64
// per output element (411 MB for ResNet-50's stem at batch 256, as much as
// the bf16 activation itself) and its backward took 1.83 ms on an H200.
// Here the argmax is a uint8 offset inside the window (8x less), and
// backward is a gather: each input element sums the gradients of the (at
// most 4, for k3 s2) outputs whose window holds it and whose argmax points
// at it, so no atomics, no zero-fill pass, and deterministic results.
//
// Semantics are ATen's channels-last CUDA kernel's, bit for bit: the first
// maximum in window scan order (rows, then columns) wins a tie; a NaN counts
// as a maximum (the last NaN in scan order wins, and the output is NaN); a
// window with nothing above -inf (all -inf) outputs -inf and points at the
// plane's element (0, 0), as ATen's index 0 does, so its gradient reaches
// that element only when the window holds it, and is dropped otherwise.
// Backward sums in fp32 in ATen's order (output rows, then columns).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp::cuda {

/// True where the kernels apply to an input x and pooling parameters: a
/// CUDA, 4-D, channels-last-contiguous bf16 or fp32 tensor whose channels
/// fill 16-byte vectors (C % 8 for bf16, C % 4 for fp32), 16-byte-aligned
/// data, kernel * kernel <= 255, 0 <= padding <= kernel / 2, stride >= 1, a
/// non-empty output (no dilation, floor mode).
bool max_pool_nhwc_supported(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding);

/// Forward: returns {y, argmax}: y [N, C, OH, OW] channels-last like x,
/// OH = (H + 2 * padding - kernel) / stride + 1 (likewise OW), and argmax,
/// uint8 [N, OH, OW, C] (contiguous): the winner's offset in the window,
/// row * kernel + column, counted from the padded window's corner, or 255
/// for "no element" (see above).
std::vector<at::Tensor> max_pool_nhwc_forward(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding);

/// Backward: dx [N, C, H, W] channels-last (dtype of dy) from dy (made
/// channels-last contiguous if it is not) and the forward's argmax; H and W
/// are the input's (several input sizes share an output size).
at::Tensor max_pool_nhwc_backward(const at::Tensor& dy, const at::Tensor& argmax, int64_t H, int64_t W,
                                  int64_t kernel, int64_t stride, int64_t padding);

}  // namespace ddp::cuda
