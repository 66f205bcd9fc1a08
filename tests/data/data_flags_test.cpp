// The dataset flags: --dataset imagefolder/cifar10, --val-root, --val-split,
// --image-size and --strict-data parse, are checked, and reach load_data.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "ddp/app.h"
#include "ddp/cli.h"
#include "ddp/data/image_codec.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

using ddp::testing::parse_args;

TEST(DataFlags, ParseAndDefaults) {
  const auto d = parse_args({});
  EXPECT_FALSE(d.strict_data);
  EXPECT_EQ(d.image_size, 0);
  EXPECT_DOUBLE_EQ(d.val_split, 0.1);
  EXPECT_EQ(d.val_root, "");
  const auto c = parse_args({"--dataset", "imagefolder", "--strict-data", "--val-split", "0.2", "--image-size", "64",
                        "--val-root", "/v"});
  EXPECT_EQ(c.dataset, "imagefolder");
  EXPECT_TRUE(c.strict_data);
  EXPECT_DOUBLE_EQ(c.val_split, 0.2);
  EXPECT_EQ(c.image_size, 64);
  EXPECT_EQ(c.val_root, "/v");
  EXPECT_EQ(parse_args({"--dataset", "cifar10"}).dataset, "cifar10");
  // The printed config and config.json carry the new keys.
  std::ostringstream out;
  ddp::print_config(c, out);
  EXPECT_NE(out.str().find("strict-data"), std::string::npos);
  EXPECT_NE(out.str().find("true"), std::string::npos);
  EXPECT_EQ(ddp::config_to_json(c)["strict-data"], true);
  EXPECT_EQ(ddp::config_to_json(c)["image-size"], 64);
}

TEST(DataFlags, BadValuesNameTheFlag) {
  for (auto [args, flag] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--val-split", "1.5"}, "--val-split"}, {{"--val-split=-0.1"}, "--val-split"},
           {{"--image-size", "-3"}, "--image-size"}, {{"--dataset", "imagenet"}, "--dataset"}}) {
    try {
      parse_args(args);
      ADD_FAILURE() << flag << " accepted";
    } catch (const ddp::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  }
}

TEST(DataFlags, LoadDataBuildsTheNamedDataset) {
  const auto root = ddp::testing::temp_dir("flags");
  for (const char* cls : {"cat", "dog"})
    for (int i = 0; i < 5; ++i) {
      std::filesystem::create_directories(root + "/" + cls);
      ddp::data::write_png(root + "/" + cls + "/" + std::to_string(i) + ".png",
                           torch::full({12, 10, 3}, 30 * i, torch::kByte));
    }
  auto splits = ddp::load_data(parse_args({"--dataset", "imagefolder", "--data_root", root, "--val-split", "0.2"}), false);
  EXPECT_EQ(splits.train->size(), 8);
  EXPECT_EQ(splits.test->size(), 2);
  EXPECT_EQ(splits.train->input_shape(), (std::vector<int64_t>{3, 224, 224}));  // the default size
  EXPECT_EQ(ddp::load_data(parse_args({"--dataset", "imagefolder", "--data_root", root, "--image-size", "32"}), false)
                .test->input_shape(),
            (std::vector<int64_t>{3, 32, 32}));
  try {
    ddp::load_data(parse_args({"--dataset", "synthetic", "--image-size", "32"}), false);
    ADD_FAILURE() << "--image-size accepted with --dataset synthetic";
  } catch (const ddp::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--dataset imagefolder"), std::string::npos) << e.what();
  }
  try {
    ddp::load_data(parse_args({"--dataset", "cifar10", "--data_root", root}), false);
    ADD_FAILURE() << "a folder without CIFAR-10 files loaded";
  } catch (const ddp::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("data_batch_1.bin"), std::string::npos) << e.what();
  }
}

// --train-samples / --test-samples above what the data holds take all of
// it, with a note that says so (before, nothing was said).
TEST(DataFlags, MoreSamplesThanTheDataHoldIsNoted) {
  const auto root = ddp::testing::fashion_mnist_root();
  if (root.empty()) GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  const auto dir = ddp::testing::temp_dir("more_samples");
  auto r = ddp::testing::run_process({DDPTRAIN_EXE, "--data_root", root, "--model", "cnn", "--epochs", "1",
                                      "--train-samples", "64", "--test-samples", "999999", "--save_path", dir,
                                      "--progress", "plain"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --test-samples 999999 is more than the 10000 samples of"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("note: --train-samples"), std::string::npos) << r.output;
}

}  // namespace
