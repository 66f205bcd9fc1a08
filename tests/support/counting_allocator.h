// A counting wrapper around the CPU allocator, for tests that measure the
// bytes a step holds (recompute_test.cpp, the test worker's ZeRO-2 memory).
#pragma once

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "ddp/compat.h"

namespace ddp::testing {

// The CPU allocator, wrapped to count the bytes live now and at most. The
// memory is the base allocator's (its DataPtr's context is the data, which
// LibTorch's raw_allocate checks): the sizes are kept by address.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) { self() = this; }
  c10::DataPtr allocate(size_t n) DDP_ALLOCATOR_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    TORCH_CHECK(data == inner.get_context() || data == nullptr, "CountingAllocator: the base allocator has contexts");
    const auto device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_[data] = {n, inner.get_deleter()};
    }
    inner.release_context();
    const int64_t now = live_ += static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // LibTorch 2.x asks for it; 1.13 has no such virtual.
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }
  void reset_peak() const { peak_ = live_.load(); }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }

 private:
  struct Held {
    size_t n;
    c10::DeleterFnPtr deleter;
  };
  static CountingAllocator*& self() {
    static CountingAllocator* s = nullptr;
    return s;
  }
  static void release(void* p) {
    auto* me = self();
    Held h{0, nullptr};
    {
      std::lock_guard<std::mutex> lock(me->mu_);
      auto it = me->held_.find(p);
      if (it == me->held_.end()) return;
      h = it->second;
      me->held_.erase(it);
    }
    me->live_ -= static_cast<int64_t>(h.n);
    if (h.deleter) h.deleter(p);
  }
  c10::Allocator* base_;
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, Held> held_;
  mutable std::atomic<int64_t> live_{0}, peak_{0};
};

// Installed once for the process, in front of the CPU's allocator (it only
// counts; the memory is the base allocator's).
inline const CountingAllocator& counting_allocator() {
  static auto* a = [] {
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/200);
    return c;
  }();
  return *a;
}

}  // namespace ddp::testing
