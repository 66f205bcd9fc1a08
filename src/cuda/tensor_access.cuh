// Host-side helpers the CUDA kernel files share: a tensor's data as a typed
// pointer (for element types, such as __nv_bfloat16, that data_ptr<T>()
// does not know), and the 16-byte alignment the vectorised loads need.
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

}  // namespace ddp::cuda
