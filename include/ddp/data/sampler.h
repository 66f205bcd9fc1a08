// Which sample indices each rank visits, epoch by epoch.
//
// DistributedSampler reproduces torch.utils.data.DistributedSampler exactly:
// the permutation comes from torch::randperm with a CPU generator seeded by
// seed + epoch, the list is padded by wrap-around (or cut with drop_last) to a
// multiple of the world size, and rank r takes every world-size-th index from
// r. For evaluation, shard_without_padding() visits each index exactly once.
#pragma once

#include <cstdint>
#include <vector>

namespace ddp {

struct SamplerOptions {
  int64_t size = 0;       // samples in the dataset
  int num_replicas = 1;   // world size
  int rank = 0;
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler {
 public:
  explicit DistributedSampler(const SamplerOptions& options);

  /// Must be called at the start of every epoch, or every epoch sees the same
  /// order (the seed template's bug).
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  /// Indices this rank visits in the current epoch.
  std::vector<int64_t> indices() const;
  /// Samples per rank per epoch; equal on every rank.
  int64_t num_samples() const { return num_samples_; }
  int64_t total_size() const { return num_samples_ * options_.num_replicas; }

 private:
  SamplerOptions options_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
};

/// Indices rank, rank + world, ... below size: every sample once across ranks.
std::vector<int64_t> shard_without_padding(int64_t size, int rank, int world);

}  // namespace ddp
