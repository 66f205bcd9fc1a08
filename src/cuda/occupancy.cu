// resident_blocks_per_sm, dynamic_shared_limit and allow_dynamic_shared
// (tensor_access.cuh): what the kernel launchers ask of the CUDA runtime
// about occupancy and shared memory, asked once and remembered.
#include "tensor_access.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace ddp::cuda {

int resident_blocks_per_sm(const void* kernel, int threads, size_t shared) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t, int>, int> known;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(kernel, threads, shared, device);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared));
  known.emplace(key, per_sm);
  return per_sm;
}

size_t dynamic_shared_limit(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> known;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_pair(kernel, device);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t limit = static_cast<size_t>(optin) > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  known.emplace(key, limit);
  return limit;
}

void allow_dynamic_shared(const void* kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;  // the most set so far
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  size_t& now = allowed[std::make_pair(kernel, device)];
  if (bytes <= now) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  now = bytes;
}

}  // namespace ddp::cuda
