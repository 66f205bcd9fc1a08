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
// themselves: 3 x 1.6 GB in all.
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

}  // namespace ddp::cuda
