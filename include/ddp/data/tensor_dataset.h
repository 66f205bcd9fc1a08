// An image classification dataset held in memory as one uint8 tensor.
//
// MNIST-like files and the synthetic dataset both end up as N x C x H x W
// bytes plus N labels. Keeping the bytes (47 MB for Fashion-MNIST) rather
// than normalised floats (188 MB) saves memory; normalisation happens per
// batch, which costs little next to a training step. get_batch() gathers
// with one index_select instead of N get() calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ddp/data/dataset.h"

namespace ddp::data {

class ImageTensorDataset : public Dataset {
 public:
  /// images: uint8 N x C x H x W; labels: int64 N, each in [0, num_classes).
  /// mean and std have one entry per channel, on the 0..1 pixel scale.
  /// `fingerprint`: of the source the loader read (Dataset::fingerprint).
  ImageTensorDataset(torch::Tensor images, torch::Tensor labels, std::vector<double> mean,
                     std::vector<double> std, int64_t num_classes, std::string name,
                     std::string fingerprint = "");

  int64_t size() const override { return images_.size(0); }
  /// Input is float32 C x H x W, ((pixel / 255) - mean) / std; target int64.
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  std::vector<int64_t> input_shape() const override;
  int64_t num_classes() const override { return num_classes_; }
  std::string name() const override { return name_; }
  std::string fingerprint() const override { return fingerprint_; }

  /// The raw bytes and labels, e.g. for tests and statistics.
  const torch::Tensor& images() const { return images_; }
  const torch::Tensor& labels() const { return labels_; }

 private:
  torch::Tensor normalise(const torch::Tensor& bytes) const;

  torch::Tensor images_, labels_;
  torch::Tensor mean_, std_;  // float32 C x 1 x 1, broadcast over H x W
  int64_t num_classes_;
  std::string name_;
  std::string fingerprint_;
};

/// Named tensors held in memory, one sample per row: tabular data (from
/// read_csv, say), embeddings, or any arrays computed ahead. Sample i is
/// {name: tensor[i]} for every name; a batch is one index_select per name.
class NamedTensorDataset : public Dataset {
 public:
  /// Every tensor has the same first dimension (the number of samples);
  /// a UserError naming the tensors otherwise.
  NamedTensorDataset(TensorDict tensors, std::string name);

  int64_t size() const override { return size_; }
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  /// The shape of one "input" row, if there is an "input".
  std::vector<int64_t> input_shape() const override;
  std::string name() const override { return name_; }

  const TensorDict& tensors() const { return tensors_; }

 private:
  TensorDict tensors_;
  int64_t size_ = 0;
  std::string name_;
};

/// The first max rows of t (a copy), or t itself when max <= 0 or t has no
/// more rows: the --max-train/--max-test cut of the in-memory datasets.
torch::Tensor first_rows(const torch::Tensor& t, int64_t max);

}  // namespace ddp::data
