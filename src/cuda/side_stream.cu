// The side stream for backward work off the critical path (side_stream.h).
#include "ddp/cuda/side_stream.h"
#include "ddp/program.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

namespace ddp::cuda {
namespace {

std::atomic<SideStreamMode> g_mode{SideStreamMode::kAuto};

// The work handed over is launched in batches: each batch is one fork from
// the current stream (an event it records and the side stream waits for)
// and one join later. In a CUDA graph every such edge between the streams
// costs the graph's scheduler time; a piece per weight gradient left the
// GPU idle 0.7 ms a step of GPT-2 (bench/RESULTS.md, session 27).
struct Batch {
  at::cuda::CUDAEvent done;                 // recorded on the side stream after the batch
  std::vector<std::function<void()>> work;  // kept: their captures are what the batch reads
};

// Pieces a batch: a GPT layer hands over five (the MLP's two weight
// gradients and its first bias sum, and the weight gradients of the
// attention's two projections). Launched batches not yet waited for: at
// most kBacklog, so the side stream lags a bounded number of layers (and
// what they read stays alive no longer). Other batch sizes and backlogs
// measured no better (bench/RESULTS.md, session 27).
constexpr size_t kBatch = 5;
constexpr size_t kBacklog = 2;

struct State {
  std::mutex mu;
  size_t pieces = 0;
  bool open = false;
  c10::DeviceIndex device = 0;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;  // one side stream per device, for the process
  std::set<c10::DeviceIndex> warmed_up;                         // devices whose first SideWork has come
  std::vector<std::function<void()>> pending;                 // handed over, not yet launched
  std::deque<std::unique_ptr<Batch>> launched;                // launched, not yet waited for
};

State& state() {
  static State s;
  return s;
}

// Under s.mu: the pending pieces, launched on the side stream after what
// `here` has queued; then `here` waits for the oldest batches beyond the
// backlog.
void launch_pending(State& s, const c10::cuda::CUDAStream& here) {
  if (s.pending.empty()) return;
  auto batch = std::make_unique<Batch>();
  batch->work.swap(s.pending);
  const auto side = s.streams.at(s.device);
  at::cuda::CUDAEvent fork;
  fork.record(here);
  fork.block(side);
  try {
    const c10::cuda::CUDAStreamGuard on_side(side);
    for (const auto& w : batch->work) w();
  } catch (...) {
    // What ran reads tensors freed with the batch: `here` waits for it first.
    at::cuda::CUDAEvent ran;
    ran.record(side);
    ran.block(here);
    throw;
  }
  batch->done.record(side);
  s.launched.push_back(std::move(batch));
  while (s.launched.size() > kBacklog) {
    s.launched.front()->done.block(here);
    s.launched.pop_front();
  }
}

// Under s.mu.
void join_locked(State& s) {
  if (s.pending.empty() && s.launched.empty()) return;
  const auto here = at::cuda::getCurrentCUDAStream(s.device);
  launch_pending(s, here);
  s.launched.back()->done.block(here);  // one stream: the last done, all done
  s.launched.clear();
}

}  // namespace

void set_side_stream(SideStreamMode mode) { g_mode.store(mode); }
SideStreamMode side_stream_mode() { return g_mode.load(); }
bool side_stream_wanted(bool vouched) {
  const auto mode = g_mode.load();
  return mode == SideStreamMode::kOn || (mode == SideStreamMode::kAuto && vouched);
}

SideWork::SideWork(bool wanted) {
  if (!wanted) return;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  TORCH_CHECK(!s.open, "SideWork: side work is already open (one training step's backward at a time)");
  s.device = c10::cuda::current_device();
  // The first backward runs on one stream: its matmuls choose their
  // algorithms by timing (gemm_gelu.h) without the other stream's work
  // beside them.
  if (s.warmed_up.insert(s.device).second) return;
  if (s.streams.find(s.device) == s.streams.end()) {
    // No stream may be made inside a CUDA graph's capture: this backward
    // then runs on one stream (a training step's eager steps come first).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(s.device), &capture));
    if (capture != cudaStreamCaptureStatusNone) return;
    // A stream of its own, for the process: the pool's are handed out round
    // robin, so one of them may be another component's current stream.
    const c10::cuda::CUDAGuard on(s.device);
    cudaStream_t raw = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    s.streams.emplace(s.device, c10::cuda::getStreamFromExternal(raw, s.device));
  }
  s.open = open_ = true;
}

void SideWork::close() {
  if (!open_) return;
  open_ = false;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.open = false;
  try {
    join_locked(s);
  } catch (...) {
    s.pending.clear();
    s.launched.clear();
    throw;
  }
}

SideWork::~SideWork() {
  if (!open_) return;
  if (std::uncaught_exceptions() == 0) {
    try {
      close();
    } catch (const std::exception& e) {
      // A destructor must not throw; callers that can take the error call close().
      std::fprintf(stderr, "%s: joining the side stream failed: %s\n", program_name(), e.what());
    }
    return;
  }
  try {
    close();
  } catch (const std::exception& e) {
    // Unwinding from a failed backward: the error that matters is that one.
    std::fprintf(stderr, "%s: joining the side stream failed too: %s\n", program_name(), e.what());
  }
}

void aside(std::function<void()> work) {
  auto& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  const bool here_and_now = !s.open || c10::cuda::current_device() != s.device;
  if (here_and_now || s.streams.at(s.device) == at::cuda::getCurrentCUDAStream(s.device)) {
    // No side work open (or the pool handed the side stream out again as
    // this one: nothing to order).
    lock.unlock();
    work();
    return;
  }
  s.pending.push_back(std::move(work));
  ++s.pieces;
  if (s.pending.size() >= kBatch) launch_pending(s, at::cuda::getCurrentCUDAStream(s.device));
}

size_t side_pieces() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.pieces;
}

void join_side_work() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  join_locked(s);
}

}  // namespace ddp::cuda
