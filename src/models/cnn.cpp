// The small CPU-friendly CNN: see include/ddp/models/cnn.h for the why.
#include "ddp/models/cnn.h"

namespace ddp::models {
namespace {

// Bias-free: the batch norm right after it supplies the shift.
torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false));
}

}  // namespace

CnnImpl::CnnImpl(CnnOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(options.in_channels() > 0 && options.num_classes() > 0 && options.grid() > 0 &&
                  options.hidden() > 0,
              "Cnn options must be positive");
  conv1 = register_module("conv1", conv3x3(options.in_channels(), 32));
  bn1 = register_module("bn1", BatchNorm2d(32));
  conv2 = register_module("conv2", conv3x3(32, 64));
  bn2 = register_module("bn2", BatchNorm2d(64));
  fc1 = register_module("fc1", torch::nn::Linear(64 * options.grid() * options.grid(), options.hidden()));
  fc2 = register_module("fc2", torch::nn::Linear(options.hidden(), options.num_classes()));
}

torch::Tensor CnnImpl::forward(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == options.in_channels(), "Cnn expects B x ",
              options.in_channels(), " x H x W input, got ", x.sizes());
  x = torch::max_pool2d(bn1->forward_relu(conv1(x)), 2);
  x = torch::max_pool2d(bn2->forward_relu(conv2(x)), 2);
  // A no-op for 28 px inputs with the default grid; it lets other sizes share the head.
  if (x.size(2) != options.grid() || x.size(3) != options.grid()) {
    x = torch::adaptive_avg_pool2d(x, {options.grid(), options.grid()});
  }
  x = torch::relu(fc1(torch::flatten(x, 1)));
  return fc2(x);
}

}  // namespace ddp::models
