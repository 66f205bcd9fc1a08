// The side stream for backward work off the critical path (side_stream.h).
#include "ddp/cuda/side_stream.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace ddp::cuda {
namespace {

std::atomic<bool> g_on{[] {
  const char* v = std::getenv("DDP_SIDE_STREAM");
  return v == nullptr || std::strcmp(v, "0") != 0;
}()};

// A piece of side work: the event recorded after it on the side stream, and
// the tensors it reads, kept until the current stream has waited for it.
struct Piece {
  at::cuda::CUDAEvent done;
  std::vector<at::Tensor> reads;
};

// At most this many pieces in flight: a GPT layer hands over five (the
// MLP's two weight gradients and its first bias sum, and the weight
// gradients of the attention's two projections), so the side stream may
// lag two layers behind. (DDP_SIDE_BACKLOG: an experiment's knob.)
const size_t kBacklog = [] {
  const char* v = std::getenv("DDP_SIDE_BACKLOG");
  return v != nullptr ? static_cast<size_t>(std::max(1, std::atoi(v))) : size_t{10};
}();

struct State {
  std::mutex mu;
  size_t pieces = 0;
  bool open = false;
  c10::DeviceIndex device = 0;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;  // one side stream per device, for the process
  std::deque<std::unique_ptr<Piece>> backlog;
};

State& state() {
  static State s;
  return s;
}

// Under s.mu.
void join_locked(State& s) {
  if (s.backlog.empty()) return;
  s.backlog.back()->done.block(at::cuda::getCurrentCUDAStream(s.device));  // one stream: the last done, all done
  s.backlog.clear();
}

}  // namespace

void set_side_stream(bool on) { g_on.store(on); }
bool side_stream_enabled() { return g_on.load(); }

SideWork::SideWork(bool cuda) {
  if (!cuda || !g_on.load()) return;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  TORCH_CHECK(!s.open, "SideWork: side work is already open (one training step's backward at a time)");
  s.device = c10::cuda::current_device();
  if (s.streams.find(s.device) == s.streams.end())
    s.streams.emplace(s.device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, s.device));
  s.open = open_ = true;
}

SideWork::~SideWork() {
  if (!open_) return;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  try {
    join_locked(s);
  } catch (const std::exception& e) {
    // Unwinding from a failed backward: the error that matters is that one.
    std::fprintf(stderr, "ddptrain: joining the side stream failed: %s\n", e.what());
    s.backlog.clear();
  }
  s.open = false;
}

void aside(const std::function<void()>& work, std::initializer_list<at::Tensor> reads) {
  auto& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.open || c10::cuda::current_device() != s.device) {
    lock.unlock();
    work();
    return;
  }
  const auto here = at::cuda::getCurrentCUDAStream(s.device);
  const auto side = s.streams.at(s.device);
  if (side == here) {  // the pool handed the same stream out again: one stream, nothing to order
    lock.unlock();
    work();
    return;
  }
  at::cuda::CUDAEvent fork;
  fork.record(here);
  fork.block(side);
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    work();
  }
  auto piece = std::make_unique<Piece>();
  piece->done.record(side);
  piece->reads.assign(reads.begin(), reads.end());
  s.backlog.push_back(std::move(piece));
  ++s.pieces;
  while (s.backlog.size() > kBacklog) {
    s.backlog.front()->done.block(here);
    s.backlog.pop_front();
  }
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
