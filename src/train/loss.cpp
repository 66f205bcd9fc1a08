// Loss functions with shape checks.
#include "ddp/train/loss.h"

#include "ddp/error.h"

namespace ddp {

torch::Tensor compute_loss(const torch::Tensor& output, const torch::Tensor& target, const LossOptions& o) {
  const std::string shapes = "output " + c10::str(output.sizes()) + " and target " + c10::str(target.sizes());
  if (o.kind() == "cross-entropy") {
    check_user(output.dim() == 2 && target.dim() == 1 && output.size(0) == target.size(0),
               "cross-entropy needs B x classes logits and B class indices; got " + shapes + ".",
               "for regression use --loss mse or l1 with targets shaped like the outputs.");
    check_user(!target.is_floating_point(), "cross-entropy needs integer class indices; got a " +
                   std::string(c10::toString(target.scalar_type())) + " target with " + shapes + ".",
               "convert labels with .to(torch::kLong).");
    // ATen's op, as F.cross_entropy calls it: with label smoothing (1 - eps
    // on the label, eps spread over the classes) its own order of sums, so
    // that the loss and gradients are PyTorch's to the bit (eps times a mean
    // of means rounded otherwise on batches of other sizes than 2^k).
    namespace F = torch::nn::functional;
    return F::cross_entropy(output.to(torch::kFloat), target,
                            F::CrossEntropyFuncOptions().label_smoothing(o.label_smoothing()));
  }
  check_user(o.kind() == "mse" || o.kind() == "l1" || o.kind() == "huber", "loss '" + o.kind() + "' is not known.",
             "use cross-entropy, mse, l1 or huber.");
  check_user(output.sizes() == target.sizes(),
             o.kind() + " loss would broadcast " + shapes + " and silently compare the wrong elements.",
             "make the target the same shape as the output (e.g. one value per output), or use --loss cross-entropy for class labels.");
  auto diff = output.to(torch::kFloat) - target.to(torch::kFloat);
  if (o.kind() == "mse") return diff.pow(2).mean();
  if (o.kind() == "l1") return diff.abs().mean();
  // Huber with delta 1 (torch.nn.HuberLoss's default): quadratic near 0,
  // linear beyond.
  const auto a = diff.abs();
  return torch::where(a < 1.0, 0.5 * a.pow(2), a - 0.5).mean();
}

}  // namespace ddp
