// The ordered, bounded, multi-threaded batch loader.
#include "ddp/data/loader.h"

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>

#include "ddp/error.h"

namespace ddp::data {

Loader::Loader(DatasetPtr dataset, std::vector<int64_t> indices, LoaderOptions options)
    : dataset_(std::move(dataset)), indices_(std::move(indices)), options_(std::move(options)) {
  TORCH_CHECK(dataset_ != nullptr, "Loader needs a dataset");
  check_user(options_.batch_size() >= 1,
             "batch size " + std::to_string(options_.batch_size()) + " is not positive.",
             "pass --batch 1 or more.");
  check_user(options_.workers() >= 0,
             "data loader workers " + std::to_string(options_.workers()) + " is negative.",
             "pass --workers 0 (load in the training thread) or more.");
  check_user(options_.prefetch() >= 1,
             "data loader prefetch " + std::to_string(options_.prefetch()) + " is not positive.",
             "prefetch depth must be 1 or more (LoaderOptions::prefetch).");
  // The sampler made these indices, so one out of range is a bug, not a
  // user mistake; catching it here names the index rather than a batch.
  const int64_t size = dataset_->size();
  for (int64_t i : indices_)
    TORCH_CHECK(i >= 0 && i < size, dataset_->name(), ": index ", i, " outside [0, ", size, ")");

  const auto n = static_cast<int64_t>(indices_.size());
  const int64_t b = options_.batch_size();
  num_batches_ = options_.drop_last() ? n / b : (n + b - 1) / b;
  check_user(options_.start_batch() >= 0, "loader start batch " + std::to_string(options_.start_batch()) + " is negative.");
  next_batch_ = next_claim_ = std::min(options_.start_batch(), num_batches_);

  const int64_t threads = std::min(options_.workers(), num_batches_);
  if (threads == 0) return;
  slots_.resize(static_cast<size_t>(options_.prefetch()));
  workers_.reserve(static_cast<size_t>(threads));
  try {
    for (int64_t t = 0; t < threads; ++t) workers_.emplace_back([this] { work(); });
  } catch (...) {
    // The destructor does not run for a half-built object: join here.
    shutdown();
    throw;
  }
}

Loader::~Loader() { shutdown(); }

void Loader::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  space_.notify_all();
  // A worker in the middle of build() finishes that batch first; none waits
  // on anything but space_, so the joins cannot hang.
  for (auto& t : workers_) t.join();
  workers_.clear();
}

Batch Loader::build(int64_t k) const {
  const int64_t b = options_.batch_size();
  const int64_t first = k * b;
  const int64_t last = std::min(first + b, static_cast<int64_t>(indices_.size()));
  std::vector<int64_t> chunk(indices_.begin() + first, indices_.begin() + last);
  const DrawKey key{options_.seed(), options_.epoch(), options_.rank()};
  Batch batch = dataset_->get_keyed_batch(chunk, key, first);
  if (options_.transform()) options_.transform()(batch, key, first);
  if (options_.pin_memory() && torch::cuda::is_available()) {
    for (auto& [name, t] : batch) t = t.pin_memory();
  }
  return batch;
}

void Loader::work() {
  // One intra-op thread per worker, as in PyTorch's DataLoader workers: the
  // workers already share the batch's samples out, and a full-width OpenMP
  // team in each (LibTorch's default) put workers x cores threads on the
  // cores; on a 16-core GPU machine that halved the image-folder loader's
  // rate. OpenMP keeps the setting per thread, so the training thread keeps
  // its own count (ATen's stored default, which new threads copy, becomes
  // 1; the next epoch's workers set it again anyway).
#if AT_PARALLEL_OPENMP
  at::set_num_threads(1);
#else
  at::init_num_threads();
#endif
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    space_.wait(lock, [this] {
      return stop_ || next_claim_ >= num_batches_ || next_claim_ < next_batch_ + options_.prefetch();
    });
    if (stop_ || next_claim_ >= num_batches_) return;
    const int64_t k = next_claim_++;
    lock.unlock();
    Slot done;
    try {
      done.batch = build(k);
    } catch (...) {
      done.error = std::current_exception();
    }
    done.ready = true;
    lock.lock();
    slot(k) = std::move(done);
    ready_.notify_all();
  }
}

std::optional<Batch> Loader::next() {
  if (failed_) std::rethrow_exception(failed_);
  if (next_batch_ >= num_batches_) return std::nullopt;
  if (workers_.empty()) {
    try {
      return build(next_batch_++);
    } catch (...) {
      failed_ = std::current_exception();
      throw;
    }
  }
  Slot taken;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    Slot& s = slot(next_batch_);
    ready_.wait(lock, [&s] { return s.ready; });
    taken = std::move(s);
    s = Slot{};
    ++next_batch_;
  }
  space_.notify_all();
  if (taken.error) {
    failed_ = taken.error;
    {
      // Nothing after a failed batch will be handed out: let workers go.
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    space_.notify_all();
    std::rethrow_exception(failed_);
  }
  return std::move(taken.batch);
}

}  // namespace ddp::data
