// A parameter's places in the training step's flat buffers (grad_sync.h),
// for kernels that read its bf16 copy or write its gradient where the
// optimizer reads it: ddptrain's linear and LayerNorm kernels under
// --amp bf16 (fused_linear.h, fused_layer_norm.h).
//
// Why: under autocast every weight is cast to bf16 at each use, its bf16
// gradient is cast back to fp32, and autograd's fp32 gradient is copied into
// the flat buffer: three kernels per parameter and step, about 300 in a
// GPT-2 124M step, each a pass over the weight. Here the step casts all
// parameters once (one kernel per flat buffer), and a weight's gradient is
// written once, in fp32, into its slice (as Megatron-LM's gradient
// accumulation fusion writes its main gradients).
//
// A parameter GradSync does not hold (another model, a frozen weight), or a
// call outside a training step, gets undefined tensors: the caller then
// takes the ordinary path. Both functions are safe to call from autograd's
// threads.
#pragma once

#include "ddp/compat.h"

namespace ddp::param_slots {

/// The parameter's bf16 copy, made from the parameters at the start of the
/// training step and valid until its backward ends (the optimizer then
/// changes the parameters). Undefined outside a step under --amp bf16, for
/// a parameter of another dtype, or on the first step that asks (the copy
/// is made from the next step on).
torch::Tensor bf16_copy(const torch::Tensor& param);

/// Where to write the parameter's whole gradient of this backward, and the
/// tensor to return from backward as that gradient: a fresh
/// tensor (not a view, so autograd adopts it as .grad without a copy) over
/// the parameter's slice of the flat gradient buffer, with the parameter's
/// shape and dtype. Handed out once per parameter and step, and only while
/// its .grad is none (the first micro-batch after zero_grad(set_to_none));
/// undefined otherwise: then compute a tensor of your own, which autograd
/// adds to the others or copies as usual. A second use of the same
/// parameter in one backward (a tied weight) gets undefined, so autograd
/// sums the two gradients.
torch::Tensor take_gradient_slot(const torch::Tensor& param);

}  // namespace ddp::param_slots
