// The GPT's linear layers with their weight and bias gradients from
// ddptrain's CUDA kernels (cuda/gemm_gelu.h, cuda/linear_bias.h) where they
// apply, else LibTorch's ops.
//
// They apply on CUDA under bf16 autocast, to a layer with fp32 weights (and
// an fp32 bias, or none) whose output width is a multiple of 8, once
// use_fused_linear(true) turned them on (off until then, process-wide). The
// forward computes at::linear's product (and at::gelu) on the same bf16
// values: the training step's bf16 copies of the parameters where it has
// them (param_slots.h), else casts; its matmuls, and the backward's, are
// cuBLASLt's with the algorithm chosen by timing (cuda/gemm_gelu.h), so a
// last bit may differ from LibTorch's. The backward computes the input
// gradient as a bf16 matmul, as autograd does; the weight gradient with a bf16 x
// bf16 -> fp32 matmul and the bias gradient as a column sum in fp32
// (autocast rounds both to bf16 and casts them back), each written straight
// into the parameter's
// slot of the flat gradient buffer where it has one; the GELU's backward is
// folded into the MLP's first bias sum, and the attention's qkv split into
// its bias sum (linear_heads). A layer whose output goes straight into a
// residual add may leave its bias's sum to that add's LayerNorm backward
// (BiasGrad::kInTheAdd). ddptrain turns them on unless
// --linear-kernel native. On the H200 (2026-12-04) the bias sums took config
// (e)'s step from 35.61 to 34.31-34.63 ms, with the same validation loss
// after 300 steps (2.636 against 2.633).
#pragma once

#include <torch/torch.h>

namespace ddp::models {

void use_fused_linear(bool on);
bool fused_linear_enabled();

/// Whether linear_bias / linear_gelu(x, weight, bias) take the kernels now
/// (linear_heads also needs at most 3 parts and a head size that is a
/// multiple of 8).
bool fused_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

/// Who gives a linear layer's bias its gradient: the layer (kHere, as
/// nn.Linear), or the residual add that its output goes into (kInTheAdd):
/// the bias then gets no gradient from the layer, and the caller passes it
/// to that add_layer_norm as branch_bias (fused_layer_norm.h), whose
/// backward sums it in the LayerNorm's pass instead of a pass of its own.
/// The contract is the caller's: with kInTheAdd the layer's output must go
/// into that add alone (unchanged: no dropout), and the bias must be passed
/// there; with kHere it must not be (it would be summed twice).
enum class BiasGrad { kHere, kInTheAdd };

/// x W^T + b, as torch::linear; `bias` may be undefined (no bias).
torch::Tensor linear_bias(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          BiasGrad bias_grad = BiasGrad::kHere);
/// gelu(x W^T + b) with the exact (erf) GELU, as torch::gelu(torch::linear(...)).
torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

/// Attention's projection split into heads: x W^T + b for x [B, T, C], cut
/// into `parts` (q, k, v) column blocks, each as [B, heads, T, head_dim]
/// (views, as y.split(...)[i].view({B, T, heads, head_dim}).transpose(1, 2)).
/// Where the kernels apply (linear_bias's conditions, at most 3 parts,
/// head_dim a multiple of 8) the backward puts the parts' gradients side by
/// side and sums the bias's gradient in one pass (cuda/linear_bias.h).
std::vector<torch::Tensor> linear_heads(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                        int64_t parts, int64_t heads);

/// The MLP's GELU: the exact one (erf), as torch::gelu's default and
/// nn.GELU(), or the tanh approximation (GPT-2's own).
enum class MlpGelu { kExact, kTanh };

/// The GPT's MLP: gelu(x W1^T + b1) W2^T + b2, as
/// torch::linear(torch::gelu(torch::linear(x, w1, b1)[, "tanh"]), w2, b2).
/// Where the kernels apply to both layers (widths multiples of 8, both
/// biases present) and cuBLASLt is loaded, the tanh GELU's MLP is one
/// function: the first matmul computes the bias and GELU in its epilogue,
/// keeping the pre-activation (cuda/gemm_gelu.h), and the second's backward
/// applies the GELU's derivative in its own. The exact GELU's MLP is
/// linear_bias(linear_gelu(...)). (One function for the exact GELU's MLP,
/// its GELU a pass of its own each way, was an experiment never run on a
/// GPU, removed: bench/RESULTS.md, session 31.)
torch::Tensor mlp_gelu(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                       const torch::Tensor& b2, MlpGelu gelu, BiasGrad b2_grad = BiasGrad::kHere);


/// The GPT's token embedding and its output head, which share one weight
/// (GPT-2 ties them): embed(idx, pos) is weight[idx] + pos (pos: the
/// positions' embeddings, [T, C] for idx [B, T], added by broadcasting; or
/// undefined) and head(x) is x weight^T, the values of torch::embedding
/// (plus pos) and linear_bias(x, weight, {}).
///
/// Autograd would give the weight two gradients, a dense [V, C] one from
/// the embedding and one from the head, and add them. Where the kernels
/// apply (the CUDA fp32 weight of a training step, with linear_bias's
/// conditions for the head) the weight has one: the head's backward, which
/// autograd runs first, writes g^T x into the weight's gradient slot
/// (param_slots.h) or a fresh fp32 tensor, and the embedding's backward adds
/// its rows into that tensor (cuda/embedding.h) and returns it. Elsewhere
/// they are LibTorch's ops. One object per forward pass: make it, call
/// embed, then head once on the same graph (a second head() throws).
class TiedEmbedding {
 public:
  explicit TiedEmbedding(torch::Tensor weight);
  torch::Tensor embed(const torch::Tensor& idx, const torch::Tensor& pos = {});
  torch::Tensor head(const torch::Tensor& x);

 private:
  torch::Tensor weight_;
  // Where the head's backward leaves its gradient for the embedding's;
  // defined once embed() took the kernels.
  c10::intrusive_ptr<torch::CustomClassHolder> meeting_;
  bool head_taken_ = false;
};

}  // namespace ddp::models
