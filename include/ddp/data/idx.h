// MNIST and Fashion-MNIST from their IDX files.
//
// The IDX format is a big-endian header (a magic number that encodes the
// element type and rank, then one 32-bit size per dimension) followed by the
// raw bytes. The files ship gzip-compressed (Debian's dataset-fashion-mnist
// installs the .gz files) or are sometimes unpacked by hand, so both are
// read. Every check names the file and what was wrong with it, because a
// truncated download otherwise surfaces much later as a shape error.
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "ddp/data/dataset.h"

namespace ddp::data {

/// Magic numbers of the two IDX files used here: unsigned bytes, 3 and 1 dims.
constexpr int32_t kIdxImagesMagic = 2051;
constexpr int32_t kIdxLabelsMagic = 2049;

/// The directory Debian's dataset-fashion-mnist package installs into.
inline constexpr char kFashionMnistRoot[] = "/usr/share/datasets/fashion-mnist";

/// root/stem.gz if it exists, else root/stem; UserError if neither does, or
/// if root is missing. `dataset` ("fashion-mnist" or "mnist") picks the hint.
std::string find_idx_file(const std::string& root, const std::string& stem,
                          const std::string& dataset = "fashion-mnist");

/// Reads an IDX image file (raw, or gzip if the name ends in .gz) as uint8
/// N x 1 x H x W.
torch::Tensor read_idx_images(const std::string& path, const std::string& dataset = "fashion-mnist");

/// Reads an IDX label file (raw or .gz) as int64 N; every label must lie in
/// [0, num_classes).
torch::Tensor read_idx_labels(const std::string& path, int64_t num_classes = 10,
                              const std::string& dataset = "fashion-mnist");

/// Train and test splits from the four standard files under `root`
/// (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-...).
/// `name` is "fashion-mnist" or "mnist" and picks the normalisation
/// statistics; max_train / max_test keep only the first N samples (0: all).
Splits load_mnist_like(const std::string& root, const std::string& name = "fashion-mnist",
                       int64_t max_train = 0, int64_t max_test = 0);

}  // namespace ddp::data
