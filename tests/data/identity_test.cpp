// The data identity record: the same data read from another place (or
// spelt otherwise) compares equal; other data, another size or another file
// list does not, and says which split and what differs.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "ddp/data/identity.h"
#include "ddp/data/idx.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/synthetic.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace identity_test {

using ddp::data::data_difference;
using ddp::data::data_identity;

using ddp::testing::write_mnist_like;

nlohmann::json idx_identity(const std::string& root, int64_t max_train = 0) {
  return data_identity(ddp::data::load_mnist_like(root, "mnist", max_train, 0), {root});
}

TEST(DataIdentity, IdxDataCopiedOrCompressedElsewhereIsTheSame) {
  const auto dir = ddp::testing::temp_dir("identity_idx");
  write_mnist_like(dir + "/a", 300, 50, 1);
  write_mnist_like(dir + "/b/c", 300, 50, 1, /*gz=*/true);
  const auto a = idx_identity(dir + "/a"), b = idx_identity(dir + "/b/c");
  EXPECT_EQ(data_difference(a, b), "");
  EXPECT_EQ(a["train"]["fingerprint"], b["train"]["fingerprint"]);
  EXPECT_EQ(a["train"]["size"], 300);
  EXPECT_EQ(a["test"]["name"], "mnist (test)");
  EXPECT_EQ(a["locations"], nlohmann::json::array({dir + "/a"}));
  // The record goes through a checkpoint's JSON header unchanged.
  EXPECT_EQ(data_difference(nlohmann::json::parse(a.dump()), b), "");
}

TEST(DataIdentity, OtherIdxDataOrAnotherSizeSaysWhichSplitAndWhat) {
  const auto dir = ddp::testing::temp_dir("identity_idx_other");
  write_mnist_like(dir + "/a", 300, 50, 1);
  write_mnist_like(dir + "/other", 300, 50, 2);
  write_mnist_like(dir + "/bigger", 400, 50, 1);
  const auto a = idx_identity(dir + "/a");
  EXPECT_EQ(data_difference(a, idx_identity(dir + "/other")),
            "the train split 'mnist (train)' holds other samples (fingerprint " +
                idx_identity(dir + "/other")["train"]["fingerprint"].get<std::string>() + ", the run's " +
                a["train"]["fingerprint"].get<std::string>() + "); the test split 'mnist (test)' holds other samples "
                "(fingerprint " + idx_identity(dir + "/other")["test"]["fingerprint"].get<std::string>() +
                ", the run's " + a["test"]["fingerprint"].get<std::string>() + ")");
  EXPECT_EQ(data_difference(a, idx_identity(dir + "/bigger")),
            "the train split 'mnist (train)' has 400 samples, the run's had 300");
  // --train-samples counts what is used; the fingerprint is of the files.
  EXPECT_EQ(data_difference(idx_identity(dir + "/a", 200), idx_identity(dir + "/bigger", 200)),
            "the train split 'mnist (train)' holds other samples (fingerprint " +
                idx_identity(dir + "/bigger", 200)["train"]["fingerprint"].get<std::string>() + ", the run's " +
                idx_identity(dir + "/a", 200)["train"]["fingerprint"].get<std::string>() + ")");
}

void touch(const std::string& path) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << "x";  // scanned, never decoded here
}

ddp::data::Splits image_folder(const std::string& root) {
  return ddp::data::load_image_folder(ddp::data::ImageFolderSplitOptions().root(root).val_fraction(0.25).image_size(8));
}

// An image folder's name holds its root: moved, it is the same folder. A
// file renamed, added or in another class is another folder, though no
// file is read to tell.
TEST(DataIdentity, ImageFolderIsItsFileListWhereverItLies) {
  const auto dir = ddp::testing::temp_dir("identity_folder");
  for (const auto* root : {"/a", "/moved/b"})
    for (const char* f : {"cat/1.png", "cat/2.png", "cat/3.png", "cat/4.png", "dog/1.png", "dog/2.jpg", "dog/x/3.png",
                          "dog/4.png"})
      touch(dir + root + "/" + f);
  const auto a = data_identity(image_folder(dir + "/a"), {dir + "/a"});
  EXPECT_EQ(a["train"]["name"], "imagefolder " + dir + "/a (train)");
  EXPECT_EQ(data_difference(a, data_identity(image_folder(dir + "/moved/b"), {dir + "/moved/b"})), "");

  fs::rename(dir + "/moved/b/dog/4.png", dir + "/moved/b/dog/5.png");
  const auto renamed = data_identity(image_folder(dir + "/moved/b"), {dir + "/moved/b"});
  EXPECT_NE(data_difference(a, renamed).find("holds other samples"), std::string::npos)
      << data_difference(a, renamed);
  fs::rename(dir + "/moved/b/dog/5.png", dir + "/moved/b/cat/5.png");
  fs::remove(dir + "/moved/b/cat/4.png");
  EXPECT_NE(data_difference(a, data_identity(image_folder(dir + "/moved/b"), {dir + "/moved/b"})), "");
  touch(dir + "/moved/b/dog/6.png");
  EXPECT_NE(data_difference(a, data_identity(image_folder(dir + "/moved/b"), {dir + "/moved/b"})), "");
}

// A task's own dataset has no fingerprint: its name and size compare, and
// nothing random about it can stop a resume.
class Rows : public ddp::data::Dataset {
 public:
  Rows(int64_t n, std::string name) : n_(n), name_(std::move(name)) {}
  int64_t size() const override { return n_; }
  ddp::data::Example get(int64_t) const override { return {torch::rand({2}), torch::rand({1})}; }
  std::string name() const override { return name_; }

 private:
  int64_t n_;
  std::string name_;
};

ddp::data::Splits rows(int64_t n, const std::string& name) {
  ddp::data::Splits s;
  s.train = std::make_shared<Rows>(n, name + " (train)");
  s.test = std::make_shared<Rows>(10, name + " (test)");
  return s;
}

TEST(DataIdentity, ATasksOwnDataComparesByNameAndSize) {
  EXPECT_EQ(data_difference(data_identity(rows(100, "my-dataset"), {"data"}), data_identity(rows(100, "my-dataset"), {"/x/data"})), "");
  // The location in a name is taken out only where it stands for where the
  // data lies: "data" in "my-dataset" is a word.
  EXPECT_EQ(data_difference(data_identity(rows(100, "table data"), {"data"}), data_identity(rows(100, "table /y/data"), {"/y/data"})), "");
  EXPECT_EQ(data_difference(data_identity(rows(100, "sales"), {"data"}), data_identity(rows(90, "sales"), {"data"})),
            "the train split 'sales (train)' has 90 samples, the run's had 100");
  EXPECT_EQ(data_difference(data_identity(rows(100, "sales"), {"d"}), data_identity(rows(100, "prices"), {"d"})),
            "the train split is 'prices (train)', the run's was 'sales (train)'; the test split is 'prices (test)', "
            "the run's was 'sales (test)'");
  auto with_val = rows(100, "sales");
  with_val.val = std::make_shared<Rows>(5, "sales (val)");
  EXPECT_EQ(data_difference(data_identity(rows(100, "sales"), {}), data_identity(with_val, {})),
            "this data has a val split and the run had none");
}

// A checkpoint from before the record resumes unchecked; a record that is
// not what ddptrain writes is a difference to report, not a crash.
TEST(DataIdentity, NoRecordComparesNothingAndADamagedOneDiffers) {
  const auto now = data_identity(rows(100, "sales"), {"d"});
  EXPECT_EQ(data_difference(nlohmann::json(), now), "");
  EXPECT_EQ(data_difference(nlohmann::json::parse(R"({"train": 3, "test": {"size": "x"}})"), now),
            "the train split is 'sales (train)', the run's was ''; the test split is 'sales (test)', the run's was ''");
}

TEST(DataIdentity, SyntheticDataIsTheSameForTheSameSeed) {
  const auto a = data_identity(ddp::data::make_synthetic(200, 50, 1), {});
  EXPECT_EQ(data_difference(a, data_identity(ddp::data::make_synthetic(200, 50, 1), {})), "");
  EXPECT_NE(data_difference(a, data_identity(ddp::data::make_synthetic(200, 50, 2), {})).find("holds other samples"),
            std::string::npos);
  EXPECT_EQ(a["train"]["fingerprint"].get<std::string>().size(), 16u);
}

}  // namespace identity_test
