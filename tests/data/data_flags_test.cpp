// The dataset flags: --dataset imagefolder/cifar10, --val-root, --val-split,
// --image-size and --strict-data parse, are checked, and reach load_data.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "ddp/app.h"
#include "ddp/cli.h"
#include "ddp/data/image_codec.h"
#include "ddp/data/subset.h"
#include "ddp/data/synthetic.h"
#include "ddp/train/validation.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

using ddp::testing::parse_args;

TEST(DataFlags, ParseAndDefaults) {
  const auto d = parse_args({});
  EXPECT_FALSE(d.strict_data);
  EXPECT_EQ(d.image_size, 0);
  EXPECT_DOUBLE_EQ(d.val_split, 0);  // no validation split: test chooses, as it always did
  EXPECT_FALSE(d.test_every_epoch);
  // An image folder keeps the 10% per class it always held out, unless a
  // separate --val-root is given.
  EXPECT_DOUBLE_EQ(parse_args({"--dataset", "imagefolder"}).val_split, 0.1);
  EXPECT_DOUBLE_EQ(parse_args({"--dataset", "imagefolder", "--val-root", "/v"}).val_split, 0);
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
  // The held-out images are the validation split; an image folder has no test split.
  ASSERT_TRUE(splits.val);
  EXPECT_EQ(splits.val->size(), 2);
  EXPECT_EQ(splits.test->size(), 0);
  EXPECT_EQ(splits.train->input_shape(), (std::vector<int64_t>{3, 224, 224}));  // the default size
  EXPECT_EQ(ddp::load_data(parse_args({"--dataset", "imagefolder", "--data_root", root, "--image-size", "32"}), false)
                .val->input_shape(),
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

// --val-split carves validation out of any training set: round(F x n)
// samples, a function of the seed alone (so the same on any number of
// ranks, which never enter it), disjoint from what trains, together all.
TEST(ValSplit, CarvesTheSameValidationSetFromTheSameSeed) {
  const auto a = ddp::data::validation_indices(1000, 0.2, 7);
  ASSERT_EQ(a.size(), 200u);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(std::adjacent_find(a.begin(), a.end()), a.end());
  EXPECT_EQ(a, ddp::data::validation_indices(1000, 0.2, 7));
  EXPECT_NE(a, ddp::data::validation_indices(1000, 0.2, 8));
  EXPECT_GT(a.back() - a.front(), 500);  // spread over the set, not its head
  auto splits = ddp::data::make_synthetic(100, 20, 3);
  const auto whole = splits.train;
  ddp::add_validation_split(splits, parse_args({"--val-split", "0.25", "--seed", "5"}));
  ASSERT_TRUE(splits.val);
  ASSERT_EQ(splits.val->size(), 25);
  ASSERT_EQ(splits.train->size(), 75);
  EXPECT_EQ(splits.test->size(), 20);
  const auto& val = dynamic_cast<const ddp::data::Subset&>(*splits.val).indices();
  const auto& train = dynamic_cast<const ddp::data::Subset&>(*splits.train).indices();
  EXPECT_EQ(val, ddp::data::validation_indices(100, 0.25, 5));
  std::vector<int64_t> all(train);
  all.insert(all.end(), val.begin(), val.end());
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(all[static_cast<size_t>(i)], i);
  // A subset's batch is the whole set's batch of the mapped indices.
  const auto got = splits.val->get_batch({0, 3});
  const auto want = whole->get_batch({val[0], val[3]});
  EXPECT_TRUE(torch::equal(got.input(), want.input()));
  EXPECT_TRUE(torch::equal(got.target(), want.target()));
}

// A run saved before --val-split applied to every dataset kept its old
// default 0.1 in the checkpoint, which only an image folder read: resumed,
// it goes on with all of its training data.
TEST(ValSplit, OldCheckpointsResumeWithoutOne) {
  auto old = ddp::config_to_json(parse_args({"--dataset", "synthetic"}));
  old["val-split"] = 0.1;
  old.erase("test-every-epoch");
  const auto now = ddp::resumed_config(parse_args({"--resume", "old.pt"}), old, "old.pt");
  EXPECT_DOUBLE_EQ(now.val_split, 0);
  EXPECT_FALSE(now.was_given("val-split"));
  auto image_folder = ddp::config_to_json(parse_args({"--dataset", "imagefolder"}));
  image_folder.erase("test-every-epoch");
  EXPECT_DOUBLE_EQ(ddp::resumed_config(parse_args({"--resume", "old.pt"}), image_folder, "old.pt").val_split, 0.1);
  // A checkpoint of today keeps its --val-split.
  const auto today = ddp::config_to_json(parse_args({"--dataset", "synthetic", "--val-split", "0.1"}));
  EXPECT_DOUBLE_EQ(ddp::resumed_config(parse_args({"--resume", "x.pt"}), today, "x.pt").val_split, 0.1);
}

TEST(ValSplit, RefusalsNameTheFlag) {
  auto splits = ddp::data::make_synthetic(10, 4, 3);
  EXPECT_NE(ddp::testing::user_error([&] { ddp::add_validation_split(splits, parse_args({"--val-split", "0.01"})); })
                .find("--val-split 0.01 of the 10 samples"),
            std::string::npos);
  EXPECT_NE(ddp::testing::user_error([&] { ddp::add_validation_split(splits, parse_args({"--test-every-epoch"})); })
                .find("add --val-split 0.1"),
            std::string::npos);
  // A task's own validation split and --val-split: one would be ignored.
  splits.val = splits.test;
  const auto own = ddp::testing::user_error([&] { ddp::add_validation_split(splits, parse_args({"--val-split", "0.2"})); });
  EXPECT_NE(own.find("make_data() gives its own"), std::string::npos) << own;
  EXPECT_NE(own.find("drop --val-split"), std::string::npos) << own;
}

// A task names its metrics once; each split's get its prefix, and the
// monitor and --stop-at name the choosing split's.
TEST(ValSplit, MetricNamesTakeTheSplitsPrefix) {
  EXPECT_EQ(ddp::metric_for_split("test_acc", "val_"), "val_acc");
  EXPECT_EQ(ddp::metric_for_split("val_acc", "test_"), "test_acc");
  EXPECT_EQ(ddp::metric_for_split("mae", "val_"), "val_mae");
  EXPECT_EQ(ddp::metric_for_split("test_loss", "test_"), "test_loss");
  EXPECT_EQ(ddp::stop_rule_for_split(parse_args({"--stop-at", "test_loss<=0.3"}), "val_").str(), "val_loss<=0.3");
  EXPECT_EQ(ddp::stop_rule_for_split(parse_args({"--stop-at-acc", "0.5"}), "val_").str(), "val_acc>=0.5");
  EXPECT_TRUE(ddp::stop_rule_for_split(parse_args({}), "val_").empty());
}

}  // namespace
