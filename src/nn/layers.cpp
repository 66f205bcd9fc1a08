// ddp::nn layers: LibTorch's layers whose forward takes ddptrain's kernels
// where they apply (the kernels' conditions live with them: models/
// fused_linear.h, models/fused_layer_norm.h, train/fused_cross_entropy.h,
// dist/sync_batchnorm.h).
#include "ddp/nn/layers.h"

#include <ATen/CPUGeneratorImpl.h>

#include "ddp/error.h"
#include "ddp/models/fused_layer_norm.h"
#include "ddp/models/max_pool.h"
#include "ddp/train/fused_cross_entropy.h"

namespace ddp::nn {
namespace {

namespace F = torch::nn::functional;

// Making a layer draws its initial weights from the default CPU generator;
// a clone, or a conversion that adopts another layer's tensors, must not
// move the stream that the rest of the program draws from.
class KeepCpuRandomState {
 public:
  KeepCpuRandomState() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
  }
  ~KeepCpuRandomState() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  KeepCpuRandomState(const KeepCpuRandomState&) = delete;
  KeepCpuRandomState& operator=(const KeepCpuRandomState&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
};

// A deep copy made as `make()` makes the layer, its tensors then copied
// (to `device`, where given), as LibTorch's Cloneable does, but without
// drawing random numbers.
template <typename Impl, typename Make>
std::shared_ptr<torch::nn::Module> clone_layer(const Impl& self, const c10::optional<torch::Device>& device,
                                               Make make) {
  std::shared_ptr<Impl> copy;
  {
    KeepCpuRandomState keep;
    copy = make();
  }
  torch::NoGradGuard no_grad;
  auto copy_into = [&](const torch::OrderedDict<std::string, torch::Tensor>& from,
                       torch::OrderedDict<std::string, torch::Tensor> to) {
    for (const auto& item : from) {
      auto data = device && item.value().device() != *device ? item.value().to(*device) : item.value().clone();
      to[item.key()].set_data(data);
    }
  };
  copy_into(self.named_parameters(/*recurse=*/false), copy->named_parameters(/*recurse=*/false));
  copy_into(self.named_buffers(/*recurse=*/false), copy->named_buffers(/*recurse=*/false));
  copy->train(self.is_training());
  return copy;
}

torch::Tensor activate(const torch::Tensor& y, Activation activation) {
  switch (activation) {
    case Activation::kNone: return y;
    case Activation::kRelu: return torch::relu(y);
    case Activation::kGelu: return torch::gelu(y);
    case Activation::kGeluTanh: return torch::gelu(y, "tanh");
  }
  return y;
}

ddp::BatchNorm batch_norm(const torch::nn::BatchNormOptions& o, int dim, Activation activation) {
  check_user(o.momentum().has_value(),
             "ddp::nn::BatchNorm" + std::to_string(dim) + "d(" + std::to_string(o.num_features()) +
                 ") has momentum nullopt (a cumulative average), which ddp::BatchNorm does not keep.",
             "give it a momentum (LibTorch's default is 0.1), or keep torch::nn::BatchNorm" + std::to_string(dim) + "d.");
  check_user(activation == Activation::kNone || activation == Activation::kRelu,
             std::string("ddp::nn::BatchNorm") + std::to_string(dim) + "d takes Activation::kRelu or kNone, not " +
                 activation_name(activation) + ".",
             "apply that activation after the layer.");
  return ddp::BatchNorm(ddp::BatchNormOptions(o.num_features(), dim)
                            .eps(o.eps())
                            .momentum(*o.momentum())
                            .affine(o.affine())
                            .track_running_stats(o.track_running_stats())
                            .relu(activation == Activation::kRelu));
}

}  // namespace

const char* activation_name(Activation activation) {
  switch (activation) {
    case Activation::kNone: return "none";
    case Activation::kRelu: return "relu";
    case Activation::kGelu: return "gelu";
    case Activation::kGeluTanh: return "gelu_tanh";
  }
  return "?";
}

// --- Linear -----------------------------------------------------------------

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options, Activation activation)
    : torch::nn::LinearImpl(options), activation(activation) {}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
  if (activation == Activation::kGelu) return models::linear_gelu(input, weight, bias);
  return activate(models::linear_bias(input, weight, bias), activation);
}

std::shared_ptr<LinearImpl> LinearImpl::sharing(const torch::nn::LinearImpl& layer, Activation activation) {
  std::shared_ptr<LinearImpl> out;
  {
    KeepCpuRandomState keep;
    out = std::make_shared<LinearImpl>(layer.options, activation);
  }
  out->weight = out->parameters_["weight"] = layer.weight;
  if (layer.options.bias()) out->bias = out->parameters_["bias"] = layer.bias;
  out->train(layer.is_training());
  return out;
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::nn::Linear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << (options.bias() ? "true" : "false");
  if (activation != Activation::kNone) stream << ", activation=" << activation_name(activation);
  stream << ")";
}

std::shared_ptr<torch::nn::Module> LinearImpl::clone(const c10::optional<torch::Device>& device) const {
  return clone_layer(*this, device, [&] { return std::make_shared<LinearImpl>(options, activation); });
}

// --- LayerNorm --------------------------------------------------------------

LayerNormImpl::LayerNormImpl(const torch::nn::LayerNormOptions& options) : torch::nn::LayerNormImpl(options) {}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& input) {
  if (options.normalized_shape().size() == 1 && options.elementwise_affine())
    return models::add_layer_norm(input, {}, weight, bias, options.eps()).second;
  return torch::nn::LayerNormImpl::forward(input);
}

std::pair<torch::Tensor, torch::Tensor> LayerNormImpl::forward_add(const torch::Tensor& x,
                                                                    const torch::Tensor& branch) {
  if (options.normalized_shape().size() == 1 && options.elementwise_affine())
    return models::add_layer_norm(x, branch, weight, bias, options.eps());
  auto sum = x + branch;
  return {sum, torch::nn::LayerNormImpl::forward(sum)};
}

std::shared_ptr<LayerNormImpl> LayerNormImpl::sharing(const torch::nn::LayerNormImpl& layer) {
  auto out = std::make_shared<LayerNormImpl>(layer.options);  // ones and zeros: no random numbers
  if (layer.options.elementwise_affine()) {
    out->weight = out->parameters_["weight"] = layer.weight;
    out->bias = out->parameters_["bias"] = layer.bias;
  }
  out->train(layer.is_training());
  return out;
}

void LayerNormImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::nn::LayerNorm(" << c10::IntArrayRef(options.normalized_shape()) << ", eps=" << options.eps()
         << ", elementwise_affine=" << (options.elementwise_affine() ? "true" : "false") << ")";
}

std::shared_ptr<torch::nn::Module> LayerNormImpl::clone(const c10::optional<torch::Device>& device) const {
  return clone_layer(*this, device, [&] { return std::make_shared<LayerNormImpl>(options); });
}

// --- Embedding --------------------------------------------------------------

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options) : torch::nn::EmbeddingImpl(options) {}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& indices) {
  // The fast path's backward adds every row; LibTorch's handles the rest
  // (a padding row that gets no gradient, max_norm's renormalisation,
  // frequency scaling, sparse gradients).
  const bool plain = !options.padding_idx().has_value() && !options.max_norm().has_value() &&
                     !options.scale_grad_by_freq() && !options.sparse();
  if (!plain) {
    pass_.reset();
    return torch::nn::EmbeddingImpl::forward(indices);
  }
  pass_.emplace(weight);
  return pass_->embed(indices);
}

torch::Tensor EmbeddingImpl::head(const torch::Tensor& x) {
  if (!pass_) return models::linear_bias(x, weight, {});
  auto logits = pass_->head(x);
  pass_.reset();  // one head per forward
  return logits;
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ")";
}

std::shared_ptr<torch::nn::Module> EmbeddingImpl::clone(const c10::optional<torch::Device>& device) const {
  return clone_layer(*this, device, [&] { return std::make_shared<EmbeddingImpl>(options); });
}

// --- CrossEntropyLoss -------------------------------------------------------

CrossEntropyLossImpl::CrossEntropyLossImpl(const torch::nn::CrossEntropyLossOptions& options)
    : torch::nn::CrossEntropyLossImpl(options) {}

torch::Tensor CrossEntropyLossImpl::forward(const torch::Tensor& input, const torch::Tensor& target) {
  const auto reduction = torch::enumtype::get_enum_name(options.reduction());
  const bool mean = reduction == "kMean", sum = reduction == "kSum";
  if ((mean || sum) && !options.weight().defined() && options.ignore_index() == -100 &&
      options.label_smoothing() == 0 && fused_cross_entropy_enabled() && input.dim() == 2 &&
      target.dim() == 1 && fused_cross_entropy_applies(input, target))
    return fused_cross_entropy(input, target, sum);
  return torch::nn::CrossEntropyLossImpl::forward(input, target);
}

void CrossEntropyLossImpl::pretty_print(std::ostream& stream) const { stream << "ddp::nn::CrossEntropyLoss()"; }

std::shared_ptr<torch::nn::Module> CrossEntropyLossImpl::clone(const c10::optional<torch::Device>& device) const {
  return clone_layer(*this, device, [&] { return std::make_shared<CrossEntropyLossImpl>(options); });
}

// --- MaxPool2d --------------------------------------------------------------

MaxPool2dImpl::MaxPool2dImpl(const torch::nn::MaxPool2dOptions& options) : torch::nn::MaxPool2dImpl(options) {}

torch::Tensor MaxPool2dImpl::forward(const torch::Tensor& input) {
  const auto &k = *options.kernel_size(), &s = *options.stride(), &p = *options.padding(), &d = *options.dilation();
  if (k[0] == k[1] && s[0] == s[1] && p[0] == p[1] && d[0] == 1 && d[1] == 1 && !options.ceil_mode())
    return models::max_pool2d(input, k[0], s[0], p[0]);
  return torch::nn::MaxPool2dImpl::forward(input);
}

void MaxPool2dImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::nn::MaxPool2d(kernel_size=" << options.kernel_size() << ", stride=" << options.stride()
         << ", padding=" << options.padding() << ")";
}

std::shared_ptr<torch::nn::Module> MaxPool2dImpl::clone(const c10::optional<torch::Device>& device) const {
  return clone_layer(*this, device, [&] { return std::make_shared<MaxPool2dImpl>(options); });
}

// --- BatchNorm --------------------------------------------------------------

ddp::BatchNorm BatchNorm1d(const torch::nn::BatchNormOptions& options, Activation activation) {
  return batch_norm(options, 1, activation);
}
ddp::BatchNorm BatchNorm2d(const torch::nn::BatchNormOptions& options, Activation activation) {
  return batch_norm(options, 2, activation);
}
ddp::BatchNorm BatchNorm3d(const torch::nn::BatchNormOptions& options, Activation activation) {
  return batch_norm(options, 3, activation);
}

}  // namespace ddp::nn
