// What a --data_root folder holds, said in words.
//
// When the user names a data folder and ddptrain cannot read the dataset it
// expects there, the run stops with an error that says what the folder holds
// and which flag reads it: a misspelt path, a tree of class folders (an image
// folder), loose images, CIFAR-10 batches, or nothing usable. Training on
// substitute data instead would hide the mistake behind a good-looking run.
#pragma once

#include <string>

namespace ddp::data {

enum class DataRootKind {
  kMissing,        // no such path
  kNotAFolder,     // a file
  kUnreadable,     // exists, but cannot be listed
  kMnistLike,      // IDX files (Fashion-MNIST or MNIST)
  kImageFolder,    // <root>/<class>/<image>
  kLooseImages,    // images directly in <root>, no class folders
  kCifar10,        // data_batch_1.bin or cifar-10-batches-bin/
  kNothingUsable,  // empty, or files of no known kind
};

struct DataRootReport {
  DataRootKind kind = DataRootKind::kNothingUsable;
  std::string found;  // a sentence: what is at the path
  std::string fix;    // what to pass instead
};

/// Looks at `root` (a few hundred entries at most) and says what it holds.
DataRootReport inspect_data_root(const std::string& root);

/// Throws the UserError for `root` not holding the IDX files of `dataset`
/// ("Fashion-MNIST" or "MNIST"), built from inspect_data_root().
[[noreturn]] void throw_not_mnist_like(const std::string& root, const std::string& dataset);

}  // namespace ddp::data
