// CIFAR-10 from its binary distribution (cifar-10-binary.tar.gz).
//
// Each batch file is a run of 3073-byte records: one label byte (0..9), then
// 1024 red, 1024 green and 1024 blue bytes of a 32 x 32 image, rows top to
// bottom. That is already C x H x W, so a record is copied as it is. The
// training set is data_batch_1.bin .. data_batch_5.bin, the test set
// test_batch.bin. --data_root may name the unpacked cifar-10-batches-bin
// folder or the folder that holds it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "ddp/data/dataset.h"

namespace ddp::data {

/// Bytes of one record: a label and 3 x 32 x 32 pixels.
constexpr int64_t kCifarRecordBytes = 1 + 3 * 32 * 32;

/// Reads one batch file: {uint8 N x 3 x 32 x 32 images, int64 N labels}.
/// UserError naming the file if it is missing, empty, not a whole number of
/// records, or holds a label above 9.
std::pair<torch::Tensor, torch::Tensor> read_cifar10_batch(const std::string& path);

/// Train (the five data batches) and test splits from `root`, normalised by
/// the per-channel mean and std of the training images (for the real data
/// about 0.491 0.482 0.447 and 0.247 0.243 0.262). max_train / max_test keep
/// only the first N samples (0: all).
Splits load_cifar10(const std::string& root, int64_t max_train = 0, int64_t max_test = 0);

}  // namespace ddp::data
