// Losses, with a guard against silent broadcasting.
//
// The seed template computed MSELoss between B x 1000 logits and a B x 1
// label: PyTorch broadcast the shapes and the loss sat in the thousands.
// compute_loss() refuses any pair of shapes that the loss would broadcast,
// and names both.
#pragma once

#include <string>

#include <torch/torch.h>

namespace ddp {

struct LossOptions {
  TORCH_ARG(std::string, kind) = "cross-entropy";  // cross-entropy | mse | l1 | huber
  TORCH_ARG(double, label_smoothing) = 0.0;
};

/// Mean loss over the batch. Cross-entropy takes B x K logits and B class
/// indices; mse and l1 take outputs and targets of identical shape.
torch::Tensor compute_loss(const torch::Tensor& output, const torch::Tensor& target, const LossOptions& options);

}  // namespace ddp
