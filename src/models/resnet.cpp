// ResNet-18/34/50 with torchvision's module tree, hence its state_dict keys.
//
// Registration order follows torchvision's __init__ order (conv1, bn1, conv2,
// ..., downsample; stem, layer1..4, fc) so that parameters() enumerates in the
// same order as PyTorch, not just under the same names.
#include "ddp/models/resnet.h"

#include <tuple>

#include "ddp/models/max_pool.h"

#include <array>
#include <string>

namespace ddp::models {
namespace {

// Padding k/2 keeps H x W at stride 1 and halves it (rounding up) at stride
// 2 for the 1x1, 3x3 and 7x7 kernels used here. No bias: a batch norm follows
// every convolution and its shift makes a bias redundant.
torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// The projection shortcut torchvision calls "downsample": needed whenever the
// block changes resolution or width, otherwise the shortcut is the identity.
torch::nn::Sequential projection(int64_t in, int64_t out, int64_t stride) {
  if (stride == 1 && in == out) return torch::nn::Sequential{nullptr};
  return torch::nn::Sequential(conv(in, out, 1, stride), BatchNorm2d(out));
}

struct Architecture {
  bool bottleneck;
  std::array<int64_t, 4> blocks;  // per stage
};

Architecture architecture(int64_t depth) {
  TORCH_CHECK(depth == 18 || depth == 34 || depth == 50,
              "ResNet depth must be 18, 34 or 50, got ", depth);
  if (depth == 18) return {false, {2, 2, 2, 2}};
  return {depth == 50, {3, 4, 6, 3}};  // 34 and 50 share stage lengths
}

// One stage: the first block changes stride and width, the rest keep them.
// Blocks are named "0", "1", ... by their position, as in torchvision.
template <typename Block>
torch::nn::Sequential stage(int64_t& in_planes, int64_t planes, int64_t blocks, int64_t stride) {
  torch::nn::Sequential seq;
  for (int64_t b = 0; b < blocks; ++b) {
    seq->push_back(Block(in_planes, planes, b == 0 ? stride : 1));
    in_planes = planes * Block::ContainedType::kExpansion;
  }
  return seq;
}

// Residual blocks one after the other, each output handed on twice (main
// path, shortcut), so that the next block's two gradients meet inside the
// batch norm's backward (BatchNorm::forward_relu_split).
std::pair<torch::Tensor, torch::Tensor> run_blocks(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                                                   torch::Tensor x, torch::Tensor branch) {
  for (const auto& m : blocks) {
    if (auto* b = m->as<Bottleneck>()) std::tie(x, branch) = b->forward_split(x, branch);
    else if (auto* bb = m->as<BasicBlock>()) std::tie(x, branch) = bb->forward_split(x, branch);
    else TORCH_CHECK(false, "ResNet: unexpected module in a stage");
  }
  return {x, branch};
}

// run_blocks under recompute: the blocks' parameters and their batch
// norms' buffers (restored after the re-run) go with them.
std::pair<torch::Tensor, torch::Tensor> recompute_blocks(std::vector<std::shared_ptr<torch::nn::Module>> blocks,
                                                         const torch::Tensor& x, const torch::Tensor& branch) {
  std::vector<torch::Tensor> params, buffers;
  for (const auto& m : blocks) {
    for (auto& p : m->parameters()) params.push_back(p);
    for (auto& b : m->buffers()) buffers.push_back(b);
  }
  auto fn = [blocks](const std::vector<torch::Tensor>& in) {
    auto out = run_blocks(blocks, in[0], in.size() > 1 ? in[1] : torch::Tensor());
    return std::vector<torch::Tensor>{out.first, out.second};
  };
  auto out = recompute(fn, branch.defined() ? std::vector<torch::Tensor>{x, branch} : std::vector<torch::Tensor>{x},
                       params, buffers);
  return {out[0], out[1]};
}

}  // namespace

BasicBlockImpl::BasicBlockImpl(int64_t in_planes, int64_t planes, int64_t stride) {
  conv1 = register_module("conv1", conv(in_planes, planes, 3, stride));
  bn1 = register_module("bn1", BatchNorm2d(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, 1));
  bn2 = register_module("bn2", BatchNorm2d(planes));
  auto proj = projection(in_planes, planes * kExpansion, stride);
  if (!proj.is_empty()) downsample = register_module("downsample", proj);
}

torch::Tensor BasicBlockImpl::forward(torch::Tensor x) { return forward_split(x, {}).first; }

std::pair<torch::Tensor, torch::Tensor> BasicBlockImpl::forward_split(const torch::Tensor& x,
                                                                     const torch::Tensor& branch) {
  const auto& in = branch.defined() ? branch : x;
  auto out = conv2(bn1->forward_relu(conv1(x)));
  auto shortcut = downsample.is_empty() ? in : downsample->forward(in);
  return bn2->forward_relu_split(out, shortcut);
}

BottleneckImpl::BottleneckImpl(int64_t in_planes, int64_t planes, int64_t stride) {
  conv1 = register_module("conv1", conv(in_planes, planes, 1, 1));
  bn1 = register_module("bn1", BatchNorm2d(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, stride));
  bn2 = register_module("bn2", BatchNorm2d(planes));
  conv3 = register_module("conv3", conv(planes, planes * kExpansion, 1, 1));
  bn3 = register_module("bn3", BatchNorm2d(planes * kExpansion));
  auto proj = projection(in_planes, planes * kExpansion, stride);
  if (!proj.is_empty()) downsample = register_module("downsample", proj);
}

torch::Tensor BottleneckImpl::forward(torch::Tensor x) { return forward_split(x, {}).first; }

std::pair<torch::Tensor, torch::Tensor> BottleneckImpl::forward_split(const torch::Tensor& x,
                                                                     const torch::Tensor& branch) {
  const auto& in = branch.defined() ? branch : x;
  auto out = bn1->forward_relu(conv1(x));
  out = conv3(bn2->forward_relu(conv2(out)));
  auto shortcut = downsample.is_empty() ? in : downsample->forward(in);
  return bn3->forward_relu_split(out, shortcut);
}

ResNetImpl::ResNetImpl(ResNetOptions options_) : options(std::move(options_)) {
  const Architecture arch = architecture(options.depth());
  TORCH_CHECK(options.in_channels() > 0, "ResNet in_channels must be positive");
  TORCH_CHECK(options.num_classes() > 0, "ResNet num_classes must be positive");

  const bool small = options.stem() == ResNetStem::kSmall;
  conv1 = register_module("conv1", small ? conv(options.in_channels(), 64, 3, 1)
                                         : conv(options.in_channels(), 64, 7, 2));
  bn1 = register_module("bn1", BatchNorm2d(64));

  int64_t in_planes = 64;
  const std::array<int64_t, 4> widths = {64, 128, 256, 512};
  const std::array<torch::nn::Sequential*, 4> layers = {&layer1, &layer2, &layer3, &layer4};
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t stride = i == 0 ? 1 : 2;  // the stem already reduced resolution
    auto s = arch.bottleneck ? stage<Bottleneck>(in_planes, widths[i], arch.blocks[i], stride)
                             : stage<BasicBlock>(in_planes, widths[i], arch.blocks[i], stride);
    *layers[i] = register_module("layer" + std::to_string(i + 1), s);
  }
  fc = register_module("fc", torch::nn::Linear(in_planes, options.num_classes()));

  // torchvision's initialisation: He-normal on fan-out for the convolutions
  // (batch norms already start at weight 1, bias 0; fc keeps Linear's default).
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<torch::nn::Conv2d>()) {
      torch::nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    }
    if (options.zero_init_residual()) {
      if (auto* b = m->as<Bottleneck>()) torch::nn::init::zeros_(b->bn3->weight);
      if (auto* b = m->as<BasicBlock>()) torch::nn::init::zeros_(b->bn2->weight);
    }
  }
}

torch::Tensor ResNetImpl::forward_features(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == options.in_channels(), "ResNet expects B x ",
              options.in_channels(), " x H x W input, got ", x.sizes());
  x = bn1->forward_relu(conv1(x));
  if (options.stem() == ResNetStem::kImageNet) {
    // ddptrain's channels-last kernels on CUDA (uint8 argmax, no saved
    // input), ATen's otherwise; the same outputs and gradients.
    x = max_pool2d(x, /*kernel=*/3, /*stride=*/2, /*padding=*/1);
  }
  // Block by block, each output handed on twice (main path, shortcut), so
  // that the next block's two gradients meet inside the batch norm's
  // backward (BatchNorm::forward_relu_split); the same as layerN->forward.
  // Under --recompute, a stage or every N-th block runs under recompute.
  torch::Tensor branch;
  const auto& policy = options.recompute();
  int64_t index = 0;
  for (auto* layer : {&layer1, &layer2, &layer3, &layer4}) {
    const auto blocks = (*layer)->children();
    if (policy.kind == RecomputePolicy::Kind::kStages) {
      std::tie(x, branch) = recompute_blocks(blocks, x, branch);
      continue;
    }
    for (const auto& m : blocks)
      std::tie(x, branch) = policy.block(index++) ? recompute_blocks({m}, x, branch) : run_blocks({m}, x, branch);
  }
  return x;
}

torch::Tensor ResNetImpl::forward(torch::Tensor x) {
  x = torch::adaptive_avg_pool2d(forward_features(x), {1, 1});
  return fc(torch::flatten(x, 1));
}

}  // namespace ddp::models
