// A GPT-2-style decoder-only Transformer: what --model gpt, gpt-nano and
// gpt2 build for --task lm.
//
// Token and learned position embeddings, n_layer pre-LayerNorm blocks of
// causal self-attention and a 4x GELU MLP, a final LayerNorm, and an output
// head that shares its weight with the token embedding (weight tying, as in
// GPT-2). The parameter names are those of nanoGPT's GPT-2 state_dict
// (transformer.wte.weight, transformer.h.0.attn.c_attn.weight, ...,
// lm_head.weight), so weights move between ddptrain and PyTorch code written
// that way with `ddptrain export` and --pretrain.
//
// Tying: lm_head.weight is the very tensor of transformer.wte.weight,
// registered under both names. named_parameters() lists it twice, as
// PyTorch's state_dict() does, so checkpoints and exports carry both names;
// GradSync flattens each distinct tensor once, and autograd sums the
// gradients of both uses into it.
//
// Attention goes through compat::causal_attention (scaled-dot-product
// attention on LibTorch 2.x). The forward pass reads nothing back to the
// host, so a training step with it can be captured in a CUDA graph.
#pragma once

#include <functional>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/models/fused_linear.h"
#include "ddp/models/net.h"
#include "ddp/models/recompute.h"

namespace ddp::models {

/// The MLP's GELU: the exact one (erf), as nanoGPT's nn.GELU(), or GPT-2's
/// own tanh approximation (HF's "gelu_new", llm.c's). With tanh, ddptrain's
/// kernels (--linear-kernel auto, on a GPU) compute the GELU and its
/// backward inside the MLP's matmuls (cuda/gemm_gelu.h).
using GptGelu = MlpGelu;  // kExact or kTanh (fused_linear.h)

struct GptOptions {
  /// Transformer blocks.
  TORCH_ARG(int64_t, n_layer) = 2;
  /// Attention heads per block; n_embd must be a multiple of it.
  TORCH_ARG(int64_t, n_head) = 4;
  /// Width of the residual stream.
  TORCH_ARG(int64_t, n_embd) = 64;
  /// Longest sequence (the context): rows of the position embedding.
  TORCH_ARG(int64_t, block_size) = 64;
  /// Rows of the token embedding and outputs of the head.
  TORCH_ARG(int64_t, vocab_size) = 256;
  /// Dropout after the embeddings, on the attention weights and on each
  /// residual branch; 0 (the default) turns it off.
  TORCH_ARG(double, dropout) = 0.0;
  /// Biases in the linear layers and LayerNorms (GPT-2 has them).
  TORCH_ARG(bool, bias) = true;
  /// The MLP's GELU.
  TORCH_ARG(GptGelu, gelu) = GptGelu::kExact;
  /// Which activations backward recomputes instead of keeping (--recompute):
  /// none, each block's second LayerNorm and MLP (kMlp), or every N-th
  /// block (kBlocks). The same values and gradients, less memory, one more
  /// forward of what it covers. Not part of the architecture.
  TORCH_ARG(RecomputePolicy, recompute) = {};
};

/// The sizes --model names: gpt-nano (CPU-sized: 2 layers, 4 heads, width
/// 64, context 64, vocabulary 256: 120k parameters), gpt2 (GPT-2 small, 124M: 12, 12,
/// 768, context 1024, vocabulary 50304 = 50257 rounded up to a multiple of
/// 64), gpt2-medium (350M: 24, 16, 1024), gpt2-large (774M: 36, 20, 1280),
/// gpt2-xl (1.5B: 48, 25, 1600), all at context 1024 and vocabulary 50304,
/// and gpt (gpt-nano's sizes, for flags to change). UserError for other
/// names.
GptOptions gpt_preset(const std::string& name);
/// Whether --model `name` is one of the GPT names above.
bool is_gpt(const std::string& name);
/// "gpt/L2/H4/C64/T64/V256/bias1/drop0": the sizes, as the architecture
/// string of a checkpoint, with "/gelu-tanh" after them for the tanh GELU
/// (so checkpoints from before it read as the exact GELU they have);
/// gpt_from_arch() reads it back.
std::string gpt_arch(const GptOptions& o);
GptOptions gpt_from_arch(const std::string& arch);

/// LayerNorm over the last dimension with an optional bias (LibTorch's
/// LayerNorm has both or neither).
class GptLayerNormImpl : public torch::nn::Module {
 public:
  GptLayerNormImpl(int64_t width, bool bias);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
};
TORCH_MODULE(GptLayerNorm);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptOptions& o);
  /// BiasGrad::kInTheAdd (no dropout only): c_proj's bias gets its gradient
  /// from the residual add the output goes into (GptImpl::forward).
  torch::Tensor forward(const torch::Tensor& x, BiasGrad c_proj_bias = BiasGrad::kHere);
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};
  int64_t n_head;
  double dropout;
};
TORCH_MODULE(CausalSelfAttention);

class GptMlpImpl : public torch::nn::Module {
 public:
  explicit GptMlpImpl(const GptOptions& o);
  /// c_proj_bias: as CausalSelfAttention's.
  torch::Tensor forward(const torch::Tensor& x, BiasGrad c_proj_bias = BiasGrad::kHere);
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};
  GptGelu gelu = GptGelu::kExact;
};
TORCH_MODULE(GptMlp);

class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const GptOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  GptLayerNorm ln_1{nullptr}, ln_2{nullptr};
  /// ln_2 and the MLP under recompute (RecomputePolicy::kMlp).
  bool recompute_mlp = false;
  CausalSelfAttention attn{nullptr};
  GptMlp mlp{nullptr};
};
TORCH_MODULE(GptBlock);

/// The "transformer" container of nanoGPT's naming.
class GptTransformerImpl : public torch::nn::Module {
 public:
  explicit GptTransformerImpl(const GptOptions& o);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  GptLayerNorm ln_f{nullptr};
};
TORCH_MODULE(GptTransformer);

/// The output head: logits = x W^T with W registered here as "weight" but
/// shared with the token embedding.
class TiedHeadImpl : public torch::nn::Module {
 public:
  explicit TiedHeadImpl(const torch::Tensor& shared_weight);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

class GptImpl : public Net {
 public:
  explicit GptImpl(GptOptions options = {});

  /// B x T token ids (int64, T <= block_size) to B x T x vocab_size logits
  /// for the next token at every position.
  torch::Tensor forward(torch::Tensor idx) override;

  /// Parameters counted once (the tied weight once); with
  /// non_embedding, without the position embedding, as nanoGPT reports.
  int64_t num_params(bool non_embedding = false) const;

  /// GPT-2's initialisation: normal(0, 0.02) for linear and embedding
  /// weights, normal(0, 0.02 / sqrt(2 n_layer)) for the projections that
  /// end a residual branch (attn.c_proj, mlp.c_proj), zero biases, LayerNorm
  /// weight one. The constructor applies it; call again to re-draw.
  void reset_parameters();

  /// Called by forward() with -1 before the embeddings, with i before
  /// block i, and with n_layer before the final norm and the head: a
  /// trainer's hook to make each part's parameters ready only when that
  /// part runs (TrainStep: --shard-optimizer's gather waited for layer by
  /// layer, since LibTorch has no forward pre-hooks). Empty: none. Not part
  /// of the architecture, nor of a checkpoint; a TrainStep's hook does
  /// nothing once that TrainStep is gone (it holds a weak pointer).
  std::function<void(int64_t)> before_part;

  GptOptions options;
  GptTransformer transformer{nullptr};
  TiedHead lm_head{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace ddp::models
