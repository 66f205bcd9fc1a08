// The weights' moving average: one lerp per flat buffer and step.
#include "ddp/train/ema.h"

#include <sstream>

#include "ddp/error.h"

namespace ddp {

WeightEma::WeightEma(torch::nn::Module& model, std::vector<torch::Tensor> flat_params, double decay)
    : decay_(decay), flat_(std::move(flat_params)) {
  std::ostringstream d;
  d << decay;
  check_user(decay > 0 && decay < 1, "--ema " + d.str() + " is not a decay in (0, 1).",
             "e.g. --ema 0.999 (about the last 1000 steps), or --ema 0 for none.");
  TORCH_CHECK(!flat_.empty(), "WeightEma needs the flat parameter buffers");
  torch::NoGradGuard no_grad;
  for (const auto& f : flat_) average_.push_back(f.detach().clone());
  // A parameter is a view into one flat buffer (its channels-last strides
  // included): its average is the same view of that buffer's average.
  for (const auto& p : model.named_parameters()) {
    for (size_t k = 0; k < flat_.size(); ++k) {
      if (!p.value().is_alias_of(flat_[k])) continue;
      const int64_t offset = p.value().storage_offset() - flat_[k].storage_offset();
      named_.emplace_back(p.key(), average_[k].as_strided(p.value().sizes(), p.value().strides(),
                                                          average_[k].storage_offset() + offset));
      break;
    }
  }
  updates_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(flat_.front().device()));
}

void WeightEma::update() {
  torch::NoGradGuard no_grad;
  // The weight of the new weights, 1 - min(DECAY, (1 + n) / (10 + n)), made
  // on the device: a captured graph replays it with each step's count.
  const auto toward = 1.0 - ((updates_ + 1.0) / (updates_ + 10.0)).clamp_max(decay_);
  for (size_t k = 0; k < flat_.size(); ++k) average_[k].lerp_(flat_[k], toward.to(average_[k].scalar_type()));
  updates_.add_(1.0);
}

int64_t WeightEma::updates() const { return static_cast<int64_t>(updates_.item<double>()); }

torch::Tensor WeightEma::average_of(const std::string& name) const {
  for (const auto& [n, t] : named_)
    if (n == name) return t;
  return {};
}

WeightEma::Swap::Swap(WeightEma& ema, std::function<void()> written) : ema_(ema), written_(std::move(written)) {
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < ema_.flat_.size(); ++k) {
    weights_.push_back(ema_.flat_[k].clone());
    ema_.flat_[k].copy_(ema_.average_[k]);
  }
  if (written_) written_();
}

WeightEma::Swap::~Swap() {
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < ema_.flat_.size(); ++k) ema_.flat_[k].copy_(weights_[k]);
  if (written_) written_();
}

void WeightEma::save(TensorMap& state) const {
  for (const auto& [name, t] : named_) state["ema/" + name] = t.detach().cpu().contiguous();
  state["ema_updates"] = updates_.detach().cpu();
}

void WeightEma::load(const TensorMap& state) {
  auto updates = state.find("ema_updates");
  check_user(updates != state.end(), "the checkpoint holds no average of the weights, but this run has --ema.",
             "resume with the flags of the run that wrote it (it had no --ema).");
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : named_) {
    auto it = state.find("ema/" + name);
    check_user(it != state.end() && it->second.sizes() == t.sizes(),
               "the checkpoint's average of the weights has no '" + name + "' of shape " + c10::str(t.sizes()) + ".",
               "resume with the model of the run that wrote it.");
    t.copy_(it->second);
  }
  updates_.copy_(updates->second);
}

}  // namespace ddp
