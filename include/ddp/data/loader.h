// Batches for one rank and one epoch, built ahead of the training step.
//
// The Loader walks this rank's index list (from DistributedSampler) in order:
// batch k always holds indices[k*B .. k*B+B), whatever the number of worker
// threads, so runs are reproducible and a checkpoint's data position is just
// a batch count. Workers claim batches in order and may run at most
// `prefetch` batches ahead of the consumer, which bounds memory. A worker's
// exception is rethrown by next() when the consumer reaches that batch, and
// destroying the Loader early stops and joins the workers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "ddp/data/dataset.h"
#include "ddp/data/transforms.h"

namespace ddp::data {

struct LoaderOptions {
  LoaderOptions() = default;
  /* implicit */ LoaderOptions(int64_t batch_size) : batch_size_(batch_size) {}

  /// Samples per batch on this rank.
  TORCH_ARG(int64_t, batch_size) = 64;
  /// Drop a last batch smaller than batch_size instead of yielding it.
  TORCH_ARG(bool, drop_last) = false;
  /// Threads that build batches; 0 builds them in next(), on the caller's thread.
  TORCH_ARG(int64_t, workers) = 0;
  /// Batches built or being built ahead of the consumer, at most.
  TORCH_ARG(int64_t, prefetch) = 2;
  /// Put batches in page-locked memory for faster copies to the GPU; ignored
  /// where CUDA is not available.
  TORCH_ARG(bool, pin_memory) = false;
  /// Run seed, epoch and rank: the key for the random draws of the dataset
  /// (Dataset::get_keyed_batch, e.g. image folders) and of the transform.
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(int64_t, epoch) = 0;
  TORCH_ARG(int64_t, rank) = 0;
  /// Batches to skip: resuming in the middle of an epoch starts here, with
  /// the same indices and augmentation draws as an uninterrupted run.
  TORCH_ARG(int64_t, start_batch) = 0;
  /// Applied to every batch after it is gathered, e.g. make_augment(...).
  TORCH_ARG(Transform, transform) = nullptr;
};

class Loader {
 public:
  Loader(DatasetPtr dataset, std::vector<int64_t> indices, LoaderOptions options);
  /// Stops the workers and waits for them; batches in flight are dropped.
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// The next batch in order, or nullopt after the last one. Rethrows an
  /// exception from building this batch; the Loader is spent after that and
  /// every later call throws it again.
  std::optional<Batch> next();

  /// Batches this epoch, counting a last partial one unless drop_last.
  int64_t num_batches() const { return num_batches_; }
  /// Batches handed out by next() so far.
  int64_t batches_done() const { return next_batch_; }

 private:
  // One produced batch, or the exception thrown while producing it.
  struct Slot {
    bool ready = false;
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  Batch build(int64_t k) const;
  void work();
  void shutdown();
  Slot& slot(int64_t k) { return slots_[static_cast<size_t>(k % options_.prefetch())]; }

  DatasetPtr dataset_;
  std::vector<int64_t> indices_;
  LoaderOptions options_;
  int64_t num_batches_ = 0;
  int64_t next_batch_ = 0;      // next batch next() returns
  std::exception_ptr failed_;   // set once next() has thrown

  // Shared with the workers, guarded by mutex_. Batch k lives in slot
  // k % prefetch; a worker claims batch k only once k < next_batch_ + prefetch,
  // so a slot is never claimed twice before next() empties it.
  std::mutex mutex_;
  std::condition_variable ready_;  // a slot was filled
  std::condition_variable space_;  // next() freed a slot, or stopping
  std::vector<Slot> slots_;
  int64_t next_claim_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace ddp::data
