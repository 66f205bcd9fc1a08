// A task with two inputs, a loss of its own and a metric of its own.
//
// - Two inputs: each example is an image and a per-sample weight (how much
//   its label is trusted), as named tensors {"input", "weight", "target"}.
// - A custom loss: the weighted cross-entropy, plus an auxiliary term (an
//   extra head predicts the image's brightness) scaled by --aux-weight, a
//   flag of the task's own. Both terms are logged by name.
// - A custom metric: macro-F1, computed from a confusion matrix that every
//   rank fills and ddptrain all-reduces, and used as the monitor (best.pt,
//   --stop-at).
//
// train.cpp runs it; tests/worker uses it to check that the metric over 2
// ranks with uneven shards equals the 1-rank value.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ddp/app.h>

namespace two_inputs {

namespace F = torch::nn::functional;
constexpr int64_t kClasses = 5, kSide = 20;

// Class k: a bright square in place k. In the training split one sample in
// four has a wrong label and a low weight, so the weighted loss learns to
// trust it less; the test split's labels are all true.
class SquaresDataset : public ddp::data::Dataset {
 public:
  SquaresDataset(int64_t size, uint64_t seed, bool noisy) : size_(size), seed_(seed), noisy_(noisy) {}
  int64_t size() const override { return size_; }
  ddp::data::Example get(int64_t index) const override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + static_cast<uint64_t>(index));
    const int64_t label = index % kClasses;
    const double brightness = 0.5 + torch::rand({1}, gen).item<double>();
    auto image = 0.3 * torch::randn({1, kSide, kSide}, gen);
    const int64_t row = 2 + (label % 3) * 6, col = 2 + (label / 3) * 9;
    image.slice(1, row, row + 5).slice(2, col, col + 5) += 2.0 * brightness;
    const bool noisy = noisy_ && index % 4 == 3;
    const int64_t shown = noisy ? (label + 1) % kClasses : label;
    return {{"input", image},
            {"weight", torch::tensor(noisy ? 0.1f : 1.0f)},
            {"brightness", torch::tensor(static_cast<float>(brightness))},
            {"target", torch::tensor(shown, torch::kLong)}};
  }
  std::vector<int64_t> input_shape() const override { return {1, kSide, kSide}; }
  int64_t num_classes() const override { return kClasses; }
  std::string name() const override { return "squares"; }

 private:
  int64_t size_;
  uint64_t seed_;
  bool noisy_;
};

// Two heads on one trunk: class logits and a brightness estimate.
struct TwoHeadNetImpl : torch::nn::Module {
  TwoHeadNetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        classes(register_module("classes", torch::nn::Linear(16 * 4 * 4, kClasses))),
        bright(register_module("bright", torch::nn::Linear(16 * 4 * 4, 1))) {}
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    auto h = torch::adaptive_avg_pool2d(torch::relu(conv(x)), {4, 4}).flatten(1);
    return {classes(h), bright(h).squeeze(1)};
  }
  torch::nn::Conv2d conv;
  torch::nn::Linear classes, bright;
};
TORCH_MODULE(TwoHeadNet);

struct WeightedTask : ddp::Task {
  TwoHeadNet model{nullptr};
  double aux_weight = 0;

  void add_flags(ddp::Config& config) override {
    config.add_flag("--aux-weight", "weight of the auxiliary brightness loss", 0.1);
    config.augment = "none";  // a flip would move the square that defines the class
  }

  ddp::data::Splits make_data(const ddp::Config& c, ddp::World&) override {
    ddp::data::Splits data;
    data.train = std::make_shared<SquaresDataset>(c.train_samples > 0 ? c.train_samples : 8000, 1, /*noisy=*/true);
    data.test = std::make_shared<SquaresDataset>(c.test_samples > 0 ? c.test_samples : 2001, 2, /*noisy=*/false);
    return data;
  }

  ddp::ModulePtr make_model(const ddp::Config& config, const ddp::data::Splits&) override {
    aux_weight = config.flag<double>("aux-weight");
    arch_ = "two-head-net";
    model = TwoHeadNet();
    return model.ptr();
  }

  ddp::StepOutput training_step(const ddp::data::Batch& b) override {
    auto [logits, bright] = model(b.input());
    auto per_sample = F::cross_entropy(logits, b.target(), F::CrossEntropyFuncOptions().reduction(torch::kNone));
    auto weight = b.at("weight");
    auto ce = (per_sample * weight).sum() / weight.sum();
    auto aux = F::mse_loss(bright.to(torch::kFloat), b.at("brightness"));
    return {ce + aux_weight * aux, {{"train_ce", ce}, {"train_aux", aux}}};
  }

  // A K x K confusion matrix (rows: true class, columns: predicted); the
  // trainer sums it over batches and ranks, so every count is exact.
  ddp::TensorMap validation_step(const ddp::data::Batch& b) override {
    auto [logits, bright] = model(b.input());
    auto predicted = logits.argmax(1);
    auto cells = torch::bincount(b.target() * kClasses + predicted, {}, kClasses * kClasses);
    return {{"confusion", cells.view({kClasses, kClasses})}, {"count", torch::tensor(double(b.target().size(0)))}};
  }

  ddp::Metrics validation_metrics(const ddp::Totals& t) override {
    const auto& m = t.at("confusion");
    auto tp = m.diagonal(), fp = m.sum(0) - tp, fn = m.sum(1) - tp;
    auto f1 = 2 * tp / (2 * tp + fp + fn).clamp_min(1);
    return {{"test_f1", f1.mean().item<double>()},
            {"test_acc", tp.sum().item<double>() / t.at("count").item<double>()}};
  }

  ddp::Monitor monitor() const override { return {"test_f1", ddp::Goal::kMax}; }
};

}  // namespace two_inputs
