// Cross-entropy over [N, V] logits on CUDA, forward and backward in one
// kernel each (llm.c's "fused classifier").
//
// Why by hand: GPT-2's loss runs on bf16 logits of [16*1024, 50304]. Under
// autocast LibTorch computes it in fp32: it casts the logits to fp32 (1.6 GB
// read, 3.3 GB written), runs log_softmax and nll_loss, and the backward runs
// nll's backward, log_softmax's backward and the cast back: about 25 GB of
// memory traffic, ~6 ms of a ~43 ms GPT-2 124M step on an H200. Here the
// forward reads the logits once (an online softmax: max and sum of exp in
// one pass, fp32) and keeps one fp32 log-sum-exp per row; the backward reads
// them once more and writes the gradient, optionally over the logits
// themselves: 3 x 1.6 GB in all. Where the caller will backpropagate once
// and needs the logits no more (a training step), cross_entropy_one_pass
// reads each row once into shared memory and writes the gradient over it in
// the forward: 2 x 1.6 GB, and the backward is a scale that nearly always
// has nothing to do.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp::cuda {

/// True where the kernels apply: CUDA logits of 2 dimensions [N, V], bf16,
/// fp16 or fp32, contiguous, with V >= 1 and N below 2^31; targets int64 of
/// N elements on the same device. Any V and alignment (the rows' unaligned
/// heads and tails are read element by element).
bool cross_entropy_supported(const at::Tensor& logits, const at::Tensor& targets);

/// Forward: returns {loss, lse, count}. loss is the fp32 scalar
/// sum_i (lse_i - logits[i, targets_i]) over the rows whose target is not
/// `ignore_index`, divided by their number unless `sum` (0/0 = NaN when every
/// target is ignored, as PyTorch). lse: fp32 [N], each row's log-sum-exp
/// (the backward's input); count: fp32 scalar, the rows not ignored. All on
/// the device, with no host synchronisation (CUDA-graph safe). A target
/// outside [0, V) other than ignore_index trips a device assertion.
std::vector<at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets, bool sum,
                                              int64_t ignore_index = -100);

/// Backward: dlogits[i, j] = (exp(logits[i, j] - lse_i) - [j == target_i]) *
/// grad / (sum ? 1 : count), and 0 on ignored rows, in the logits' dtype.
/// `grad` is the loss's incoming gradient (a one-element tensor on the
/// device, read there). With `in_place`, the gradient is written over
/// `logits` and returned as a tensor sharing its memory: only for callers
/// that need the logits no more; otherwise into a new tensor.
at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                  const at::Tensor& lse, const at::Tensor& count, bool sum, bool in_place,
                                  int64_t ignore_index = -100);

/// True where cross_entropy_one_pass applies: as cross_entropy_supported,
/// for bf16 or fp32 logits whose row (plus 16 bytes) fits one block's shared
/// memory on the logits' device (GPT-2's 50,304 bf16: 98 KiB, of the H200's
/// 227). Not fp16: its gradient would be rounded before any loss scale
/// multiplies it, and a mean's small values would flush to zero.
bool cross_entropy_one_pass_supported(const at::Tensor& logits, const at::Tensor& targets);

/// The forward and, for an incoming gradient of 1, the backward in one pass
/// over the logits: returns {loss, count} as cross_entropy_forward (the same
/// loss to the bit) and writes cross_entropy_backward's gradient for
/// grad = 1 over `logits` (again the same bits). Scale it with
/// scale_unless_one when the loss's gradient arrives.
std::vector<at::Tensor> cross_entropy_one_pass(const at::Tensor& logits, const at::Tensor& targets, bool sum,
                                               int64_t ignore_index = -100);

/// x *= grad in place (bf16 or fp32, contiguous), with `grad` one element
/// read on the device; when it is exactly 1 the kernel returns at once. The
/// result is rounded twice (once in the one-pass forward, once here), so
/// a gradient scaled by other than a power of 2 may be one unit in the last
/// place off the two-pass backward's.
void scale_unless_one(const at::Tensor& grad, const at::Tensor& x);

}  // namespace ddp::cuda
