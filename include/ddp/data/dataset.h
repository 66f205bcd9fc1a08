// The dataset interface, in the seed template's spirit: a size, and one
// example per index, as named tensors ("input", "target", or any names of
// your own). Datasets that hold everything in memory may also override
// get_batch() to gather a whole batch at once.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddp::data {

/// Named tensors: one example, or a batch of them (each name stacked along a
/// new first dimension). The built-in datasets give "input" and "target";
/// a dataset of your own may give any names ("input", "target", "weight",
/// "mask", ...), and the task reads them by name. Ordered by name, so every
/// rank walks them in the same order.
class TensorDict {
 public:
  TensorDict() = default;
  /// {"input": input, "target": target}: what the built-in datasets give.
  TensorDict(torch::Tensor input, torch::Tensor target);
  TensorDict(std::initializer_list<std::pair<const std::string, torch::Tensor>> items) : items_(items) {}

  /// The tensor called `name`, inserted (undefined) if absent, as std::map does.
  torch::Tensor& operator[](const std::string& name) { return items_[name]; }
  /// The tensor called `name`; a UserError listing the names present if absent.
  const torch::Tensor& at(const std::string& name) const;
  torch::Tensor& at(const std::string& name);
  bool contains(const std::string& name) const { return items_.count(name) > 0; }
  const torch::Tensor& input() const { return at("input"); }
  torch::Tensor& input() { return at("input"); }
  const torch::Tensor& target() const { return at("target"); }
  torch::Tensor& target() { return at("target"); }

  std::vector<std::string> names() const;
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  /// Length of the first dimension ("input" if present, else the first name).
  int64_t batch_size() const;
  auto begin() { return items_.begin(); }
  auto end() { return items_.end(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::map<std::string, torch::Tensor> items_;
};

using Example = TensorDict;
using Batch = TensorDict;

/// Stacks examples name by name; every example must have the same names.
Batch stack(const std::vector<Example>& examples);

/// What a sample's random draws depend on, besides its position in this
/// rank's order for the epoch.
struct DrawKey {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t rank = 0;
};

/// Work on a batch that waits for the training device: a dataset whose
/// batches leave their last stage to the GPU (image folders decoding JPEGs
/// with nvJPEG) hands one out from Dataset::device_stage(). The trainer runs
/// it on each batch before the batch's tensors move to the device (on the
/// DeviceFeeder's side stream, so it overlaps the step); afterwards the
/// batch looks like any other, with "input" on the device.
class DeviceStage {
 public:
  virtual ~DeviceStage() = default;
  virtual void run(TensorDict& batch, torch::Device device) = 0;
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
  /// The device stage its batches need (see DeviceStage), or null: most
  /// datasets finish their batches on the CPU.
  virtual std::shared_ptr<DeviceStage> device_stage() const { return nullptr; }
  /// Shape of one "input", e.g. {1, 28, 28}; empty when not known. The
  /// built-in models are sized from it.
  virtual std::vector<int64_t> input_shape() const { return {}; }
  /// Classes for classification; 0 otherwise (regression, or not known).
  virtual int64_t num_classes() const { return 0; }
  /// Shown in logs, e.g. "fashion-mnist (train)".
  virtual std::string name() const { return "dataset"; }
  /// A short text that changes when the data does, kept in checkpoints: a
  /// resumed run whose data has another fingerprint (or name, or size) stops
  /// before training (data/identity.h). It must be cheap (file sizes, a
  /// header, a hash of a file list or of a few samples; never every sample)
  /// and the same on every start with the same data, wherever it lies: so
  /// no path, time or random draw. "" (the default): not compared, only the
  /// name and size are.
  virtual std::string fingerprint() const { return ""; }
};

using DatasetPtr = std::shared_ptr<const Dataset>;

/// Train, validation and test splits of one source. Validation (when
/// there is one) chooses: the monitor, best.pt and --stop-at read it every
/// epoch, and test is evaluated on best.pt at the end. Without one, test
/// chooses, as it always did. A task may give its own validation split, or
/// leave it null for --val-split to carve out of train (data/subset.h).
struct Splits {
  DatasetPtr train, test;
  DatasetPtr val;  // null: none
  /// Per-channel mean and std used to normalise inputs.
  std::vector<double> mean, std;
  bool synthetic = false;
  /// The train dataset handles augmentation itself (image folders: random-
  /// resized crop and flip per image), so the trainer adds no batch
  /// augmentation on top.
  bool train_augmented = false;
};

}  // namespace ddp::data
