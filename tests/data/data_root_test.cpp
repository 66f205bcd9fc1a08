// Data the user names is used or refused, never replaced: a wrong --data_root
// stops the real binary with one line that says what the folder holds and
// what to pass. Only the bare run falls back to synthetic data, loudly.
#include <filesystem>
#include <fstream>

#include "ddp/app.h"
#include "ddp/data/data_root.h"
#include "ddp/data/image_codec.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::run_process;

void write_image(const std::string& path) {
  fs::create_directories(fs::path(path).parent_path());
  ddp::data::write_png(path, torch::full({8, 8, 3}, 100, torch::kByte));
}

// Two class folders of PNGs.
std::string class_folders() {
  const auto root = ddp::testing::temp_dir("classes");
  for (const char* cls : {"cat", "dog"})
    for (int i = 0; i < 2; ++i) write_image(root + "/" + cls + "/" + std::to_string(i) + ".png");
  return root;
}

std::string loose_images() {
  const auto root = ddp::testing::temp_dir("loose");
  for (int i = 0; i < 3; ++i) write_image(root + "/img" + std::to_string(i) + ".png");
  return root;
}

// The real binary on one rank with these extra flags: the backend's default
// (Gloo on a CPU machine, NCCL on one GPU, where a CUDA-wheel LibTorch has no
// Gloo): the data checks do not depend on it.
ddp::testing::ProcessResult ddptrain(std::vector<std::string> extra) {
  std::vector<std::string> argv{DDPTRAIN_EXE, "--size", "1", "--epochs", "1",
                                "--progress", "none", "--save_path", ddp::testing::temp_dir("dr_save")};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run_process(argv, {}, 120);
}

using ddp::testing::count;

// A refused run: usage exit code, the message once, no synthetic run.
void expect_refused(const ddp::testing::ProcessResult& r, const std::vector<std::string>& says) {
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  for (const auto& s : says) EXPECT_NE(r.output.find(s), std::string::npos) << "missing '" << s << "' in:\n" << r.output;
  EXPECT_EQ(r.output.find("SYNTHETIC"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "error:"), 1u) << r.output;
}

TEST(DataRoot, MisspeltPathIsNamed) {
  const auto parent = ddp::testing::temp_dir("misspelt");
  const auto root = parent + "/fashoin-mnist";
  expect_refused(ddptrain({"--data_root", root}), {"'" + root + "' does not exist", "'" + parent + "'"});
}

TEST(DataRoot, ClassFoldersAskForDatasetImagefolder) {
  const auto root = class_folders();
  expect_refused(ddptrain({"--data_root", root}), {root, "looks like an image folder", "add --dataset imagefolder"});
  // Also when the user named Fashion-MNIST explicitly.
  expect_refused(ddptrain({"--data_root", root, "--dataset", "fashion-mnist"}), {"add --dataset imagefolder"});
}

TEST(DataRoot, LooseImagesAreCalledLoose) {
  const auto root = loose_images();
  expect_refused(ddptrain({"--data_root", root}), {root, "3 loose image(s)", "no class folders", "one folder per class"});
}

TEST(DataRoot, EmptyFolderAndFileAreRefused) {
  const auto empty = ddp::testing::temp_dir("empty_root");
  expect_refused(ddptrain({"--data_root", empty}), {empty, "is empty", "train-images-idx3-ubyte"});
  const auto file = empty + "/notes.txt";
  std::ofstream(file) << "x";
  expect_refused(ddptrain({"--data_root", file}), {file, "is a file, not a folder"});
}

TEST(DataRoot, ExplicitDatasetAutoWithoutFilesIsRefused) {
  // --dataset named, --data_root left at a default that holds nothing.
  ddp::Config c = ddp::testing::parse_args({"--dataset", "auto"});
  c.data_root = ddp::testing::temp_dir("auto_default") + "/missing";
  EXPECT_NE(ddp::testing::user_error([&] { ddp::load_data(c, false); }).find("does not exist"), std::string::npos);
}

TEST(DataRoot, OnlyTheBareRunFallsBackToSyntheticAndSaysSoLoudly) {
  ddp::Config c = ddp::testing::parse_args({"--train-samples", "64", "--test-samples", "16"});
  c.data_root = ddp::testing::temp_dir("bare_default") + "/missing";  // the default path, not installed
  ::testing::internal::CaptureStderr();
  const auto splits = ddp::load_data(c, /*verbose=*/true);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(splits.synthetic);
  EXPECT_NE(err.find("SYNTHETIC DATA"), std::string::npos) << err;
  EXPECT_NE(err.find(c.data_root), std::string::npos) << err;
  // The same path given by the user is an error.
  c.given.push_back("data_root");
  EXPECT_NE(ddp::testing::user_error([&] { ddp::load_data(c, false); }).find("does not exist"), std::string::npos);
}

TEST(DataRoot, InspectTellsTheKinds) {
  using K = ddp::data::DataRootKind;
  EXPECT_EQ(ddp::data::inspect_data_root(class_folders()).kind, K::kImageFolder);
  EXPECT_EQ(ddp::data::inspect_data_root(loose_images()).kind, K::kLooseImages);
  const auto cifar = ddp::testing::temp_dir("cifar_like");
  std::ofstream(cifar + "/data_batch_1.bin") << "x";
  EXPECT_EQ(ddp::data::inspect_data_root(cifar).kind, K::kCifar10);
  EXPECT_NE(ddp::data::inspect_data_root(cifar).fix.find("--dataset cifar10"), std::string::npos);
  if (!ddp::testing::fashion_mnist_root().empty()) {
    EXPECT_EQ(ddp::data::inspect_data_root(ddp::testing::fashion_mnist_root()).kind, K::kMnistLike);
  }
}

}  // namespace
