// DistributedSampler with PyTorch's index arithmetic.
#include "ddp/data/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "ddp/error.h"

namespace ddp {

DistributedSampler::DistributedSampler(const SamplerOptions& o) : options_(o) {
  check_user(o.num_replicas >= 1 && o.rank >= 0 && o.rank < o.num_replicas,
             "sampler rank " + std::to_string(o.rank) + " is outside [0, " +
                 std::to_string(o.num_replicas) + ").");
  check_user(o.size >= 0, "dataset size " + std::to_string(o.size) + " is negative.");
  const int64_t w = o.num_replicas;
  if (o.drop_last && o.size % w != 0) {
    num_samples_ = (o.size - w + w - 1) / w;  // ceil((n - w) / w), n >= w
    if (o.size < w) num_samples_ = 0;
  } else {
    num_samples_ = (o.size + w - 1) / w;
  }
}

std::vector<int64_t> DistributedSampler::indices() const {
  const int64_t n = options_.size;
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (options_.shuffle && n > 0) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<uint64_t>(epoch_));
    auto perm = torch::randperm(n, gen, torch::kLong);
    const int64_t* p = perm.data_ptr<int64_t>();
    std::copy(p, p + n, order.begin());
  } else {
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  }
  const int64_t total = total_size();
  if (!options_.drop_last) {
    // Wrap around as often as needed (world size may exceed n).
    for (int64_t i = n; i < total && n > 0; ++i) order.push_back(order[static_cast<size_t>(i - n)]);
  } else {
    order.resize(static_cast<size_t>(total));
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t i = options_.rank; i < total; i += options_.num_replicas)
    mine.push_back(order[static_cast<size_t>(i)]);
  return mine;
}

std::vector<int64_t> shard_without_padding(int64_t size, int rank, int world) {
  std::vector<int64_t> out;
  for (int64_t i = rank; i < size; i += world) out.push_back(i);
  return out;
}

}  // namespace ddp
