// Host-side helpers the CUDA kernel files share: a tensor's data as a typed
// pointer (for element types, such as __nv_bfloat16, that data_ptr<T>()
// does not know), the 16-byte alignment the vectorised loads need, and how
// many blocks of a kernel an SM holds and how much shared memory it may
// have (src/cuda/occupancy.cu).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ddp::cuda {

template <typename T>
const T* as(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

template <typename T>
T* as_mut(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline bool aligned(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }

/// How many `threads`-thread blocks of `kernel` with `shared` bytes of
/// dynamic shared memory an SM of the current device holds at once. Asked of
/// the CUDA runtime once per (kernel, threads, shared, device) and then
/// remembered: the steps launch these kernels dozens of times each.
int resident_blocks_per_sm(const void* kernel, int threads, size_t shared);

/// The most dynamic shared memory one block of `kernel` may ask for on the
/// current device: the device's opt-in maximum per block less the kernel's
/// static shared memory. Asked once per (kernel, device).
size_t dynamic_shared_limit(const void* kernel);

/// Lets `kernel` launch with `bytes` of dynamic shared memory on the current
/// device (above 48 KiB a kernel must opt in). Done once per (kernel,
/// device) and size; `bytes` must be within dynamic_shared_limit(kernel).
void allow_dynamic_shared(const void* kernel, size_t bytes);

}  // namespace ddp::cuda
