// What identifies a run's data, so that a run can move but not change data.
//
// A resumed run may read its data from another place (--data_root and
// --val-root may change on resume, and differ between nodes), but it must
// read the same data: a checkpoint's weights, optimizer state and sampler
// position mean nothing on other samples. Each checkpoint keeps, for every
// split that the task's make_data() gave, the dataset's name, size and
// fingerprint (Dataset::fingerprint), and a resumed run compares them with
// its own before it trains.
//
// A fingerprint must be cheap: it is taken at every start, on data of any
// size, so it reads a few header fields and a bounded sample of the bytes
// already in memory, never every sample or every file. It tells different
// data apart in practice (another dataset, another size, a folder with other
// files), not a deliberate forgery.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "ddp/data/dataset.h"

namespace ddp::data {

/// A 64-bit hash (FNV-1a, mixed) of what is added, as 16 hex digits: the
/// same on every machine and standard library, unlike std::hash.
class Fingerprint {
 public:
  Fingerprint& add(const void* bytes, size_t count);
  Fingerprint& add(const std::string& text);  // with its length: "ab","c" is not "a","bc"
  Fingerprint& add(int64_t value);
  /// `rows` rows of `row_bytes` each at `data`: at most kSampledRows of
  /// them, evenly spread from the first to the last, and the count.
  Fingerprint& add_rows(const void* data, int64_t rows, int64_t row_bytes);
  /// A tensor's type, shape and sampled rows (along its first dimension).
  Fingerprint& add(const torch::Tensor& t);
  std::string hex() const;

  static constexpr int64_t kSampledRows = 64;

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

/// The record a checkpoint keeps: {"locations": [...], "train": {"name",
/// "size", "fingerprint"}, "test": {...}, "val": {...}} for the splits
/// present. `locations` are the folders make_data() read (--data_root,
/// --val-root as it saw them; empty ones are left out): a dataset's name may
/// contain its location (an image folder's does), which may change.
nlohmann::json data_identity(const Splits& splits, const std::vector<std::string>& locations);

/// How the data of `now` differs from `saved`, as clauses for one line
/// ("the train split 'mnist (train)' has 2000 samples, the run's had
/// 3000"); "" when it is the same data, or when `saved` is null (a
/// checkpoint from before the record: nothing to compare). Names compare
/// equal when they differ only in their locations; an empty fingerprint on
/// either side (a dataset that has none) is not compared.
std::string data_difference(const nlohmann::json& saved, const nlohmann::json& now);

}  // namespace ddp::data
