// CIFAR-10 binary batches: small files written here in the real format are
// read back label for label and pixel for pixel in C x H x W order; missing,
// truncated and foreign files stop with one line naming the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <tuple>
#include <vector>

#include "ddp/data/cifar10.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

namespace fs = std::filesystem;

// Pixel c, y, x of record i: a value that differs by channel, row, column
// and record, so any transposition or offset shows.
uint8_t pixel(int64_t i, int64_t c, int64_t y, int64_t x) {
  return static_cast<uint8_t>((i * 7 + c * 85 + y * 3 + x * 5) % 256);
}
int64_t label_of(int64_t i, int64_t file) { return (i * 3 + file) % 10; }

// `n` records as the CIFAR-10 binary format lays them out: label byte, then
// the red plane, green plane, blue plane, each row by row.
std::string records(int64_t n, int64_t file) {
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(static_cast<char>(label_of(i, file)));
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t y = 0; y < 32; ++y)
        for (int64_t x = 0; x < 32; ++x) out.push_back(static_cast<char>(pixel(i + 100 * file, c, y, x)));
  }
  return out;
}

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// data_batch_1..5 with 3, 4, 5, 6, 7 records and test_batch with 4, in dir.
void write_cifar(const std::string& dir) {
  fs::create_directories(dir);
  for (int k = 1; k <= 5; ++k) write(dir + "/data_batch_" + std::to_string(k) + ".bin", records(k + 2, k));
  write(dir + "/test_batch.bin", records(4, 0));
}

using ddp::testing::user_error;

TEST(Cifar10, BatchFileReadsBackLabelsAndChwPixels) {
  const auto dir = ddp::testing::temp_dir("cifar");
  write(dir + "/b.bin", records(5, 2));
  const auto [images, labels] = ddp::data::read_cifar10_batch(dir + "/b.bin");
  ASSERT_EQ(images.sizes(), (std::vector<int64_t>{5, 3, 32, 32}));
  ASSERT_EQ(labels.sizes(), (std::vector<int64_t>{5}));
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(labels[i].item<int64_t>(), label_of(i, 2));
    for (auto [c, y, x] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{0, 0, 0}, {1, 5, 17}, {2, 31, 31}, {2, 0, 30}})
      EXPECT_EQ(images[i][c][y][x].item<int>(), pixel(i + 200, c, y, x)) << i << " " << c << " " << y << " " << x;
  }
}

TEST(Cifar10, SplitsConcatenateTheFiveBatchesInOrder) {
  const auto root = ddp::testing::temp_dir("cifar");
  write_cifar(root + "/cifar-10-batches-bin");  // the folder the archive unpacks to, found under root
  const auto splits = ddp::data::load_cifar10(root);
  ASSERT_EQ(splits.train->size(), 3 + 4 + 5 + 6 + 7);
  ASSERT_EQ(splits.test->size(), 4);
  EXPECT_EQ(splits.train->input_shape(), (std::vector<int64_t>{3, 32, 32}));
  EXPECT_EQ(splits.train->num_classes(), 10);
  const auto& train = dynamic_cast<const ddp::data::ImageTensorDataset&>(*splits.train);
  // Sample 3 is record 0 of data_batch_2; the last is record 6 of data_batch_5.
  EXPECT_EQ(train.labels()[3].item<int64_t>(), label_of(0, 2));
  EXPECT_EQ(train.images()[3][1][2][3].item<int>(), pixel(200, 1, 2, 3));
  EXPECT_EQ(train.labels()[24].item<int64_t>(), label_of(6, 5));
  EXPECT_EQ(train.images()[24][2][9][4].item<int>(), pixel(506, 2, 9, 4));
  // Normalisation statistics are the training images' own, per channel.
  const auto bytes = train.images().to(torch::kDouble).div(255);
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_NEAR(splits.mean[static_cast<size_t>(c)], bytes.select(1, c).mean().item<double>(), 1e-9);
    EXPECT_NEAR(splits.std[static_cast<size_t>(c)], bytes.select(1, c).std(/*unbiased=*/false).item<double>(), 1e-9);
  }
  // Limits keep the first samples.
  EXPECT_EQ(ddp::data::load_cifar10(root, 10, 2).train->size(), 10);
  EXPECT_EQ(ddp::data::load_cifar10(root, 10, 2).test->size(), 2);
}

TEST(Cifar10, MissingTruncatedAndForeignFilesNameTheFile) {
  const auto dir = ddp::testing::temp_dir("cifar");
  write_cifar(dir);
  fs::remove(dir + "/data_batch_4.bin");
  auto msg = user_error([&] { ddp::data::load_cifar10(dir); });
  EXPECT_NE(msg.find(dir + "/data_batch_4.bin: not found"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cifar-10-binary.tar.gz"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;

  write(dir + "/data_batch_4.bin", records(2, 4).substr(0, 3073 + 100));
  msg = user_error([&] { ddp::data::load_cifar10(dir); });
  EXPECT_NE(msg.find(dir + "/data_batch_4.bin: 3173 bytes"), std::string::npos) << msg;

  std::string foreign = records(1, 4);
  foreign[0] = 42;  // a label CIFAR-10 does not have
  write(dir + "/data_batch_4.bin", foreign);
  msg = user_error([&] { ddp::data::load_cifar10(dir); });
  EXPECT_NE(msg.find("label 42 in record 0"), std::string::npos) << msg;

  EXPECT_NE(user_error([&] { ddp::data::load_cifar10(dir + "/absent"); }).find(dir + "/absent"), std::string::npos);
}

}  // namespace
