// Turning a model's torch::nn layers into ddp::nn's (layers.h), as
// PyTorch's convert_sync_batchnorm turns BatchNorms into SyncBatchNorms.
//
// What C++ allows. A parent module calls its children through the handles
// it holds in its own members (`fc1(x)`), which no code outside it can
// reach: Module::replace_module changes the registry, not the member. So a
// layer that a model holds in a member stays what it is, and is reported
// with the fix (declare it as the ddp::nn type). A layer inside a
// torch::nn::Sequential is reachable: the Sequential calls what it holds,
// and it is rebuilt in place with the ddp::nn layers, under the same names,
// holding the same parameter tensors (state_dict names and values, ties
// between layers and the optimizer's view all stay). There a ReLU (or GELU)
// right after a converted layer is folded into it, and an Identity takes its
// place and name.
//
// Refused, and reported: a layer that something outside its Sequential also
// holds (its owner might call it: the conversion would split one layer in
// two), a layer inside a ModuleList or ModuleDict (their users take
// elements by type), a BatchNorm with momentum nullopt, and the model
// itself. ddptrain's own models (ddp::models) are left alone.
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace ddp::nn {

struct LayerConversion {
  int linear = 0, layer_norm = 0, batch_norm = 0;
  /// ReLU/GELU modules folded into the converted layer before them.
  int folded_activations = 0;
  /// The layers of those kinds that stayed torch::nn: {path, why}.
  std::vector<std::pair<std::string, std::string>> kept;

  int converted() const { return linear + layer_norm + batch_norm; }
  /// One line: what was converted, and what was kept, why and the fix.
  std::string summary() const;
};

/// Converts `model`'s torch::nn::Linear, LayerNorm and BatchNorm{1,2,3}d
/// into ddp::nn's where C++ allows (see above); draws no random numbers.
/// Call it before the optimizer takes the parameters (ddptrain's trainer
/// does, unless --convert-layers off).
LayerConversion convert_layers(torch::nn::Module& model);

}  // namespace ddp::nn
