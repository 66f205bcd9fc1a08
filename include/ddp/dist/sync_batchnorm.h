// Batch normalisation whose training statistics span all ranks.
//
// ddp::BatchNorm is a drop-in BatchNorm{1,2,3}d with torchvision's parameter
// and buffer names. Alone it computes local statistics, exactly like
// torch::nn::BatchNorm2d. After convert_sync_batchnorm() it computes the mean
// and variance of the global batch in training (ranks may hold different
// numbers of samples), back-propagates exactly through them, and keeps
// running statistics that are identical on every rank. Eval mode uses the
// running statistics and never communicates.
//
// Why a module of our own: in the C++ frontend a parent holds its children
// by value-typed handles, so a BatchNorm2d inside a model cannot be swapped for
// another class after construction (Module::replace_module does not update the
// parent's member). Models that want SyncBatchNorm therefore build with
// ddp::BatchNorm, and conversion switches it on in place.
#pragma once

#include <utility>

#include "ddp/compat.h"
#include "ddp/dist/world.h"

namespace ddp {

struct BatchNormOptions {
  BatchNormOptions(int64_t num_features, int dim = 2) : num_features_(num_features), dim_(dim) {}
  /// Channels (C of an N x C x ... input).
  TORCH_ARG(int64_t, num_features);
  /// 1, 2 or 3, as in BatchNorm1d/2d/3d; only used to check input rank.
  TORCH_ARG(int, dim) = 2;
  TORCH_ARG(double, eps) = 1e-5;
  TORCH_ARG(double, momentum) = 0.1;
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, track_running_stats) = true;
  /// forward() is relu(batch_norm(x)): the ReLU that follows, fused into the
  /// kernels' pass where they apply (forward_relu's path).
  TORCH_ARG(bool, relu) = false;
};

class BatchNormImpl : public torch::nn::Cloneable<BatchNormImpl> {
 public:
  explicit BatchNormImpl(BatchNormOptions options);
  void reset() override;
  /// The batch norm (followed by the ReLU with options.relu).
  torch::Tensor forward(const torch::Tensor& input);
  /// relu(batch_norm(input) + residual), the residual optional: a residual
  /// block's tail. In training on channels-last bf16 CUDA input it is one
  /// pass of ddptrain's kernels forward, with the ReLU folded into the batch
  /// norm's backward; elsewhere it is the separate ops, with equal results.
  torch::Tensor forward_relu(const torch::Tensor& input, const torch::Tensor& residual = {});
  /// forward_relu(input, residual) for an output with two consumers (a
  /// residual block's output: the next block's main path and its shortcut),
  /// returned twice: {y, y} or, where the fused kernels apply, {y, a view of
  /// y} from one autograd node, so that the two consumers' gradients are
  /// added inside the batch norm's backward instead of by autograd in a
  /// pass of their own. The same values and gradients either way.
  std::pair<torch::Tensor, torch::Tensor> forward_relu_split(const torch::Tensor& input,
                                                             const torch::Tensor& residual);
  void pretty_print(std::ostream& stream) const override;

  /// Takes `other`'s parameters and buffers of this layer's names and
  /// shapes (a torch::nn::BatchNorm's: the same tensors, so handles to them
  /// stay valid); ddp::nn::convert_layers uses it.
  void share_tensors_of(const torch::nn::Module& other);

  /// Makes training statistics global over `world` (nullptr: local again).
  void set_world(World* world) { world_ = world; }
  bool synced() const { return world_ != nullptr && world_->size() > 1; }

  BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  void check_input(const torch::Tensor& input) const;
  torch::Tensor normalize(const torch::Tensor& input);  // forward() without options.relu
  bool fused_relu_applies(const torch::Tensor& input, const torch::Tensor& residual) const;
  World* world_ = nullptr;
};
TORCH_MODULE(BatchNorm);

inline BatchNorm BatchNorm1d(int64_t c) { return BatchNorm(BatchNormOptions(c, 1)); }
inline BatchNorm BatchNorm2d(int64_t c) { return BatchNorm(BatchNormOptions(c, 2)); }
inline BatchNorm BatchNorm3d(int64_t c) { return BatchNorm(BatchNormOptions(c, 3)); }

/// Whether training-mode ddp::BatchNorm runs ddptrain's own CUDA kernels
/// (include/ddp/cuda/batch_norm_nhwc.h) on channels-last bf16 input
/// where they apply (default: yes, in builds that have them).
void use_nhwc_batchnorm_kernels(bool on);
/// Whether BatchNorm::forward_relu fuses the ReLU (and residual add) into
/// those kernels (default: yes); off, it runs them and then the separate ops.
void use_fused_batchnorm_relu(bool on);
/// Whether BatchNorm::forward_relu_split returns its two outputs from one
/// node, with the gradients' add fused (default: yes); off, it returns
/// {y, y} and autograd adds the gradients.
void use_split_residual_output(bool on);
/// True when this build has those kernels (a CUDA LibTorch build).
bool have_nhwc_batchnorm_kernels();

/// Turns every ddp::BatchNorm in `module`'s tree into a synchronised one and
/// returns how many it converted. Throws a UserError naming the first
/// torch::nn::BatchNorm{1,2,3}d it finds, which cannot be converted in C++.
int convert_sync_batchnorm(torch::nn::Module& module, World& world);

}  // namespace ddp
