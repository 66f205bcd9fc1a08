// resident_blocks_per_sm (tensor_access.cuh): the occupancy question the
// kernel launchers ask, answered by the CUDA runtime once and remembered.
#include "tensor_access.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

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

}  // namespace ddp::cuda
