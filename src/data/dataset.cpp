// The default Dataset::get_batch: one get() per index, stacked. Datasets that
// hold their examples in one tensor override it with a single gather.
#include "ddp/data/dataset.h"

namespace ddp::data {

Batch Dataset::get_batch(const std::vector<int64_t>& indices) const {
  if (indices.empty()) {
    // torch::stack refuses an empty list; an empty batch keeps the shape.
    std::vector<int64_t> shape = input_shape();
    shape.insert(shape.begin(), 0);
    return {torch::empty(shape), torch::empty({0}, torch::kLong)};
  }
  std::vector<torch::Tensor> inputs, targets;
  inputs.reserve(indices.size());
  targets.reserve(indices.size());
  for (int64_t i : indices) {
    Example e = get(i);
    inputs.push_back(std::move(e.input));
    targets.push_back(std::move(e.target));
  }
  return {torch::stack(inputs), torch::stack(targets)};
}

Batch Dataset::get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& /*key*/,
                               int64_t /*first_position*/) const {
  return get_batch(indices);
}

}  // namespace ddp::data
