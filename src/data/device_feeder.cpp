// Side-stream host-to-device copies, one batch ahead of the step.
#include "ddp/data/device_feeder.h"

#include <chrono>

#include "ddp/compat.h"

namespace ddp::data {

#ifdef DDP_WITH_CUDA
struct DeviceFeeder::Cuda {
  c10::cuda::CUDAStream stream;
  at::cuda::CUDAEvent copied;
  explicit Cuda(c10::DeviceIndex index) : stream(c10::cuda::getStreamFromPool(false, index)) {}
};
#else
struct DeviceFeeder::Cuda {};
#endif

DeviceFeeder::DeviceFeeder(Loader& loader, torch::Device device, Prepare prepare, std::shared_ptr<DeviceStage> stage)
    : loader_(loader), device_(device), prepare_(std::move(prepare)), stage_(std::move(stage)) {
#ifdef DDP_WITH_CUDA
  if (device_.is_cuda()) cuda_ = std::make_unique<Cuda>(device_.index());
#endif
}

DeviceFeeder::~DeviceFeeder() = default;

std::optional<Batch> DeviceFeeder::fetch() {
  const auto t0 = std::chrono::steady_clock::now();
  auto batch = loader_.next();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!batch) return batch;
  auto move = [&](Batch& b) {
    if (stage_) {
      // Host time the device stage takes (e.g. nvJPEG's calls) holds up the
      // training loop as waiting for the loader does: it counts as waiting.
      const auto s0 = std::chrono::steady_clock::now();
      stage_->run(b, device_);
      wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    }
    for (auto& [name, t] : b) t = t.to(device_, /*non_blocking=*/true);
    if (prepare_ && b.contains("input")) b.input() = prepare_(b.input());
  };
#ifdef DDP_WITH_CUDA
  if (cuda_) {
    c10::cuda::CUDAStreamGuard on_side(cuda_->stream);
    move(*batch);
    cuda_->copied.record(cuda_->stream);
    return batch;
  }
#endif
  move(*batch);
  return batch;
}

std::optional<Batch> DeviceFeeder::next() {
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

}  // namespace ddp::data
