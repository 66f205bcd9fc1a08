// IDX reading: the real Fashion-MNIST, and hand-made broken files that must
// each fail with a UserError naming the file and the problem.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "ddp/data/idx.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"
#include "support/capped_child.h"
#include "support/testing.h"

namespace {

using ddp::data::ImageTensorDataset;
using ddp::data::load_mnist_like;
namespace fs = std::filesystem;

std::string big_endian(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims,
                      const std::string& payload) {
  std::string s = big_endian(magic);
  for (uint32_t d : dims) s += big_endian(d);
  return s + payload;
}

void write_file(const std::string& path, const std::string& bytes) {
  if (path.size() > 3 && path.substr(path.size() - 3) == ".gz") {
    gzFile gz = gzopen(path.c_str(), "wb");
    ASSERT_NE(gz, nullptr) << path;
    ASSERT_EQ(gzwrite(gz, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
    gzclose(gz);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

// Image i is filled with byte i; label i is i % 10.
std::string image_payload(uint32_t n, uint32_t h, uint32_t w) {
  std::string s;
  for (uint32_t i = 0; i < n; ++i) s += std::string(h * w, static_cast<char>(i));
  return s;
}
std::string label_payload(uint32_t n) {
  std::string s;
  for (uint32_t i = 0; i < n; ++i) s += static_cast<char>(i % 10);
  return s;
}

// A tiny valid MNIST-like directory: 20 train and 10 test images of 4 x 3.
struct FakeMnist {
  std::string root, ext;
  explicit FakeMnist(bool gz) : root(ddp::testing::temp_dir("idx")), ext(gz ? ".gz" : "") {
    write_images("train", 20);
    write_labels("train", 20);
    write_images("t10k", 10);
    write_labels("t10k", 10);
  }
  std::string path(const std::string& prefix, const std::string& kind) const {
    return root + "/" + prefix + "-" + kind + ext;
  }
  std::string images(const std::string& prefix) const { return path(prefix, "images-idx3-ubyte"); }
  std::string labels(const std::string& prefix) const { return path(prefix, "labels-idx1-ubyte"); }
  void write_images(const std::string& prefix, uint32_t n) const {
    write_file(images(prefix), idx_bytes(2051, {n, 4, 3}, image_payload(n, 4, 3)));
  }
  void write_labels(const std::string& prefix, uint32_t n) const {
    write_file(labels(prefix), idx_bytes(2049, {n}, label_payload(n)));
  }
};

using ddp::testing::user_error;

void expect_contains(const std::string& message, std::initializer_list<std::string> parts) {
  EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
}

using ddp::testing::as_images;

TEST(Idx, RealFashionMnistLoads) {
  const std::string root = ddp::testing::fashion_mnist_root();
  if (root.empty()) GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  const auto splits = load_mnist_like(root);
  ASSERT_EQ(splits.train->size(), 60000);
  ASSERT_EQ(splits.test->size(), 10000);
  EXPECT_EQ(splits.train->input_shape(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(splits.train->num_classes(), 10);
  EXPECT_FALSE(splits.synthetic);
  EXPECT_NE(splits.train->name().find("fashion-mnist"), std::string::npos);

  const auto& train = as_images(splits.train);
  const auto& test = as_images(splits.test);
  const auto histogram = torch::bincount(train.labels());
  EXPECT_TRUE(torch::equal(histogram, torch::full({10}, 6000, torch::kLong))) << histogram;
  EXPECT_EQ(train.labels()[0].item<int64_t>(), 9);  // "Ankle boot"
  EXPECT_EQ(test.labels()[0].item<int64_t>(), 9);
  EXPECT_EQ(splits.train->get(0).target().item<int64_t>(), 9);

  // The stored statistics are those of the train images.
  const double mean = train.images().to(torch::kDouble).mean().item<double>() / 255.0;
  EXPECT_NEAR(mean, splits.mean[0], 1e-3);
  const auto x = splits.train->get_batch({0, 1, 2, 3}).input();
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{4, 1, 28, 28}));
  EXPECT_EQ(x.scalar_type(), torch::kFloat);
  EXPECT_NEAR(x.min().item<double>(), -0.2860 / 0.3530, 1e-5);  // black pixels
}

TEST(Idx, SmallGzipFilesLoadAndNormalise) {
  FakeMnist fake(/*gz=*/true);
  const auto splits = load_mnist_like(fake.root);
  ASSERT_EQ(splits.train->size(), 20);
  ASSERT_EQ(splits.test->size(), 10);
  EXPECT_EQ(splits.train->input_shape(), (std::vector<int64_t>{1, 4, 3}));
  const auto e = splits.train->get(7);
  EXPECT_EQ(e.target().item<int64_t>(), 7);
  EXPECT_EQ(e.target().scalar_type(), torch::kLong);
  EXPECT_NEAR(e.input()[0][1][2].item<double>(), (7 / 255.0 - 0.2860) / 0.3530, 1e-6);
  // get_batch gathers the same values as get.
  const auto b = splits.train->get_batch({7, 3});
  EXPECT_TRUE(torch::allclose(b.input()[0], e.input()));
  EXPECT_EQ(b.target()[1].item<int64_t>(), 3);
}

TEST(Idx, RawFilesLoad) {
  FakeMnist fake(/*gz=*/false);
  const auto splits = load_mnist_like(fake.root, "mnist");
  EXPECT_EQ(splits.train->size(), 20);
  EXPECT_EQ(splits.mean, std::vector<double>{0.1307});
  EXPECT_EQ(splits.std, std::vector<double>{0.3081});
  EXPECT_NE(splits.test->name().find("mnist (test)"), std::string::npos);
}

TEST(Idx, SampleLimitsKeepTheFirstSamples) {
  FakeMnist fake(true);
  const auto splits = load_mnist_like(fake.root, "fashion-mnist", 5, 3);
  EXPECT_EQ(splits.train->size(), 5);
  EXPECT_EQ(splits.test->size(), 3);
  EXPECT_EQ(splits.train->get(4).target().item<int64_t>(), 4);
  EXPECT_EQ(load_mnist_like(fake.root, "fashion-mnist", 1000, 0).train->size(), 20);
}

TEST(Idx, WrongMagicNamesFileAndNumbers) {
  FakeMnist fake(true);
  write_file(fake.images("train"), idx_bytes(1234, {20, 4, 3}, image_payload(20, 4, 3)));
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.images("train"), "magic number 1234", "expected 2051",
                   "apt-get install --reinstall dataset-fashion-mnist"});
  write_file(fake.labels("t10k"), idx_bytes(2051, {10}, label_payload(10)));
  expect_contains(user_error([&] { ddp::data::read_idx_labels(fake.labels("t10k")); }),
                  {fake.labels("t10k"), "magic number 2051", "expected 2049"});
}

TEST(Idx, TruncatedImagesAreRejected) {
  FakeMnist fake(true);
  std::string bytes = idx_bytes(2051, {20, 4, 3}, image_payload(20, 4, 3));
  write_file(fake.images("train"), bytes.substr(0, bytes.size() - 10));
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.images("train"), "truncated", std::to_string(bytes.size() - 10),
                   std::to_string(bytes.size())});
  // Extra bytes are as wrong as missing ones.
  write_file(fake.images("train"), bytes + "xx");
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.images("train"), "2 bytes beyond"});
  // A header cut short.
  write_file(fake.images("train"), bytes.substr(0, 6));
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.images("train"), "too short"});
}

// A header whose sizes multiply past 64 bits (2^31 x 2^31 x 4 = 2^64) once
// wrapped to 0 and so matched a 16-byte file: the reader then asked LibTorch
// for 2^64 pixels. The product is checked, and the error names the file.
TEST(Idx, SizesWhoseProductOverflowsAreRejected) {
  FakeMnist fake(false);
  write_file(fake.images("train"), idx_bytes(2051, {1u << 31, 1u << 31, 4}, ""));
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.images("train"), "2147483648 x 2147483648 x 4"});
}

TEST(Idx, TruncatedGzipStreamIsRejected) {
  FakeMnist fake(true);
  const std::string gz = ddp::testing::read_file(fake.labels("train"));
  std::ofstream(fake.labels("train"), std::ios::binary) << gz.substr(0, gz.size() / 2);
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.labels("train"), "gzip", "truncated or corrupt"});
}

// A gzip bomb: a header that promises 20 images of 4 x 3 (256 bytes in
// all), then 1.5 GB of zeros, in a file of about 1.5 MB. Reading stops a
// byte past the promise, inside a child that may grow by 512 MB. (It
// decompressed the whole stream first, which the cap turns into bad_alloc.)
TEST(Idx, GzipThatDecompressesPastItsHeaderStopsEarly) {
  FakeMnist fake(true);
  {
    gzFile gz = gzopen(fake.images("train").c_str(), "wb1");
    ASSERT_NE(gz, nullptr);
    const std::string header = idx_bytes(2051, {20, 4, 3}, "");
    gzwrite(gz, header.data(), static_cast<unsigned>(header.size()));
    const std::string zeros(16 << 20, '\0');
    for (int i = 0; i < 96; ++i) ASSERT_EQ(gzwrite(gz, zeros.data(), static_cast<unsigned>(zeros.size())), 16 << 20);
    gzclose(gz);
  }
  ASSERT_LT(fs::file_size(fake.images("train")), 8u << 20);
  const std::string out = ddp::testing::in_capped_child(
      [&] {
        try {
          load_mnist_like(fake.root);
          return std::string("loaded");
        } catch (const ddp::UserError& e) {
          return std::string("user error: ") + e.what();
        }
      },
      size_t{512} << 20);
  expect_contains(out, {"user error: ", fake.images("train"), "decompresses to more than the 256 bytes its IDX header promises"});
}

TEST(Idx, CountMismatchNamesBothFiles) {
  FakeMnist fake(true);
  fake.write_labels("t10k", 9);
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.images("t10k"), fake.labels("t10k"), "10 images", "9 labels"});
}

TEST(Idx, LabelOutOfRange) {
  FakeMnist fake(false);
  std::string labels = label_payload(20);
  labels[13] = 10;
  write_file(fake.labels("train"), idx_bytes(2049, {20}, labels));
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.labels("train"), "label 10", "item 13", "outside [0, 10)"});
  // With more classes the same file is fine.
  EXPECT_EQ(ddp::data::read_idx_labels(fake.labels("train"), 11).size(0), 20);
}

TEST(Idx, MissingFileSaysHowToGetIt) {
  FakeMnist fake(true);
  fs::remove(fake.labels("t10k"));
  expect_contains(user_error([&] { load_mnist_like(fake.root); }),
                  {fake.root + "/t10k-labels-idx1-ubyte", "not found",
                   "apt-get install dataset-fashion-mnist", "--data_root"});
}

TEST(Idx, MissingRootSaysHowToGetIt) {
  const std::string root = ddp::testing::temp_dir("idx") + "/nowhere";
  expect_contains(user_error([&] { load_mnist_like(root); }),
                  {root, "not a directory", "apt-get install dataset-fashion-mnist", "--data_root"});
  expect_contains(user_error([&] { load_mnist_like(root, "mnist"); }), {root, "--data_root"});
}

TEST(Idx, UnknownNameIsAUserError) {
  FakeMnist fake(true);
  expect_contains(user_error([&] { load_mnist_like(fake.root, "cifar10"); }),
                  {"cifar10", "fashion-mnist"});
}

}  // namespace
