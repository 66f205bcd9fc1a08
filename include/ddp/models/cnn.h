// A small convolutional network for quick CPU runs on MNIST-sized images.
//
// Two conv-BN-ReLU-maxpool stages (32 and 64 channels) and a two-layer head:
// about 4 million multiply-adds per 28 px image, so it trains on two CPU cores;
// it reaches about 90% on Fashion-MNIST within two or three epochs. That makes
// it the default model for trying the trainer and for end-to-end tests. The head
// reads a fixed grid of pooled features, so the same network accepts any
// input of at least 8 x 8 pixels.
#pragma once

#include <torch/torch.h>

#include "ddp/models/net.h"
#include "ddp/dist/sync_batchnorm.h"

namespace ddp::models {

struct CnnOptions {
  /// Channels of the input image (1 for grayscale, 3 for RGB).
  TORCH_ARG(int64_t, in_channels) = 1;
  /// Width of the output layer.
  TORCH_ARG(int64_t, num_classes) = 10;
  /// Side of the feature grid the head reads. 7 matches a 28 px input after
  /// the two 2x poolings exactly; larger inputs are averaged down to it, so
  /// the head stays small. Give smaller inputs a smaller grid (H/4).
  TORCH_ARG(int64_t, grid) = 7;
  /// Width of the hidden fully connected layer.
  TORCH_ARG(int64_t, hidden) = 128;
};

class CnnImpl : public Net {
 public:
  explicit CnnImpl(CnnOptions options = {});

  /// B x C x H x W images (H, W >= 8) to B x num_classes logits.
  torch::Tensor forward(torch::Tensor x) override;

  CnnOptions options;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  BatchNorm bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

}  // namespace ddp::models
