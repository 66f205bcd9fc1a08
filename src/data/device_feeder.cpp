// Side-stream host-to-device copies, one batch ahead of the step; with a
// device stage, a thread of the feeder's own keeps batches ready.
#include "ddp/data/device_feeder.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "ddp/compat.h"

namespace ddp::data {

namespace {
// Batches the stage thread finishes ahead of the step: one being used, one
// ready; a third would only hold more device memory.
constexpr size_t kStagedAhead = 2;
}  // namespace

#ifdef DDP_WITH_CUDA
// The side stream has high priority: while the step's kernels queue on the
// main stream, the GPU schedules the next batch's (small) kernels first, so
// the batch is ready when the step needs it. (This matters most for the
// GPU image stage, whose nvJPEG and resample kernels would otherwise wait
// for SMs behind the step's; its effect on config (f) is yet to be
// measured: bench/RESULTS.md, session 8.)
struct DeviceFeeder::Cuda {
  c10::cuda::CUDAStream stream;
  at::cuda::CUDAEvent copied;
  explicit Cuda(c10::DeviceIndex index) : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index)) {}
};
#else
struct DeviceFeeder::Cuda {};
#endif

// The stage thread's output, in order: each batch with the event its side-
// stream work recorded; an error or the end of the loader closes it.
struct DeviceFeeder::Staged {
  struct Item {
    std::optional<Batch> batch;  // none: the end, or an error
    std::exception_ptr error;
#ifdef DDP_WITH_CUDA
    std::shared_ptr<at::cuda::CUDAEvent> done;
#endif
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Item> items;
  bool stop = false, ended = false;
  std::thread thread;
};

DeviceFeeder::DeviceFeeder(Loader& loader, torch::Device device, Prepare prepare, std::shared_ptr<DeviceStage> stage)
    : loader_(loader), device_(device), prepare_(std::move(prepare)), stage_(std::move(stage)) {
#ifdef DDP_WITH_CUDA
  if (device_.is_cuda()) cuda_ = std::make_unique<Cuda>(device_.index());
#endif
  if (stage_) staged_ = std::make_unique<Staged>();
}

DeviceFeeder::~DeviceFeeder() {
  if (staged_ && staged_->thread.joinable()) {
    {
      std::lock_guard<std::mutex> lock(staged_->mutex);
      staged_->stop = true;
    }
    staged_->changed.notify_all();
    staged_->thread.join();  // after at most the batch it is building
  }
}

void DeviceFeeder::finish(Batch& b) {
  if (stage_) stage_->run(b, device_);
  for (auto& [name, t] : b) t = t.to(device_, /*non_blocking=*/true);
  if (prepare_ && b.contains("input")) b.input() = prepare_(b.input());
}

// ---- without a stage: the next batch is copied while this step runs -------

std::optional<Batch> DeviceFeeder::fetch() {
  const auto t0 = std::chrono::steady_clock::now();
  auto batch = loader_.next();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!batch) return batch;
#ifdef DDP_WITH_CUDA
  if (cuda_) {
    c10::cuda::CUDAStreamGuard on_side(cuda_->stream);
    finish(*batch);
    cuda_->copied.record(cuda_->stream);
    return batch;
  }
#endif
  finish(*batch);
  return batch;
}

std::optional<Batch> DeviceFeeder::next() {
  if (staged_) return next_staged();
  if (!started_) {
    ahead_ = fetch();
    started_ = true;
  }
  auto batch = std::move(ahead_);
  ahead_.reset();
  if (!batch) return batch;
#ifdef DDP_WITH_CUDA
  if (cuda_) {
    auto current = c10::cuda::getCurrentCUDAStream(device_.index());
    cuda_->copied.block(current);
    // The tensors were made on the side stream and are used on this one.
    for (auto& [name, t] : *batch) t.record_stream(current.unwrap());
  }
#endif
  ahead_ = fetch();  // starts the next copy now, so it overlaps this step
  return batch;
}

// ---- with a stage: a thread runs the loader and the stage ahead ------------
// The stage's host work (nvJPEG's calls, for one) then overlaps the step's
// launch instead of delaying it.

void DeviceFeeder::stage_loop() {
  Staged& s = *staged_;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      s.changed.wait(lock, [&] { return s.stop || s.items.size() < kStagedAhead; });
      if (s.stop) return;
    }
    Staged::Item item;
    try {
      item.batch = loader_.next();
      if (item.batch) {
#ifdef DDP_WITH_CUDA
        if (cuda_) {
          const c10::cuda::CUDAGuard on_device(device_);
          const c10::cuda::CUDAStreamGuard on_side(cuda_->stream);
          finish(*item.batch);
          item.done = std::make_shared<at::cuda::CUDAEvent>();
          item.done->record(cuda_->stream);
        } else
#endif
        {
          finish(*item.batch);
        }
      }
    } catch (...) {
      item.batch.reset();
      item.error = std::current_exception();
    }
    const bool last = !item.batch;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.items.push_back(std::move(item));
    }
    s.changed.notify_all();
    if (last) return;
  }
}

void DeviceFeeder::start() {
  if (staged_ && !staged_->ended && !staged_->thread.joinable()) staged_->thread = std::thread([this] { stage_loop(); });
}

std::optional<Batch> DeviceFeeder::next_staged() {
  Staged& s = *staged_;
  if (s.ended) return std::nullopt;
  start();
  Staged::Item item;
  {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(s.mutex);
    s.changed.wait(lock, [&] { return !s.items.empty(); });
    item = std::move(s.items.front());
    s.items.pop_front();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  s.changed.notify_all();
  if (!item.batch) s.ended = true;
  if (item.error) std::rethrow_exception(item.error);
  if (!item.batch) return std::nullopt;
#ifdef DDP_WITH_CUDA
  if (item.done) {
    auto current = c10::cuda::getCurrentCUDAStream(device_.index());
    item.done->block(current);
    for (auto& [name, t] : *item.batch) t.record_stream(current.unwrap());
  }
#endif
  return std::move(item.batch);
}

}  // namespace ddp::data
