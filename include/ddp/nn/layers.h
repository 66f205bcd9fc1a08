// ddp::nn: LibTorch's layers with ddptrain's fast paths, as drop-ins.
//
// Each is the torch::nn layer it is named after (Linear, LayerNorm and
// Embedding derive from LibTorch's own Impl classes: the same options, the
// same initialisation from the same random numbers, the same state_dict
// names), with a forward() that takes ddptrain's CUDA kernels where they
// apply and LibTorch's ops everywhere else (CPU, fp32, fp16, shapes the
// kernels do not take), with equal results on CPU. So a model written with
// them saves and loads PyTorch's checkpoints unchanged, and one written with
// torch::nn layers can switch by changing the type.
//
// The kernels apply on CUDA under --amp bf16 (ddptrain's autocast) to fp32
// parameters:
//   - Linear: cuBLASLt's matmul with its algorithm chosen by timing, the
//     exact GELU in the matmul's epilogue (Activation::kGelu), and the bias
//     gradient as an fp32 column sum written straight into the flat gradient
//     buffer (--linear-kernel; output widths that are multiples of 8);
//   - LayerNorm: one pass each way, the output in bf16 (the next matmul's
//     dtype); forward_add(x, branch) also does a residual add in that pass
//     (--ln-kernel);
//   - BatchNorm2d (ddp::BatchNorm, which SyncBatchNorm also needs):
//     channels-last bf16 kernels, with the following ReLU fused
//     (Activation::kRelu, or forward_relu) and a residual block's
//     relu(bn(x) + shortcut) in one pass (forward_relu(x, shortcut))
//     (--bn-kernel);
//   - Embedding: the weight's gradient added row by row into the flat
//     gradient buffer instead of a fresh dense [V, C] tensor; head(x), the
//     tied output projection x W^T, shares that one gradient (GPT-2 ties
//     them);
//   - CrossEntropyLoss: one fused pass over the logits (--ce-kernel);
//   - MaxPool2d: channels-last, a uint8 argmax kept for the backward
//     (--bn-kernel).
//
// A forward() reached through a torch::nn base class (a
// torch::nn::LinearImpl& that is a ddp::nn::LinearImpl) is LibTorch's: the
// same values, without the kernels. convert_layers (convert.h) turns a
// model's torch::nn layers into these where C++ allows it.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <utility>

#include "ddp/dist/sync_batchnorm.h"
#include "ddp/models/fused_linear.h"

namespace ddp::nn {

/// What a layer applies to its output inside its own forward (on CUDA, in
/// the same kernel where one takes it).
enum class Activation { kNone, kRelu, kGelu, kGeluTanh };

/// "none", "relu", "gelu" or "gelu_tanh".
const char* activation_name(Activation activation);

/// torch::nn::Linear, then the activation: y = act(x W^T + b).
class LinearImpl : public torch::nn::LinearImpl {
 public:
  explicit LinearImpl(const torch::nn::LinearOptions& options, Activation activation = Activation::kNone);
  LinearImpl(int64_t in_features, int64_t out_features, Activation activation = Activation::kNone)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features), activation) {}

  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override;

  /// A ddp::nn::Linear holding `layer`'s own parameter tensors (so ties
  /// and handles to them stay valid); draws no random numbers.
  static std::shared_ptr<LinearImpl> sharing(const torch::nn::LinearImpl& layer, Activation activation);

  Activation activation;
};
TORCH_MODULE(Linear);

/// torch::nn::LayerNorm; forward_add fuses the residual add before it.
class LayerNormImpl : public torch::nn::LayerNormImpl {
 public:
  explicit LayerNormImpl(const torch::nn::LayerNormOptions& options);
  explicit LayerNormImpl(int64_t features) : LayerNormImpl(torch::nn::LayerNormOptions({features})) {}

  torch::Tensor forward(const torch::Tensor& input);
  /// {x + branch, LayerNorm(x + branch)}: a pre-norm transformer's residual
  /// stream and the next sub-layer's input, in one pass where the kernels
  /// apply (the LayerNorm then comes back in bf16).
  std::pair<torch::Tensor, torch::Tensor> forward_add(const torch::Tensor& x, const torch::Tensor& branch);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override;
  /// As LinearImpl::sharing.
  static std::shared_ptr<LayerNormImpl> sharing(const torch::nn::LayerNormImpl& layer);
};
TORCH_MODULE(LayerNorm);

/// torch::nn::Embedding; head(x) is the tied output projection x W^T.
class EmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& options);
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)) {}

  torch::Tensor forward(const torch::Tensor& indices);
  /// x W^T with this embedding's weight (no bias): an output head tied to
  /// the input embedding, whose weight then gets one gradient, not two
  /// added. Call it after forward() in the same pass, at most once per
  /// forward().
  torch::Tensor head(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override;

 private:
  // The last forward's lookup, for head(): one per forward pass.
  std::optional<models::TiedEmbedding> pass_;
};
TORCH_MODULE(Embedding);

/// torch::nn::CrossEntropyLoss, through the fused kernels for CUDA logits
/// [N, classes] with no class weights, no label smoothing and ignore_index
/// -100 (mean or sum).
class CrossEntropyLossImpl : public torch::nn::CrossEntropyLossImpl {
 public:
  explicit CrossEntropyLossImpl(const torch::nn::CrossEntropyLossOptions& options = {});
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& target);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override;
};
TORCH_MODULE(CrossEntropyLoss);

/// torch::nn::MaxPool2d; through ddptrain's channels-last kernel (uint8
/// argmax, the same bits as ATen's) for a square kernel, equal strides and
/// paddings, no dilation, floor mode (a ResNet stem's 3x3/2 pool).
class MaxPool2dImpl : public torch::nn::MaxPool2dImpl {
 public:
  explicit MaxPool2dImpl(const torch::nn::MaxPool2dOptions& options);
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override;
};
TORCH_MODULE(MaxPool2d);

/// Batch norm: ddp::BatchNorm (dist/sync_batchnorm.h: --sync-bn can make
/// its statistics global) from LibTorch's options; kRelu fuses the ReLU that
/// follows. A momentum of nullopt (a cumulative average) is refused.
ddp::BatchNorm BatchNorm1d(const torch::nn::BatchNormOptions& options, Activation activation = Activation::kNone);
ddp::BatchNorm BatchNorm2d(const torch::nn::BatchNormOptions& options, Activation activation = Activation::kNone);
ddp::BatchNorm BatchNorm3d(const torch::nn::BatchNormOptions& options, Activation activation = Activation::kNone);

}  // namespace ddp::nn
