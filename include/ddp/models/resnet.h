// ResNet-18/34/50 whose state_dict matches torchvision's name for name.
//
// Matching names and shapes exactly (conv1, bn1, layerN.i.convK,
// layerN.0.downsample.{0,1}, fc) lets a checkpoint move between ddptrain and
// PyTorch with a plain rename-free copy, and lets the tests compare against a
// key list that torchvision itself produced. Two stems: torchvision's
// "imagenet" one, and a "small" one for 28-32 px images, where a 7x7 stride-2
// convolution plus a max-pool would shrink the input to 8x8 before the first
// residual stage and throw most of the picture away. Every batch norm is a
// ddp::BatchNorm so that convert_sync_batchnorm() can switch it to global
// statistics.
#pragma once

#include <torch/torch.h>

#include "ddp/models/net.h"
#include "ddp/models/recompute.h"
#include "ddp/dist/sync_batchnorm.h"

namespace ddp::models {

/// How the network treats the image before the first residual stage.
enum class ResNetStem {
  /// 7x7 stride-2 convolution and 3x3 stride-2 max-pool (4x down): ImageNet-sized inputs.
  kImageNet,
  /// 3x3 stride-1 convolution, no max-pool: CIFAR/MNIST-sized inputs.
  kSmall,
};

struct ResNetOptions {
  /* implicit */ ResNetOptions(int64_t depth) : depth_(depth) {}
  /// 18 or 34 (basic blocks) or 50 (bottleneck blocks).
  TORCH_ARG(int64_t, depth);
  /// Width of the final fully connected layer.
  TORCH_ARG(int64_t, num_classes) = 1000;
  /// Channels of the input image (1 for grayscale, 3 for RGB).
  TORCH_ARG(int64_t, in_channels) = 3;
  TORCH_ARG(ResNetStem, stem) = ResNetStem::kImageNet;
  /// Starts each residual branch's last batch norm at weight 0, so every
  /// block begins as the identity (Goyal et al., 2017); helps large batches.
  TORCH_ARG(bool, zero_init_residual) = false;
  /// Which activations backward recomputes instead of keeping (--recompute):
  /// none, every N-th residual block (kBlocks, counted over all stages), or
  /// each stage as a whole (kStages). The same values, gradients and running
  /// statistics, less memory, one more forward of what it covers.
  TORCH_ARG(RecomputePolicy, recompute) = {};
};

/// Two 3x3 convolutions around an identity (or projected) shortcut.
class BasicBlockImpl : public torch::nn::Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlockImpl(int64_t in_planes, int64_t planes, int64_t stride);
  torch::Tensor forward(torch::Tensor x);
  /// The block with its shortcut taken from `branch` (x itself when
  /// undefined), returning {output, its second handle} for the next block's
  /// forward_split (BatchNorm::forward_relu_split); forward(x) is its first.
  std::pair<torch::Tensor, torch::Tensor> forward_split(const torch::Tensor& x, const torch::Tensor& branch);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  BatchNorm bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};  // empty holder: identity shortcut
};
TORCH_MODULE(BasicBlock);

/// 1x1 reduce, 3x3 (carrying the stride, as torchvision's "ResNet v1.5"
/// does), 1x1 expand by 4, around an identity (or projected) shortcut.
class BottleneckImpl : public torch::nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in_planes, int64_t planes, int64_t stride);
  torch::Tensor forward(torch::Tensor x);
  /// The block with its shortcut taken from `branch` (x itself when
  /// undefined), returning {output, its second handle} for the next block's
  /// forward_split (BatchNorm::forward_relu_split); forward(x) is its first.
  std::pair<torch::Tensor, torch::Tensor> forward_split(const torch::Tensor& x, const torch::Tensor& branch);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  BatchNorm bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

class ResNetImpl : public Net {
 public:
  explicit ResNetImpl(ResNetOptions options);

  /// B x C x H x W images to B x num_classes logits.
  torch::Tensor forward(torch::Tensor x) override;
  /// The last residual stage's feature map, before pooling: B x 512*e x H/s x W/s
  /// with s = 32 for the ImageNet stem and 8 for the small one.
  torch::Tensor forward_features(torch::Tensor x);

  ResNetOptions options;
  torch::nn::Conv2d conv1{nullptr};
  BatchNorm bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr}, layer4{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

}  // namespace ddp::models
