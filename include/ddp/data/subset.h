// A view of some of a dataset's samples, and the validation split that
// --val-split carves out of any training set with it.
//
// Carving by index (not by copying samples) works for every dataset, those
// that read files per sample included, and keeps each sample's own draws
// (augmentation keyed by position) exactly as the whole set would make them.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "ddp/data/dataset.h"

namespace ddp::data {

/// The samples `indices` of `base`, in that order: sample i of the subset
/// is sample indices[i] of base.
class Subset : public Dataset {
 public:
  Subset(DatasetPtr base, std::vector<int64_t> indices, std::string name);

  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  Batch get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                        int64_t first_position) const override;
  std::shared_ptr<DeviceStage> device_stage() const override { return base_->device_stage(); }
  std::vector<int64_t> input_shape() const override { return base_->input_shape(); }
  int64_t num_classes() const override { return base_->num_classes(); }
  std::string name() const override { return name_; }

  const std::vector<int64_t>& indices() const { return indices_; }

 private:
  std::vector<int64_t> to_base(const std::vector<int64_t>& indices) const;

  DatasetPtr base_;
  std::vector<int64_t> indices_;
  std::string name_;
};

/// The indices of a dataset of `size` samples that go to validation:
/// round(fraction x size) of them, drawn by a permutation that depends on
/// `seed` alone (never on the number of ranks), in ascending order.
std::vector<int64_t> validation_indices(int64_t size, double fraction, uint64_t seed);

/// {train without validation, validation}: `train` cut by
/// validation_indices(train->size(), fraction, seed). A UserError when
/// either part would be empty, naming --val-split.
std::pair<DatasetPtr, DatasetPtr> carve_validation(const DatasetPtr& train, double fraction, uint64_t seed);

/// A dataset of no samples shaped like `like` (e.g. the test split of data
/// that has a validation split only).
DatasetPtr empty_like(const DatasetPtr& like, const std::string& name);

}  // namespace ddp::data
