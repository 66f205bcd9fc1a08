// The GPT's linear layers as cuBLASLt matmuls, each with its algorithm
// chosen by timing (set_gemm_tuning): the forward with its bias in the
// epilogue, the input and weight gradients, and for the MLP's first layer
// the GELU in the epilogue both ways.
//
// Why: cuBLASLt's first heuristic choice, which LibTorch takes, is not
// always its fastest; on an H100 the tuned choices took config (e)'s step
// (GPT-2 124M, bf16) from 32.08 to 31.45-31.77 ms (bench/RESULTS.md,
// session 25), and the neighbours' search a few calls further (session 26:
// the output head's input gradient 1.58 -> 1.50 ms, c_fc's weight gradient
// 0.122 -> 0.106 ms a layer; in the whole step within run-to-run noise). With the tanh GELU (GPT-2's own, and llm.c's), cuBLASLt's
// GELU epilogue removes the GELU's pass over the MLP's widest activation
// (the exact GELU's forward took 0.83 ms a step, session 13), and in the
// backward the matmul before the GELU applies its derivative in its
// epilogue (DGELU): 2.06 ms a step on the H100 against 2.85 ms for a plain
// matmul and ddptrain's GELU-backward pass (session 23).
//
// cuBLASLt is reached through the copy that LibTorch's CUDA library has
// already loaded (its functions looked up by name), not linked again: a
// second copy from the CUDA toolkit, of another minor version, could load
// first and break LibTorch's own calls.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <vector>

namespace ddp::cuda {

/// True where the functions below run: a CUDA build whose LibTorch has
/// loaded cuBLASLt.
bool gemm_gelu_available();

/// Whether the matmuls below choose their algorithm by timing: on by
/// default. The first eager call of each kind (shapes, layouts, epilogue,
/// operand alignment, device) times cuBLASLt's candidates (up to 16) and
/// their neighbours (another tile, pipeline depth or CTA swizzle, checked
/// by cuBLASLt) on its operands and keeps the fastest for the process, as
/// cuDNN's autotuning does for convolutions; the same kind at other operand
/// alignments keeps that choice where it runs there. Off, they take
/// cuBLASLt's first choice, as LibTorch does. Either way the products
/// accumulate in fp32, and a bf16 output's split sums add their parts in
/// fp32 (LibTorch allows bf16 there unless told otherwise); algorithms may
/// order or split the sum over K differently, so the last bit may differ
/// from another choice's. Once chosen, a kind keeps its algorithm: the same
/// operands give the same bits.
void set_gemm_tuning(bool on);
bool gemm_tuning();
/// How many kinds of matmul have had their algorithm chosen by timing so
/// far (a kind at other alignments that keeps an earlier choice, or a call
/// while a CUDA graph captures, adds none).
size_t gemm_tuned_kinds();

/// y = x W^T (+ b) in bf16 (epilogue BIAS with a bias), for x: [M, K],
/// w: [N, K], b: [N] or undefined, contiguous bf16 on one GPU; at::linear's
/// product with the algorithm chosen as set_gemm_tuning says. Undefined
/// where cuBLASLt cannot take it (N or K not a multiple of 8, a bias not
/// 16-byte aligned, no algorithm): the caller then runs at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

/// g W in bf16, for g: [M, N] and w: [N, K], contiguous bf16: a linear
/// layer's input gradient (at::mm's product), undefined as linear() is.
at::Tensor matmul(const at::Tensor& g, const at::Tensor& w);

/// {y, pre} for pre = x W^T + b and y = gelu_tanh(pre), in one matmul
/// (epilogue GELU_AUX_BIAS). x: [M, K], w: [N, K], b: [N], all bf16 and
/// contiguous on one GPU, N a multiple of 8. y and pre: [M, N] bf16.
std::vector<at::Tensor> linear_gelu_tanh(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

/// A linear layer's weight gradient in fp32: out = g^T x, for g: [M, N]
/// (the output's gradient) and x: [M, K] (the input), both contiguous bf16,
/// into out: a contiguous fp32 [N, K] on the same GPU (the weight's
/// gradient slot, param_slots.h). The products accumulate in fp32 and are
/// written without rounding to bf16 first, as Megatron-LM's fused weight
/// gradients are: autocast's matmul would round them to bf16, then cast.
void weight_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& out);

/// The tanh GELU's backward through the matmul before it, in one matmul
/// (epilogue DGELU): dh = (g W) * gelu_tanh'(pre), for g: [M, N], w: [N, K]
/// and pre: [M, K] (linear_gelu_tanh's pre-activation), contiguous bf16;
/// dh: [M, K] bf16, from the fp32 products. Undefined where cuBLASLt offers
/// no such algorithm (the caller then runs the matmul and
/// gelu_backward_column_sum). The bias gradient before the GELU is left to
/// column_sum: cuBLASLt's DGELU_BGRAD and BGRADB epilogues run their sums
/// as a separate generic kernel, slower than column_sum (bench/RESULTS.md,
/// sessions 15 and 23).
at::Tensor matmul_gelu_tanh_backward(const at::Tensor& g, const at::Tensor& w, const at::Tensor& pre);

}  // namespace ddp::cuda
