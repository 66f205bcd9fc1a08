// A linear layer's bias gradient on CUDA: the column sums of its output's
// gradient, in fp32, at a copy's bandwidth; and a GELU's backward
// with the bias gradient of the layer before it in the same pass (and the
// exact GELU's forward, which cuBLASLt's epilogues cannot do); and
// attention's q, k and v gradients put side by side for the projection
// that made them, with its bias gradient in the same pass.
//
// Why by hand: autograd sums a [tokens, features] bf16 gradient over its
// rows with at::sum, at about 1.5 TB/s on the H200: 1.76 ms of a GPT-2 124M
// step (bench/RESULTS.md, session 11). The GELU's backward then reads and
// writes the MLP's widest activation only for the next sum to read it again,
// and the split of the attention's projection into q, k and v has a cat in
// its backward (0.60 ms of the step, session 22) whose output the bias's sum
// reads again.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp::cuda {

/// True where the kernels apply: a CUDA, contiguous bf16 tensor whose last
/// dimension is a multiple of 8, 16-byte aligned.
bool column_sum_supported(const at::Tensor& g);

/// The sums over every dimension but the last of a bf16 tensor, in fp32:
/// the bias gradient of y = x W^T + b for y's gradient g. Deterministic.
/// Written into `out` (a contiguous fp32 vector: the bias's gradient slot,
/// param_slots.h) where given.
at::Tensor column_sum(const at::Tensor& g, const at::Tensor& out = {});

/// Which GELU: the exact one (erf), or GPT-2's tanh approximation.
enum class Gelu { kErf, kTanh };

/// A GELU's backward with the column sums of its result: {dh, db} for
/// dh = dy * gelu'(h) in bf16 (as ATen's gelu_backward computes it, in fp32,
/// then rounded) and db = column_sum(dh) in fp32. dy and h: bf16 tensors of
/// one shape that column_sum_supported takes. db is written into `out`
/// where given, as column_sum's.
/// dh is written into `dh_out` where given (a contiguous bf16 tensor of h's
/// size: a block of rows of a larger one).
std::vector<at::Tensor> gelu_backward_column_sum(const at::Tensor& dy, const at::Tensor& h, Gelu form = Gelu::kErf,
                                                 const at::Tensor& out = {}, const at::Tensor& dh_out = {});

/// The backward of splitting a projection into attention's heads, with its
/// bias gradient: for parts (dq, dk, dv: 1 to 3 bf16 tensors [B, H, T, D] of
/// one shape, any strides, D a multiple of 8) {g, db}, g = [B T, n H D]
/// bf16 whose row (b, t) is part 0's heads (b, :, t, :), then part 1's, ...
/// (what the split's backward, a cat, gives the projection), and db its
/// column sums in fp32, as column_sum(g), in one pass over the parts. db is
/// written into `out` where given.
std::vector<at::Tensor> heads_column_sum(at::TensorList parts, const at::Tensor& out = {});

}  // namespace ddp::cuda
