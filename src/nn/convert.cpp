// convert_layers: torch::nn layers inside Sequentials become ddp::nn's.
#include "ddp/nn/convert.h"

#include <set>
#include <sstream>

#include "ddp/nn/layers.h"

namespace ddp::nn {
namespace {

using torch::nn::AnyModule;
using torch::nn::Module;

enum class Kind { kOther, kLinear, kLayerNorm, kBatchNorm };

template <typename T>
bool is(const Module& m) {
  return dynamic_cast<const T*>(&m) != nullptr;
}

// A torch::nn layer that convert_layers turns into a ddp::nn one (not one
// that already is).
Kind kind_of(const Module& m) {
  if (is<torch::nn::LinearImpl>(m) && !is<LinearImpl>(m)) return Kind::kLinear;
  if (is<torch::nn::LayerNormImpl>(m) && !is<LayerNormImpl>(m)) return Kind::kLayerNorm;
  if (is<torch::nn::BatchNorm1dImpl>(m) || is<torch::nn::BatchNorm2dImpl>(m) || is<torch::nn::BatchNorm3dImpl>(m))
    return Kind::kBatchNorm;
  return Kind::kOther;
}

// The ddp::BatchNorm for LibTorch's, holding its tensors; empty where its
// momentum is nullopt (a cumulative average, which ddp::BatchNorm lacks).
template <typename TorchBatchNorm>
AnyModule batch_norm_like(const TorchBatchNorm& layer, int dim) {
  if (!layer.options.momentum().has_value()) return {};
  auto make = dim == 1 ? BatchNorm1d : dim == 2 ? BatchNorm2d : BatchNorm3d;
  auto bn = make(layer.options, Activation::kNone);
  bn->share_tensors_of(layer);
  return AnyModule(bn);
}

AnyModule replacement(const Module& m, Kind kind) {
  switch (kind) {
    case Kind::kLinear:
      return AnyModule(Linear(LinearImpl::sharing(dynamic_cast<const torch::nn::LinearImpl&>(m), Activation::kNone)));
    case Kind::kLayerNorm:
      return AnyModule(LayerNorm(LayerNormImpl::sharing(dynamic_cast<const torch::nn::LayerNormImpl&>(m))));
    case Kind::kBatchNorm:
      if (auto* b = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m)) return batch_norm_like(*b, 1);
      if (auto* b = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) return batch_norm_like(*b, 2);
      return batch_norm_like(dynamic_cast<const torch::nn::BatchNorm3dImpl&>(m), 3);
    case Kind::kOther: break;
  }
  return {};
}

// The activation module at `next` folded into the converted layer `layer`
// (ReLU into a Linear or BatchNorm; GELU, exact or tanh, into a Linear).
bool fold_activation(AnyModule& layer, const AnyModule& next) {
  const auto& n = *next.ptr();
  if (auto* linear = dynamic_cast<LinearImpl*>(layer.ptr().get())) {
    if (is<torch::nn::ReLUImpl>(n)) linear->activation = Activation::kRelu;
    else if (auto* gelu = dynamic_cast<const torch::nn::GELUImpl*>(&n))
      linear->activation = gelu->options.approximate() == "tanh" ? Activation::kGeluTanh : Activation::kGelu;
    else return false;
    return true;
  }
  if (auto* bn = dynamic_cast<ddp::BatchNormImpl*>(layer.ptr().get())) {
    if (!is<torch::nn::ReLUImpl>(n)) return false;
    bn->options.relu(true);
    return true;
  }
  return false;
}

std::string join(const std::string& path, const std::string& name) { return path.empty() ? name : path + "." + name; }

class Converter {
 public:
  explicit Converter(LayerConversion& out) : out_(out) {}

  void visit(Module& m, const std::string& path) {
    if (!seen_.insert(&m).second) return;
    // ddptrain's own models chose their layers (the GPT runs its kernels on
    // torch::nn::Linear's weights): left as they are, and not reported.
    if (m.name().rfind("ddp::models::", 0) == 0) return;
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m);
    if (seq) convert_sequential(*seq, path);
    for (const auto& child : m.named_children()) {
      const auto child_path = join(path, child.key());
      if (!seq && kind_of(*child.value()) != Kind::kOther) {
        out_.kept.emplace_back(child_path, is<torch::nn::ModuleListImpl>(m) ? "in a ModuleList"
                                           : is<torch::nn::ModuleDictImpl>(m) ? "in a ModuleDict"
                                                                               : "a member of " + m.name());
      }
      visit(*child.value(), child_path);
    }
  }

 private:
  // Rebuilds `seq` in place with its layers converted: the parent's handle
  // points at the same SequentialImpl, which now holds the new layers.
  void convert_sequential(torch::nn::SequentialImpl& seq, const std::string& path) {
    std::vector<std::string> names;
    for (const auto& child : seq.named_children()) names.push_back(child.key());
    std::vector<AnyModule> modules(seq.begin(), seq.end());
    if (names.size() != modules.size()) return;  // not as Sequential::push_back registers them: leave it
    bool changed = false;
    for (size_t i = 0; i < modules.size(); ++i) {
      const Kind kind = kind_of(*modules[i].ptr());
      if (kind == Kind::kOther) continue;
      const auto where = join(path, names[i]);
      {
        // Held by the Sequential twice (its list and its registry), by
        // `modules` and by `p`: anything above that is a holder outside.
        auto p = modules[i].ptr();
        if (p.use_count() > 4) {
          out_.kept.emplace_back(where, "also held outside its Sequential");
          continue;
        }
      }
      auto fresh = replacement(*modules[i].ptr(), kind);
      if (fresh.is_empty()) {
        out_.kept.emplace_back(where, "momentum nullopt");
        continue;
      }
      modules[i] = std::move(fresh);
      changed = true;
      (kind == Kind::kLinear ? out_.linear : kind == Kind::kLayerNorm ? out_.layer_norm : out_.batch_norm) += 1;
      if (i + 1 < modules.size() && fold_activation(modules[i], modules[i + 1])) {
        modules[i + 1] = AnyModule(torch::nn::Identity());
        ++out_.folded_activations;
      }
    }
    if (!changed) return;
    torch::nn::SequentialImpl rebuilt;
    for (size_t i = 0; i < modules.size(); ++i) rebuilt.push_back(names[i], modules[i]);
    rebuilt.train(seq.is_training());
    seq = rebuilt;  // Module's copy: the list, the registry and the training flag
  }

  LayerConversion& out_;
  std::set<const Module*> seen_;
};

}  // namespace

std::string LayerConversion::summary() const {
  std::ostringstream s;
  s << "layers: ";
  if (converted() > 0) {
    s << converted() << " converted to ddp::nn (";
    const char* sep = "";
    for (const auto& [n, what] : {std::pair<int, const char*>{linear, "Linear"}, {layer_norm, "LayerNorm"},
                                  {batch_norm, "BatchNorm"}}) {
      if (n == 0) continue;
      s << sep << n << " " << what;
      sep = ", ";
    }
    if (folded_activations > 0) s << "; " << folded_activations << " activation(s) folded in";
    s << ")";
  } else {
    s << "none converted to ddp::nn";
  }
  if (!kept.empty()) {
    s << "; " << kept.size() << " kept as torch::nn (";
    for (size_t i = 0; i < kept.size() && i < 3; ++i) s << (i ? ", " : "") << kept[i].first << ": " << kept[i].second;
    if (kept.size() > 3) s << ", and " << kept.size() - 3 << " more";
    s << "); Hint: declare them as ddp::nn::Linear, ddp::nn::LayerNorm, ddp::nn::BatchNorm2d for the CUDA kernels";
  }
  return s.str();
}

LayerConversion convert_layers(torch::nn::Module& model) {
  LayerConversion out;
  if (kind_of(model) != Kind::kOther) out.kept.emplace_back("(the model)", "the caller holds it");
  Converter(out).visit(model, "");
  return out;
}

}  // namespace ddp::nn
