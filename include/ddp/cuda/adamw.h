// One Adam or AdamW step over a flat fp32 buffer on CUDA, in fp32, with the
// gradient clipping's coefficient applied in the same pass and the updated
// parameters also written in bf16: the next training step's bf16 copy
// (dist/param_slots.h).
//
// Why by hand: LibTorch's fused AdamW takes a clipping scale only as a
// divisor it applies in fp64 (0.19 ms more of a GPT-2 124M step on an
// H100), and the step's bf16 copy is then a separate cast that reads every
// parameter again (0.25 ms). Here both are in the optimizer's one pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp::cuda {

struct AdamStep {
  double beta1 = 0.9, beta2 = 0.999, weight_decay = 0, eps = 1e-8;
  bool decoupled = true;  // AdamW; false: Adam's L2 term added to the gradient
  // false: the clipped gradient is used but not stored back (g stays as
  // it was), for a caller that drops the gradients after the step: a
  // write of 4 bytes a parameter less.
  bool store_clipped_grad = true;
};

/// p, g, m, v: contiguous CUDA fp32 tensors of one size (the flat
/// parameters, gradients and moments). step: the step count, already
/// incremented, and lr: one float each on the device. coef (one float, or
/// undefined: 1): the gradient is multiplied by it first and stored back
/// multiplied, as clip_grad_norm_ leaves it (unless o.store_clipped_grad
/// is false). found_inf (one float, or
/// undefined): non-zero leaves p, g, m and v as they were (p16 still
/// receives p). p16 (bf16 of p's size, or undefined): receives the new
/// parameters rounded to bf16, the same bits as p.to(bf16).
void adam_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               const at::Tensor& step, const at::Tensor& lr, const AdamStep& o, const at::Tensor& coef,
               const at::Tensor& found_inf, const at::Tensor& p16);

}  // namespace ddp::cuda
