// CIFAR-10 binary batches into an in-memory ImageTensorDataset.
#include "ddp/data/cifar10.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "ddp/data/identity.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kCifar10Classes = 10;
const std::string kGetIt =
    "download the binary version, cifar-10-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, "
    "unpack it and pass --data_root .../cifar-10-batches-bin.";

// root itself when it holds the batch files, else root/cifar-10-batches-bin
// when that does.
std::string batches_dir(const std::string& root) {
  check_user(fs::is_directory(root), "data root '" + root + "' is not a directory.", kGetIt);
  const fs::path nested = fs::path(root) / "cifar-10-batches-bin";
  if (!fs::exists(fs::path(root) / "data_batch_1.bin") && fs::is_directory(nested)) return nested.string();
  return root;
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> read_cifar10_batch(const std::string& path) {
  check_user(fs::exists(path), path + ": not found.", kGetIt);
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  check_user(static_cast<bool>(f), path + ": cannot open for reading.", "check the file's permissions.");
  const auto size = static_cast<int64_t>(f.tellg());
  check_user(size > 0 && size % kCifarRecordBytes == 0,
             path + ": " + std::to_string(size) + " bytes, not a whole number of " +
                 std::to_string(kCifarRecordBytes) + "-byte records (1 label + 3072 pixels); truncated or not CIFAR-10 binary.",
             kGetIt);
  const int64_t n = size / kCifarRecordBytes;
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  f.seekg(0);
  check_user(static_cast<bool>(f.read(reinterpret_cast<char*>(bytes.data()), size)), path + ": read error.", kGetIt);
  auto images = torch::empty({n, 3, 32, 32}, torch::kByte);
  auto labels = torch::empty({n}, torch::kLong);
  uint8_t* pixels = images.data_ptr<uint8_t>();
  int64_t* label = labels.data_ptr<int64_t>();
  constexpr int64_t kPixels = kCifarRecordBytes - 1;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* record = bytes.data() + i * kCifarRecordBytes;
    label[i] = record[0];
    check_user(label[i] < kCifar10Classes, path + ": label " + std::to_string(label[i]) + " in record " + std::to_string(i) +
                                        " is outside 0..9; not a CIFAR-10 file (CIFAR-100 records have 2 label bytes).",
               kGetIt);
    std::memcpy(pixels + i * kPixels, record + 1, kPixels);
  }
  return {images, labels};
}

Splits load_cifar10(const std::string& root, int64_t max_train, int64_t max_test) {
  check_user(max_train >= 0 && max_test >= 0, "sample limits are negative.", "pass 0 to use every sample.");
  const std::string dir = batches_dir(root);
  std::vector<torch::Tensor> images, labels;
  for (int k = 1; k <= 5; ++k) {
    auto [x, y] = read_cifar10_batch((fs::path(dir) / ("data_batch_" + std::to_string(k) + ".bin")).string());
    images.push_back(x);
    labels.push_back(y);
  }
  auto [test_x, test_y] = read_cifar10_batch((fs::path(dir) / "test_batch.bin").string());
  const torch::Tensor all_x = torch::cat(images), all_y = torch::cat(labels);
  const torch::Tensor train_x = first_rows(all_x, max_train), train_y = first_rows(all_y, max_train);

  // Per-channel statistics of the training images, with exact integer sums.
  Splits splits;
  const int64_t n = train_x.size(0), plane = 32 * 32;
  const uint8_t* p = train_x.data_ptr<uint8_t>();
  for (int64_t c = 0; c < 3; ++c) {
    uint64_t sum = 0, sum_sq = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* q = p + (i * 3 + c) * plane;
      for (int64_t j = 0; j < plane; ++j) {
        sum += q[j];
        sum_sq += uint64_t{q[j]} * q[j];
      }
    }
    const double count = static_cast<double>(n * plane);
    const double mean = static_cast<double>(sum) / count / 255.0;
    const double var = static_cast<double>(sum_sq) / count / (255.0 * 255.0) - mean * mean;
    splits.mean.push_back(mean);
    splits.std.push_back(std::sqrt(std::max(var, 1e-12)));
  }
  splits.train = std::make_shared<ImageTensorDataset>(train_x, train_y, splits.mean, splits.std, kCifar10Classes,
                                                      "cifar10 (train)", Fingerprint().add(all_x).add(all_y).hex());
  splits.test = std::make_shared<ImageTensorDataset>(first_rows(test_x, max_test), first_rows(test_y, max_test), splits.mean,
                                                     splits.std, kCifar10Classes, "cifar10 (test)",
                                                     Fingerprint().add(test_x).add(test_y).hex());
  return splits;
}

}  // namespace ddp::data
