// Named tensors, and the default Dataset::get_batch: one get() per index,
// stacked name by name. Datasets that hold their examples in one tensor
// override it with a single gather.
#include "ddp/data/dataset.h"

#include "ddp/error.h"

namespace ddp::data {

TensorDict::TensorDict(torch::Tensor input, torch::Tensor target) {
  items_.emplace("input", std::move(input));
  items_.emplace("target", std::move(target));
}

namespace {
std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "none" : s;
}
}  // namespace

const torch::Tensor& TensorDict::at(const std::string& name) const {
  auto it = items_.find(name);
  if (it == items_.end())
    throw UserError("the batch has no tensor named '" + name + "'; it has: " + joined(names()) + ".",
                    "give it from your dataset's get() (e.g. {{\"" + name + "\", tensor}, ...}), or read a name it has.");
  return it->second;
}

torch::Tensor& TensorDict::at(const std::string& name) {
  return const_cast<torch::Tensor&>(static_cast<const TensorDict&>(*this).at(name));
}

std::vector<std::string> TensorDict::names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : items_) out.push_back(name);
  return out;
}

int64_t TensorDict::batch_size() const {
  if (items_.empty()) return 0;
  const auto& t = contains("input") ? at("input") : items_.begin()->second;
  return t.defined() && t.dim() > 0 ? t.size(0) : 0;
}

Batch stack(const std::vector<Example>& examples) {
  Batch out;
  if (examples.empty()) return out;
  const auto names = examples.front().names();
  for (const auto& name : names) {
    std::vector<torch::Tensor> parts;
    parts.reserve(examples.size());
    for (const auto& e : examples) {
      check_user(e.names() == names, "the dataset's examples have different names: " + joined(names) + " and " +
                                         joined(e.names()) + ".",
                 "give every example the same names from get().");
      parts.push_back(e.at(name));
    }
    out[name] = torch::stack(parts);
  }
  return out;
}

Batch Dataset::get_batch(const std::vector<int64_t>& indices) const {
  if (indices.empty()) {
    // torch::stack refuses an empty list; an empty batch keeps the shape.
    std::vector<int64_t> shape = input_shape();
    shape.insert(shape.begin(), 0);
    return {torch::empty(shape), torch::empty({0}, torch::kLong)};
  }
  std::vector<Example> examples;
  examples.reserve(indices.size());
  for (int64_t i : indices) examples.push_back(get(i));
  return stack(examples);
}

Batch Dataset::get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& /*key*/,
                               int64_t /*first_position*/) const {
  return get_batch(indices);
}

}  // namespace ddp::data
