// Building a model by name: what --model and --stem select.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ddp/models/net.h"

namespace ddp::models {

struct ModelSpec {
  std::string name = "cnn";        // cnn | resnet18 | resnet34 | resnet50
  std::string stem = "auto";       // auto | small | imagenet
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  std::vector<int64_t> input_hw = {28, 28};
  std::string recompute = "none";  // --recompute: none | blocks | blocks:N | stages (the ResNets)
};

/// Names accepted by make_model().
std::vector<std::string> model_names();

/// Builds the model. "auto" stem picks "small" for inputs up to 64 px and
/// "imagenet" above. Throws UserError for an unknown name or stem, or for an
/// input too small for the model.
std::shared_ptr<Net> make_model(const ModelSpec& spec);

}  // namespace ddp::models
