// The dataset interface, in the seed template's spirit: a size, and one
// (input, target) example per index. Datasets that hold everything in memory
// may also override get_batch() to gather a whole batch at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddp::data {

struct Example {
  torch::Tensor input;   // float32, C x H x W (images) or any shape
  torch::Tensor target;  // int64 scalar class index, or float tensor for regression
};

struct Batch {
  torch::Tensor input;   // B x ...
  torch::Tensor target;  // B (classes) or B x ... (regression)
};

/// What a sample's random draws depend on, besides its position in this
/// rank's order for the epoch.
struct DrawKey {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t rank = 0;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  /// Number of examples.
  virtual int64_t size() const = 0;
  /// Example `index`, 0 <= index < size(). Must be safe to call from several
  /// threads at once.
  virtual Example get(int64_t index) const = 0;
  /// Examples `indices`, stacked. The default stacks get().
  virtual Batch get_batch(const std::vector<int64_t>& indices) const;
  /// The batch the Loader asks for: indices[j] sits at `first_position + j`
  /// in this rank's order for the epoch. Datasets that augment each sample
  /// before stacking (images of different sizes) draw from (key, position);
  /// the default ignores both and calls get_batch(indices).
  virtual Batch get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                                int64_t first_position) const;
  /// Shape of one input, e.g. {1, 28, 28}.
  virtual std::vector<int64_t> input_shape() const = 0;
  /// Classes for classification; 0 for regression.
  virtual int64_t num_classes() const = 0;
  /// Shown in logs, e.g. "fashion-mnist (train)".
  virtual std::string name() const = 0;
};

using DatasetPtr = std::shared_ptr<const Dataset>;

/// Train and test splits of one source.
struct Splits {
  DatasetPtr train, test;
  /// Per-channel mean and std used to normalise inputs.
  std::vector<double> mean, std;
  bool synthetic = false;
  /// The train dataset handles augmentation itself (image folders: random-
  /// resized crop and flip per image), so the trainer adds no batch
  /// augmentation on top.
  bool train_augmented = false;
};

}  // namespace ddp::data
