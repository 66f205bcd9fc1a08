// Optimizer steps over flat buffers: LibTorch's fused kernels where they
// exist, else torch::optim's arithmetic applied to whole buffers.
#include "ddp/train/flat_optimizer.h"

#include <cmath>

#include "ddp/compat.h"
#include "ddp/error.h"

namespace ddp {

FlatOptimizer::FlatOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                             FlatOptimizerOptions options)
    : o_(std::move(options)), params_(std::move(params)), grads_(std::move(grads)) {
  check_user(o_.name() == "sgd" || o_.name() == "adam" || o_.name() == "adamw",
             "unknown optimizer '" + o_.name() + "'.", "use --optimizer sgd, adam or adamw.");
  TORCH_CHECK(params_.size() == grads_.size() && !params_.empty(), "FlatOptimizer needs matching flat buffers");
  adam_ = o_.name() != "sgd";
  const auto& dev = params_.front().device();
  fused_ = o_.fused() && compat::kHasFusedOptimizers && dev.is_cuda();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].sizes() == grads_[i].sizes(), "flat parameter and gradient buffers differ in size");
    m_.push_back(torch::zeros_like(params_[i]));
    if (adam_) v_.push_back(torch::zeros_like(params_[i]));
    step_.push_back(torch::zeros({}, params_[i].options().dtype(torch::kFloat)));
  }
  lr_t_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(dev));
  set_lr(o_.lr());
}

void FlatOptimizer::set_lr(double lr) {
  lr_ = lr;
  if (fused_) lr_t_.fill_(lr);
}

int64_t FlatOptimizer::steps_taken() const {
  return fused_ ? static_cast<int64_t>(step_.front().item<float>()) : host_step_;
}

void FlatOptimizer::step(const torch::Tensor& found_inf) {
  torch::NoGradGuard no_grad;
  if (fused_) {
    for (auto& s : step_) s.add_(1);
    if (adam_)
      compat::fused_adam(params_, grads_, m_, v_, step_, lr_t_, o_.beta1(), o_.beta2(), o_.weight_decay(), o_.eps(),
                         o_.name() == "adamw", found_inf);
    else
      compat::fused_sgd(params_, grads_, m_, o_.weight_decay(), o_.momentum(), lr_t_, found_inf);
    // A skipped (overflowed) step does not count, as in PyTorch's GradScaler.
    if (found_inf.defined())
      for (auto& s : step_) s.sub_(found_inf.squeeze());  // [1] -> [] (view({}) would pick the dtype overload)
    return;
  }
  check_user(!found_inf.defined(), "fp16 loss scaling needs the fused CUDA optimizers of LibTorch 2.2 or later.",
             "use --amp bf16 (or off) with this build.");
  ++host_step_;
  const double wd = o_.weight_decay();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    torch::Tensor g = grads_[i];
    if (!adam_) {
      // torch::optim::SGD (dampening 0, no Nesterov); a zero buffer makes the
      // first step's buf equal the gradient, as its clone does.
      if (wd != 0) g = g.add(p, wd);
      if (o_.momentum() != 0) g = m_[i].mul_(o_.momentum()).add_(g);
      p.add_(g, -lr_);
      continue;
    }
    // torch::optim::Adam / AdamW, whole buffer at once.
    const double bc1 = 1 - std::pow(o_.beta1(), static_cast<double>(host_step_));
    const double bc2 = 1 - std::pow(o_.beta2(), static_cast<double>(host_step_));
    if (o_.name() == "adamw") {
      if (wd != 0) p.mul_(1 - lr_ * wd);
    } else if (wd != 0) {
      g = g.add(p, wd);
    }
    m_[i].mul_(o_.beta1()).add_(g, 1 - o_.beta1());
    v_[i].mul_(o_.beta2()).addcmul_(g, g, 1 - o_.beta2());
    auto denom = (v_[i].sqrt() / std::sqrt(bc2)).add_(o_.eps());
    p.addcdiv_(m_[i], denom, -lr_ / bc1);
  }
}

void FlatOptimizer::save(TensorMap& state) const {
  state["name"] = string_tensor(o_.name());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto k = std::to_string(i);
    // The composed path counts on the host; the fused one on the device.
    auto step = fused_ ? step_[i].detach().cpu() : torch::full({}, static_cast<double>(host_step_), torch::kFloat);
    state["step/" + k] = step;
    state["m/" + k] = m_[i].detach().cpu();
    if (adam_) state["v/" + k] = v_[i].detach().cpu();
  }
}

void FlatOptimizer::load(const TensorMap& state) {
  auto name = state.find("name");
  check_user(name != state.end() && tensor_string(name->second) == o_.name(),
             "the checkpoint's optimizer state is not for --optimizer " + o_.name() + ".",
             "resume with the optimizer that wrote it.");
  torch::NoGradGuard no_grad;
  auto read = [&](const std::string& key, torch::Tensor& dst) {
    auto src = state.find(key);
    check_user(src != state.end() && src->second.sizes() == dst.sizes(),
               "the checkpoint's optimizer state '" + key + "' does not fit this model.",
               "resume with the model and optimizer that wrote it.");
    dst.copy_(src->second);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto k = std::to_string(i);
    read("step/" + k, step_[i]);
    read("m/" + k, m_[i]);
    if (adam_) read("v/" + k, v_[i]);
  }
  host_step_ = static_cast<int64_t>(step_.front().item<float>());
}

}  // namespace ddp
