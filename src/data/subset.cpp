// Subset, and carving a validation split out of a training set.
#include "ddp/data/subset.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "ddp/data/counter_rng.h"
#include "ddp/error.h"

namespace ddp::data {

Subset::Subset(DatasetPtr base, std::vector<int64_t> indices, std::string name)
    : base_(std::move(base)), indices_(std::move(indices)), name_(std::move(name)) {
  TORCH_CHECK(base_ != nullptr, "Subset of no dataset");
  for (int64_t i : indices_)
    TORCH_CHECK(i >= 0 && i < base_->size(), name_, ": index ", i, " outside [0, ", base_->size(), ")");
}

std::vector<int64_t> Subset::to_base(const std::vector<int64_t>& indices) const {
  std::vector<int64_t> out;
  out.reserve(indices.size());
  for (int64_t i : indices) {
    TORCH_CHECK(i >= 0 && i < size(), name_, ": index ", i, " outside [0, ", size(), ")");
    out.push_back(indices_[static_cast<size_t>(i)]);
  }
  return out;
}

Example Subset::get(int64_t index) const { return base_->get(to_base({index}).front()); }

Batch Subset::get_batch(const std::vector<int64_t>& indices) const { return base_->get_batch(to_base(indices)); }

Batch Subset::get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key, int64_t first_position) const {
  return base_->get_keyed_batch(to_base(indices), key, first_position);
}

std::vector<int64_t> validation_indices(int64_t size, double fraction, uint64_t seed) {
  const auto n_val = static_cast<int64_t>(std::llround(fraction * static_cast<double>(size)));
  // Fisher-Yates from a keyed stream: the same split from the same seed on
  // every machine and standard library (std::shuffle's is unspecified).
  std::vector<int64_t> order(static_cast<size_t>(size));
  std::iota(order.begin(), order.end(), 0);
  KeyedRandom random(hash_words({seed, 0x76616c5f73706c74ull /* "val_splt" */}));
  for (int64_t i = size - 1; i > 0; --i) std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(random.below(i + 1))]);
  order.resize(static_cast<size_t>(std::clamp<int64_t>(n_val, 0, size)));
  std::sort(order.begin(), order.end());
  return order;
}

std::pair<DatasetPtr, DatasetPtr> carve_validation(const DatasetPtr& train, double fraction, uint64_t seed) {
  const int64_t n = train->size();
  auto val = validation_indices(n, fraction, seed);
  std::ostringstream f;
  f << fraction;
  check_user(!val.empty() && static_cast<int64_t>(val.size()) < n,
             "--val-split " + f.str() + " of the " + std::to_string(n) + " samples of " + train->name() + " leaves " +
                 (val.empty() ? "no validation sample." : "no training sample."),
             val.empty() ? "raise --val-split (e.g. --val-split 0.1), or train on more samples."
                         : "lower --val-split (e.g. --val-split 0.1).");
  std::vector<int64_t> rest;
  rest.reserve(static_cast<size_t>(n) - val.size());
  for (int64_t i = 0, v = 0; i < n; ++i) {
    if (v < static_cast<int64_t>(val.size()) && val[static_cast<size_t>(v)] == i) ++v;
    else rest.push_back(i);
  }
  const std::string name = train->name();
  return {std::make_shared<Subset>(train, std::move(rest), name + " less --val-split " + f.str()),
          std::make_shared<Subset>(train, std::move(val), name + " --val-split " + f.str())};
}

DatasetPtr empty_like(const DatasetPtr& like, const std::string& name) {
  return std::make_shared<Subset>(like, std::vector<int64_t>{}, name);
}

}  // namespace ddp::data
