// The one thing the trainer needs from a model: forward(batch) -> outputs.
//
// The C++ frontend's Module has no virtual forward, so models that the
// trainer drives derive from ddp::Net. Write them the LibTorch way
// (FooImpl : ddp::Net, TORCH_MODULE(Foo)); the holder's .ptr() converts to
// std::shared_ptr<ddp::Net>.
#pragma once

#include <torch/torch.h>

namespace ddp {

class Net : public torch::nn::Module {
 public:
  /// B x ... inputs to B x outputs (logits for classification).
  virtual torch::Tensor forward(torch::Tensor x) = 0;
};

}  // namespace ddp
