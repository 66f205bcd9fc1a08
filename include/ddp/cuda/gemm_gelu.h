// The GPT MLP's first layer with its GELU in the matmul's epilogue
// (cuBLASLt), forward and backward: for a model with the tanh GELU, the
// GELU pass and the GELU-backward pass disappear into the matmuls.
//
// Why: in config (e) (GPT-2 124M, bf16) the exact GELU's forward takes
// 0.83 ms a step and its backward, fused with the bias gradient, 1.28 ms
// (bench/RESULTS.md, session 13); each reads and writes the MLP's widest
// activation. cuBLASLt's GELU epilogues compute the tanh approximation (the
// GELU of GPT-2 itself, and of llm.c), so they serve a model that uses it.
//
// cuBLASLt is reached through the copy that LibTorch's CUDA library has
// already loaded (its functions looked up by name), not linked again: a
// second copy from the CUDA toolkit, of another minor version, could load
// first and break LibTorch's own calls. Not run on a GPU yet (session 14).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp::cuda {

/// True where the functions below run: a CUDA build whose LibTorch has
/// loaded cuBLASLt.
bool gemm_gelu_available();

/// {y, pre} for pre = x W^T + b and y = gelu_tanh(pre), in one matmul
/// (epilogue GELU_AUX_BIAS). x: [M, K], w: [N, K], b: [N], all bf16 and
/// contiguous on one GPU, N a multiple of 8. y and pre: [M, N] bf16.
std::vector<at::Tensor> linear_gelu_tanh(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

/// {dh, db} for dh = (g W) * gelu_tanh'(pre) and db = the column sums of dh,
/// in one matmul (epilogue DGELU_BGRAD): the backward of y = gelu_tanh(pre)
/// followed by z = y W^T, for z's gradient g. g: [M, N2], w: [N2, N1],
/// pre: [M, N1], bf16 and contiguous, N1 a multiple of 8. dh: [M, N1] bf16;
/// db: [N1] fp32 (summed in fp32 by cuBLASLt where it can write fp32, else
/// rounded to bf16 there and widened).
std::vector<at::Tensor> matmul_dgelu_bgrad(const at::Tensor& g, const at::Tensor& w, const at::Tensor& pre);

}  // namespace ddp::cuda
