// ImageTensorDataset: uint8 images in memory, normalised on the way out.
// NamedTensorDataset: any named tensors in memory, one sample per row.
#include "ddp/data/tensor_dataset.h"

#include <utility>

#include "ddp/error.h"

namespace ddp::data {

ImageTensorDataset::ImageTensorDataset(torch::Tensor images, torch::Tensor labels,
                                       std::vector<double> mean, std::vector<double> std,
                                       int64_t num_classes, std::string name, std::string fingerprint)
    : images_(images.contiguous()),
      labels_(labels.contiguous()),
      num_classes_(num_classes),
      name_(std::move(name)),
      fingerprint_(std::move(fingerprint)) {
  // The loaders in this module build these tensors, so a mismatch is a bug
  // in the caller, not a user mistake.
  TORCH_CHECK(images_.dim() == 4 && images_.scalar_type() == torch::kByte,
              "ImageTensorDataset wants uint8 N x C x H x W images, got ", images_.sizes(), " ",
              images_.scalar_type());
  TORCH_CHECK(labels_.dim() == 1 && labels_.scalar_type() == torch::kLong &&
                  labels_.size(0) == images_.size(0),
              "ImageTensorDataset wants int64 labels of length ", images_.size(0), ", got ",
              labels_.sizes(), " ", labels_.scalar_type());
  const auto channels = static_cast<size_t>(images_.size(1));
  TORCH_CHECK(mean.size() == channels && std.size() == channels,
              "ImageTensorDataset: mean and std need one entry per channel (", channels, ")");
  for (double s : std) TORCH_CHECK(s > 0, "ImageTensorDataset: std must be positive, got ", s);
  const auto c = static_cast<int64_t>(channels);
  mean_ = torch::tensor(mean, torch::kFloat).view({c, 1, 1});
  std_ = torch::tensor(std, torch::kFloat).view({c, 1, 1});
}

torch::Tensor ImageTensorDataset::normalise(const torch::Tensor& bytes) const {
  return bytes.to(torch::kFloat).div_(255.0f).sub_(mean_).div_(std_);
}

Example ImageTensorDataset::get(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size(), name_, ": index ", index, " outside [0, ", size(), ")");
  return {normalise(images_[index]), labels_[index].clone()};
}

Batch ImageTensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  // from_blob borrows the caller's vector; index_select copies out of it
  // before this function returns.
  auto idx = torch::from_blob(const_cast<int64_t*>(indices.data()),
                              {static_cast<int64_t>(indices.size())}, torch::kLong);
  if (idx.numel() > 0) {
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < size(), name_, ": batch index outside [0, ", size(), ")");
  }
  return {normalise(images_.index_select(0, idx)), labels_.index_select(0, idx)};
}

std::vector<int64_t> ImageTensorDataset::input_shape() const {
  return {images_.size(1), images_.size(2), images_.size(3)};
}

NamedTensorDataset::NamedTensorDataset(TensorDict tensors, std::string name)
    : tensors_(std::move(tensors)), name_(std::move(name)) {
  check_user(!tensors_.empty(), name_ + ": a dataset of named tensors needs at least one tensor.",
             "pass e.g. {{\"input\", features}, {\"target\", targets}}.");
  std::string sizes;
  bool same = true;
  for (auto& [key, t] : tensors_) {
    check_user(t.defined() && t.dim() >= 1, name_ + ": tensor '" + key + "' has no first dimension to index samples by.",
               "give each tensor one row per sample (N x ...).");
    t = t.contiguous();
    if (sizes.empty()) size_ = t.size(0);
    same = same && t.size(0) == size_;
    sizes += (sizes.empty() ? "" : ", ") + key + " " + std::to_string(t.size(0));
  }
  check_user(same, name_ + ": the tensors have different numbers of rows (" + sizes + ").",
             "give every tensor one row per sample.");
}

Example NamedTensorDataset::get(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size_, name_, ": index ", index, " outside [0, ", size_, ")");
  Example out;
  for (const auto& [key, t] : tensors_) out[key] = t[index].clone();
  return out;
}

Batch NamedTensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  auto idx = torch::tensor(indices, torch::kLong);
  if (idx.numel() > 0) {
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < size_, name_, ": batch index outside [0, ", size_, ")");
  }
  Batch out;
  for (const auto& [key, t] : tensors_) out[key] = t.index_select(0, idx);
  return out;
}

std::vector<int64_t> NamedTensorDataset::input_shape() const {
  if (!tensors_.contains("input")) return {};
  const auto s = tensors_.at("input").sizes();
  return {s.begin() + 1, s.end()};
}

torch::Tensor first_rows(const torch::Tensor& t, int64_t max) {
  return max > 0 && max < t.size(0) ? t.narrow(0, 0, max).clone() : t;
}

}  // namespace ddp::data
