// What a --data_root folder holds (see data_root.h).
#include "ddp/data/data_root.h"

#include <filesystem>
#include <vector>

#include "ddp/data/image_folder.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxEntries = 500;  // enough to tell; a huge folder is not walked

bool has_image(const fs::path& dir) {
  std::error_code ec;
  int seen = 0;
  for (fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end && seen < kMaxEntries; it.increment(ec), ++seen)
    if (is_image_file_name(it->path().filename().string())) return true;
  return false;
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

std::string examples(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 3; ++i) out += (i ? ", " : "") + quoted(names[i]);
  return out + (names.size() > 3 ? ", ..." : "");
}

// The deepest existing folder above a missing path: where the spelling went wrong.
std::string nearest_existing(fs::path p) {
  std::error_code ec;
  while (p.has_parent_path() && p != p.parent_path()) {
    p = p.parent_path();
    if (fs::is_directory(p, ec)) return p.string();
  }
  return "";
}

}  // namespace

DataRootReport inspect_data_root(const std::string& root) {
  const std::string at = "--data_root " + quoted(root);
  std::error_code ec;
  const auto status = fs::status(root, ec);
  if (!fs::exists(status)) {
    const std::string parent = nearest_existing(fs::absolute(root, ec));
    return {DataRootKind::kMissing, at + " does not exist.",
            "check the spelling" + (parent.empty() ? std::string() : " (the nearest existing folder is " + quoted(parent) + ")") +
                "; apt-get install dataset-fashion-mnist puts Fashion-MNIST in /usr/share/datasets/fashion-mnist."};
  }
  if (!fs::is_directory(status))
    return {DataRootKind::kNotAFolder, at + " is a file, not a folder.", "pass the folder that holds the data files."};
  fs::directory_iterator it(root, ec);
  if (ec)
    return {DataRootKind::kUnreadable, at + " cannot be read (" + ec.message() + ").",
            "check its permissions, or pass a folder you can read."};

  std::vector<std::string> class_dirs, images, others;
  bool idx = false, cifar = false;
  int seen = 0;
  for (fs::directory_iterator end; it != end && seen < kMaxEntries; it.increment(ec), ++seen) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    if (name.rfind("train-images-idx3-ubyte", 0) == 0) idx = true;
    if (name == "data_batch_1.bin" || name == "cifar-10-batches-bin") cifar = true;
    std::error_code dir_ec;
    if (it->is_directory(dir_ec)) {
      if (has_image(it->path())) class_dirs.push_back(name);
    } else if (is_image_file_name(name)) {
      images.push_back(name);
    } else {
      others.push_back(name);
    }
  }
  if (idx) return {DataRootKind::kMnistLike, at + " holds IDX files.", ""};
  if (cifar) return {DataRootKind::kCifar10, at + " holds CIFAR-10 batches, not Fashion-MNIST/MNIST IDX files.", "add --dataset cifar10."};
  if (!class_dirs.empty())
    return {DataRootKind::kImageFolder,
            at + " looks like an image folder (" + std::to_string(class_dirs.size()) + " folders with images: " +
                examples(class_dirs) + "), not Fashion-MNIST/MNIST IDX files.",
            "add --dataset imagefolder."};
  if (!images.empty())
    return {DataRootKind::kLooseImages,
            at + " holds " + std::to_string(images.size()) + " loose image(s) (" + examples(images) +
                ") but no class folders.",
            "--dataset imagefolder reads ROOT/<class>/<image>: move the images into one folder per class (at least "
            "two), then add --dataset imagefolder."};
  const std::string holds = others.empty() && class_dirs.empty()
                                ? " is empty."
                                : " holds no dataset ddptrain knows (found " + examples(others.empty() ? class_dirs : others) + ").";
  return {DataRootKind::kNothingUsable, at + holds,
          "pass the folder with train-images-idx3-ubyte[.gz] (apt-get install dataset-fashion-mnist puts it in "
          "/usr/share/datasets/fashion-mnist), or --dataset imagefolder / cifar10 for other data."};
}

void throw_not_mnist_like(const std::string& root, const std::string& dataset) {
  const auto r = inspect_data_root(root);
  if (r.kind == DataRootKind::kMnistLike)
    throw UserError("--data_root '" + root + "' does not hold the " + dataset + " files.", "check the folder's contents.");
  throw UserError(r.found, r.fix);
}

}  // namespace ddp::data
