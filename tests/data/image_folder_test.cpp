// Image folders: torchvision's class and file order, the validation split,
// corrupt files (skipped and reported, or an error with --strict-data),
// batches that are bit-identical for any worker count, and a real ddptrain
// run on a folder of JPEG and PNG files.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "ddp/data/image_codec.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/loader.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

namespace fs = std::filesystem;
using ddp::data::ImageFolderDataset;
using ddp::data::ImageFolderIndex;
using ddp::data::ImageFolderOptions;
using ddp::data::ImageTransformOptions;

// A uint8 h x w x 3 image filled with one colour.
torch::Tensor solid(int64_t h, int64_t w, int r, int g, int b) {
  auto img = torch::empty({h, w, 3}, torch::kByte);
  img.select(2, 0).fill_(r);
  img.select(2, 1).fill_(g);
  img.select(2, 2).fill_(b);
  return img;
}

// A textured image, so crops and flips change the pixels.
torch::Tensor textured(int64_t h, int64_t w, int64_t seed) {
  auto y = torch::arange(h, torch::kFloat).view({h, 1, 1});
  auto x = torch::arange(w, torch::kFloat).view({1, w, 1});
  auto c = torch::arange(3, torch::kFloat).view({1, 1, 3});
  auto v = torch::sin(y * 0.21 + x * 0.13 * (c + 1) + static_cast<double>(seed)) * 100 + 128 + x * 0.3;
  return v.clamp(0, 255).to(torch::kByte).contiguous();
}

void touch(const std::string& path, const std::string& bytes = "x") {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::vector<std::string> relative(const ImageFolderIndex& index) {
  std::vector<std::string> out;
  for (const auto& p : index.paths) out.push_back(fs::relative(p, index.root).string());
  return out;
}

using ddp::testing::user_error;

TEST(ImageFolder, ScanOrderIsTorchvisionsOrder) {
  const auto root = ddp::testing::temp_dir("imgfolder");
  // Class folders sort by bytes: 'B' (0x42) < '_c' (0x5f) < 'a' (0x61).
  for (const char* f : {"a/2.png", "a/10.PNG", "a/x.JPeg", "a/a.png", "a/notes.txt", "a/sub/0.png",
                        "a/sub/deeper/q.png", "a/sub2/z.jpg", "B/only.jpg", "_c/k.png", "loose.png"})
    touch(root + "/" + f);
  const auto index = ddp::data::scan_image_folder(root);
  EXPECT_EQ(index.classes, (std::vector<std::string>{"B", "_c", "a"}));
  // Folders in sorted path order ("a" < "a/sub" < "a/sub/deeper" < "a/sub2"),
  // files by name within each; extensions in any case; other files ignored.
  EXPECT_EQ(relative(index), (std::vector<std::string>{"B/only.jpg", "_c/k.png", "a/10.PNG", "a/2.png", "a/a.png",
                                                       "a/x.JPeg", "a/sub/0.png", "a/sub/deeper/q.png",
                                                       "a/sub2/z.jpg"}));
  EXPECT_EQ(index.labels, (std::vector<int64_t>{0, 1, 2, 2, 2, 2, 2, 2, 2}));
}

TEST(ImageFolder, BadLayoutsAreUserErrorsNamingThePath) {
  const auto root = ddp::testing::temp_dir("imgfolder");
  EXPECT_NE(user_error([&] { ddp::data::scan_image_folder(root + "/nope"); }).find(root + "/nope"), std::string::npos);
  EXPECT_NE(user_error([&] { ddp::data::scan_image_folder(root); }).find("no class folders"), std::string::npos);
  touch(root + "/cat/1.png");
  touch(root + "/dog/readme.txt");
  EXPECT_NE(user_error([&] { ddp::data::scan_image_folder(root); }).find(root + "/dog"), std::string::npos);
  touch(root + "/dog/2.BMP");
  const auto msg = user_error([&] { ddp::data::scan_image_folder(root); });
  EXPECT_NE(msg.find(root + "/dog/2.BMP"), std::string::npos) << msg;
  EXPECT_NE(msg.find("JPEG and PNG"), std::string::npos) << msg;
}

TEST(ImageFolder, ValidationSplitIsStratifiedDisjointAndStable) {
  const auto root = ddp::testing::temp_dir("imgfolder");
  for (int i = 0; i < 20; ++i) touch(root + "/a/" + std::to_string(i) + ".png");
  for (int i = 0; i < 10; ++i) touch(root + "/b/" + std::to_string(i) + ".jpg");
  touch(root + "/c/single.png");
  const auto all = ddp::data::scan_image_folder(root);
  const auto [train, val] = ddp::data::split_image_folder(all, 0.2);
  auto count = [](const ImageFolderIndex& x, int64_t label) {
    return std::count(x.labels.begin(), x.labels.end(), label);
  };
  EXPECT_EQ(count(val, 0), 4);
  EXPECT_EQ(count(val, 1), 2);
  EXPECT_EQ(count(val, 2), 0);  // a class never leaves training entirely
  EXPECT_EQ(train.paths.size() + val.paths.size(), all.paths.size());
  std::set<std::string> seen(train.paths.begin(), train.paths.end());
  for (const auto& p : val.paths) EXPECT_TRUE(seen.insert(p).second) << p << " in both";
  // Both parts keep the scan order.
  EXPECT_TRUE(std::is_sorted(val.paths.begin(), val.paths.end(), [&](const auto& l, const auto& r) {
    return std::find(all.paths.begin(), all.paths.end(), l) < std::find(all.paths.begin(), all.paths.end(), r);
  }));
  // The same split every time, and the same when the folder is copied
  // elsewhere (it hashes paths relative to the root).
  EXPECT_EQ(ddp::data::split_image_folder(all, 0.2).second.paths, val.paths);
  const auto copy = ddp::testing::temp_dir("imgfolder_copy");
  fs::copy(root, copy, fs::copy_options::recursive);
  EXPECT_EQ(relative(ddp::data::split_image_folder(ddp::data::scan_image_folder(copy), 0.2).second), relative(val));
  // Not simply the first files of each class.
  EXPECT_NE(relative(val), (std::vector<std::string>{"a/0.png", "a/1.png", "a/10.png", "a/11.png", "b/0.jpg", "b/1.jpg"}));
  EXPECT_NE(user_error([&] { ddp::data::split_image_folder(all, 1.0); }).find("outside (0, 1)"), std::string::npos);
}

// cls0: good0.png, bad.jpg (truncated JPEG), good1.jpg; cls1: good2.png,
// junk.png (garbage). Good image k is a solid colour with red = 40 * k + 20.
std::string corrupt_folder() {
  const auto root = ddp::testing::temp_dir("imgfolder_corrupt");
  fs::create_directories(root + "/cls0");
  fs::create_directories(root + "/cls1");
  ddp::data::write_png(root + "/cls0/good0.png", solid(8, 8, 20, 0, 0));
  ddp::data::write_jpeg(root + "/cls0/good1.jpg", solid(8, 8, 60, 0, 0), 100);
  ddp::data::write_png(root + "/cls1/good2.png", solid(8, 8, 100, 0, 0));
  ddp::data::write_jpeg(root + "/cls0/bad.jpg", textured(64, 64, 1), 90);
  const std::string bad = ddp::testing::read_file(root + "/cls0/bad.jpg");
  std::ofstream(root + "/cls0/bad.jpg", std::ios::binary | std::ios::trunc) << bad.substr(0, bad.size() / 2);
  touch(root + "/cls1/junk.png", "GIF89a? no, just junk bytes");
  return root;
}

// The red value a sample shows, back on the 0..255 scale.
double red_of(const torch::Tensor& chw, const ImageTransformOptions& o) {
  return (chw[0].mean().item<double>() * o.std()[0] + o.mean()[0]) * 255.0;
}

TEST(ImageFolder, CorruptFilesAreReportedOnceAndReplacedByTheNextGoodOne) {
  const auto root = corrupt_folder();
  const auto o = ImageTransformOptions().size(8).train(false);
  ImageFolderDataset data(ddp::data::scan_image_folder(root), ImageFolderOptions().transform(o), "t");
  // Order: cls0/bad.jpg, cls0/good0.png, cls0/good1.jpg, cls1/good2.png, cls1/junk.png
  ASSERT_EQ(data.size(), 5);
  ::testing::internal::CaptureStderr();
  const auto batch = data.get_batch({0, 1, 2, 3, 4});
  data.get_batch({4, 0});  // met again: not reported again
  const std::string err = ::testing::internal::GetCapturedStderr();
  // bad.jpg (0) reads good0 (1); junk.png (4) wraps around to index 0, which
  // is bad, so to good0 as well. Labels follow the image actually read.
  const std::vector<double> reds{20, 20, 60, 100, 20};
  const std::vector<int64_t> labels{0, 0, 0, 1, 0};
  for (int64_t j = 0; j < 5; ++j) {
    EXPECT_NEAR(red_of(batch.input()[j], o), reds[static_cast<size_t>(j)], 2.0) << j;  // JPEG rounding
    EXPECT_EQ(batch.target()[j].item<int64_t>(), labels[static_cast<size_t>(j)]) << j;
  }
  EXPECT_EQ(data.corrupt_files(), (std::vector<std::string>{root + "/cls0/bad.jpg", root + "/cls1/junk.png"}));
  // One line per corrupt file, naming it.
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 2) << err;
  EXPECT_NE(err.find(root + "/cls0/bad.jpg: truncated JPEG"), std::string::npos) << err;
  EXPECT_NE(err.find(root + "/cls1/junk.png: neither a JPEG nor a PNG"), std::string::npos) << err;
}

TEST(ImageFolder, StrictDataMakesTheFirstCorruptFileAnError) {
  const auto root = corrupt_folder();
  ImageFolderDataset data(ddp::data::scan_image_folder(root),
                          ImageFolderOptions().transform(ImageTransformOptions().size(8)).strict(true), "t");
  EXPECT_NO_THROW(data.get_batch({1, 2, 3}));
  const auto msg = user_error([&] { data.get_batch({3, 4}); });
  EXPECT_NE(msg.find(root + "/cls1/junk.png"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--strict-data"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// A folder of 3 classes x 9 images of assorted sizes, JPEG and PNG, made once.
const std::string& mixed_folder() {
  static const std::string root = [] {
    const auto dir = ddp::testing::temp_dir("imgfolder_mixed");
    for (int c = 0; c < 3; ++c)
      for (int i = 0; i < 9; ++i) {
        const auto img = textured(40 + 7 * i, 30 + 11 * ((i + c) % 4), 10 * c + i);
        const std::string base = dir + "/class" + std::to_string(c) + "/img" + std::to_string(i);
        fs::create_directories(fs::path(base).parent_path());
        if (i % 2) ddp::data::write_jpeg(base + ".jpg", img, 85);
        else ddp::data::write_png(base + ".png", img);
      }
    return dir;
  }();
  return root;
}

std::vector<ddp::data::Batch> epoch_batches(const ddp::data::DatasetPtr& data, int64_t workers, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(data->size()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>((i * 10) % order.size());  // 27 and 10 coprime
  ddp::data::Loader loader(data, order,
                           ddp::data::LoaderOptions(4).workers(workers).prefetch(3).seed(11).epoch(epoch).rank(1));
  std::vector<ddp::data::Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

TEST(ImageFolder, LoaderBatchesAreBitIdenticalFor0And1And3Workers) {
  auto data = std::make_shared<ImageFolderDataset>(ddp::data::scan_image_folder(mixed_folder()),
                                                   ImageFolderOptions().transform(ImageTransformOptions().size(24)),
                                                   "mixed (train)");
  const auto reference = epoch_batches(data, 0, 2);
  ASSERT_EQ(reference.size(), 7u);  // 27 samples, batches of 4
  EXPECT_EQ(reference[0].input().sizes(), (std::vector<int64_t>{4, 3, 24, 24}));
  for (int64_t workers : {1, 3}) {
    const auto batches = epoch_batches(data, workers, 2);
    ASSERT_EQ(batches.size(), reference.size());
    for (size_t k = 0; k < batches.size(); ++k) {
      EXPECT_TRUE(torch::equal(batches[k].input(), reference[k].input())) << "workers " << workers << " batch " << k;
      EXPECT_TRUE(torch::equal(batches[k].target(), reference[k].target())) << "workers " << workers << " batch " << k;
    }
  }
  // The augmentation is live: another epoch crops and flips differently,
  // with the same labels.
  const auto other = epoch_batches(data, 3, 3);
  EXPECT_FALSE(torch::equal(other[0].input(), reference[0].input()));
  EXPECT_TRUE(torch::equal(other[0].target(), reference[0].target()));
}

// A JPEG far larger than the output is decoded at the scale the transform
// needs (decode_min_side), the same way on every call; turning the option
// off gives the full-size decode.
TEST(ImageFolder, LargeJpegsAreDecodedAtTheScaleTheTransformNeeds) {
  const auto root = ddp::testing::temp_dir("imgfolder_large");
  fs::create_directories(root + "/a");
  const std::string path = root + "/a/big.jpg";
  ddp::data::write_jpeg(path, textured(192, 256, 3), 90);
  const ddp::data::DrawKey key{5, 2, 1};
  for (const bool train : {true, false}) {
    // Output 24: training needs a shorter side of 24 (1/8 gives 24 x 32),
    // evaluation 27 (resized to 27 before the centre crop; 1/4 gives 48 x 64).
    const auto o = ImageTransformOptions().size(24).train(train);
    EXPECT_EQ(ddp::data::decode_min_side(o), train ? 24 : 27);
    const auto scaled = ddp::data::decode_image_file(path, ddp::data::DecodeOptions().min_side(train ? 24 : 27));
    EXPECT_EQ(scaled.sizes(), (std::vector<int64_t>{train ? 24 : 48, train ? 32 : 64, 3}));
    ImageFolderDataset data(ddp::data::scan_image_folder(root), ImageFolderOptions().transform(o), "t");
    const auto batch = data.get_keyed_batch({0}, key, 7).input()[0];
    EXPECT_TRUE(torch::equal(batch, ddp::data::transform_image(scaled, o, key, 7))) << "train " << train;
    EXPECT_TRUE(torch::equal(data.get_keyed_batch({0}, key, 7).input()[0], batch)) << "train " << train;

    ImageFolderDataset full(ddp::data::scan_image_folder(root),
                            ImageFolderOptions().transform(o).scaled_jpeg_decode(false), "t");
    const auto full_batch = full.get_keyed_batch({0}, key, 7).input()[0];
    EXPECT_TRUE(torch::equal(full_batch, ddp::data::transform_image(ddp::data::decode_image_file(path), o, key, 7)));
    EXPECT_FALSE(torch::equal(full_batch, batch)) << "train " << train << ": the option changes nothing";
  }
}

TEST(ImageFolder, LoadSplitsWithValRootOrValSplit) {
  const auto root = mixed_folder();
  auto splits = ddp::data::load_image_folder(ddp::data::ImageFolderSplitOptions().root(root).val_fraction(1.0 / 3).image_size(16));
  EXPECT_EQ(splits.train->size(), 18);
  // The held-out images are the validation split; a folder has no test split.
  ASSERT_TRUE(splits.val);
  EXPECT_EQ(splits.val->size(), 9);
  EXPECT_EQ(splits.test->size(), 0);
  EXPECT_EQ(splits.train->num_classes(), 3);
  EXPECT_EQ(splits.train->input_shape(), (std::vector<int64_t>{3, 16, 16}));
  EXPECT_TRUE(splits.train_augmented);
  EXPECT_EQ(splits.mean, ddp::data::kImageNetMean);

  auto with_val = ddp::data::load_image_folder(ddp::data::ImageFolderSplitOptions().root(root).val_root(root));
  EXPECT_EQ(with_val.train->size(), 27);
  EXPECT_EQ(with_val.val->size(), 27);
  const auto other = ddp::testing::temp_dir("imgfolder_val");
  touch(other + "/class0/a.png");
  touch(other + "/zebra/a.png");
  const auto msg = user_error([&] {
    ddp::data::load_image_folder(ddp::data::ImageFolderSplitOptions().root(root).val_root(other));
  });
  EXPECT_NE(msg.find(other), std::string::npos) << msg;
  EXPECT_NE(user_error([&] {
              ddp::data::load_image_folder(ddp::data::ImageFolderSplitOptions().root(root).val_fraction(0));
            }).find("--val-root"),
            std::string::npos);
}

// ddptrain itself: a short run on a folder with one corrupt file trains and
// warns; with --strict-data it stops with exit code 2 and the file's path.
TEST(ImageFolder, DdptrainTrainsOnAFolderAndStrictDataStops) {
  DDP_SKIP_UNLESS_GLOO();
  const auto root = ddp::testing::temp_dir("imgfolder_run");
  fs::copy(mixed_folder(), root, fs::copy_options::recursive);
  touch(root + "/class1/broken.png", "not a png");
  const auto save = ddp::testing::temp_dir("imgfolder_run_out");
  std::vector<std::string> args{DDPTRAIN_EXE, "--dataset", "imagefolder", "--data_root", root, "--image-size", "16",
                                "--model", "cnn", "--epochs", "1", "--batch", "4", "--size", "1", "--backend", "gloo",
                                "--val-split", "0.25", "--save_path", save, "--progress", "plain", "--workers", "2"};
  auto run = ddp::testing::run_process(args, {}, 300);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("warning: skipping corrupt image " + root + "/class1/broken.png"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("val_acc"), std::string::npos) << run.output;

  args.push_back("--strict-data");
  run = ddp::testing::run_process(args, {}, 300);
  EXPECT_EQ(run.exit_code, ddp::exit_code::kUsage) << run.output;
  EXPECT_NE(run.output.find("error: corrupt image " + root + "/class1/broken.png"), std::string::npos) << run.output;
}

}  // namespace
