// An embedding's weight gradient, added into a given tensor (embedding.h).
//
// The indices are sorted (stably, keeping each row's position), so the rows
// that share an index sit together, in their original order: a run. Two
// passes keep the work per warp bounded however long a run is (a frequent
// token, or one id for a whole batch):
//   1. Warp k takes the sorted positions [32k, 32k + 32): a chunk (and a
//      slice of the columns, see pieces_kernel). Each piece of a run inside
//      it is summed, in order. A piece that is a whole run is added to its
//      table row at once; a run's first piece that goes on past the chunk
//      goes to first_part[k], and the piece that continues a run from the
//      chunk before goes to next_part[k].
//   2. A block per run that crosses a chunk boundary adds its first piece
//      and its continuations, in chunk order, and adds that to its row.
// Every row has one writer and a fixed order of sums: deterministic.
// Lanes own groups of four adjacent columns (16-byte loads where C is a
// multiple of 4 and the tensors are aligned; one column at a time else).
#include "ddp/cuda/embedding.h"
#include "tensor_access.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

namespace ddp::cuda {
namespace {

constexpr int kChunk = 32;         // sorted positions per warp in pass 1
constexpr int kWarps = 8;          // warps per block in pass 1
constexpr int kCrossThreads = 256;  // threads per block in pass 2

// Warp k takes chunk k's sorted positions and one slice of 32 x kVec
// columns (blockIdx.y), each lane kVec adjacent columns. The chunk's sorted
// indices and source rows are read once, a position per lane, and handed
// round by shuffles, so the loads of a run's rows do not wait on each other.
// (Session 26: one warp for all of a chunk's columns left 4 warps an SM
// for GPT-2's 16,384 tokens, 0.20 ms a step on an H100.)
template <int kVec>
__global__ void pieces_kernel(const float* __restrict__ grad, const int64_t* __restrict__ sorted,
                              const int64_t* __restrict__ order, int64_t n, int64_t c, float* __restrict__ dw,
                              float* __restrict__ first_part, float* __restrict__ next_part) {
  constexpr unsigned kAll = 0xffffffffu;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t begin = chunk * kChunk;
  if (begin >= n) return;  // the whole warp
  const int len = static_cast<int>(begin + kChunk < n ? kChunk : n - begin);
  const long long my_row = lane < len ? sorted[begin + lane] : 0;
  const long long my_src = lane < len ? order[begin + lane] : 0;
  const bool has_before = begin > 0, has_after = begin + len < n;
  const int64_t before = has_before ? sorted[begin - 1] : 0, after = has_after ? sorted[begin + len] : 0;
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * 32 + lane) * kVec;
  const bool mine = col < c;
  for (int p = 0; p < len;) {
    const int64_t row = __shfl_sync(kAll, my_row, p);
    int q = p + 1;
    while (q < len && __shfl_sync(kAll, my_row, q) == row) ++q;
    float acc[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
#pragma unroll 4
    for (int j = p; j < q; ++j) {
      const int64_t src = __shfl_sync(kAll, my_src, j);
      if (!mine) continue;
      if constexpr (kVec == 4) {
        const float4 g = *reinterpret_cast<const float4*>(grad + src * c + col);
        acc[0] += g.x, acc[1] += g.y, acc[2] += g.z, acc[3] += g.w;
      } else {
        acc[0] += grad[src * c + col];
      }
    }
    const bool continues = p == 0 && has_before && before == row;   // from the chunk before
    const bool goes_on = q == len && has_after && after == row;      // into the chunk after
    if (mine) {
      float* out = continues ? next_part + chunk * c : goes_on ? first_part + chunk * c : dw + row * c;
      const bool add = !continues && !goes_on;
      if constexpr (kVec == 4) {
        float4* o = reinterpret_cast<float4*>(out + col);
        float4 d = add ? *o : make_float4(0.f, 0.f, 0.f, 0.f);
        d.x += acc[0], d.y += acc[1], d.z += acc[2], d.w += acc[3];
        *o = d;
      } else {
        out[col] = add ? out[col] + acc[0] : acc[0];
      }
    }
    p = q;
  }
}

// Block per sorted position p: if a run starts at p and goes past its
// chunk, its first piece plus the continuations of the chunks after.
template <int kVec>
__global__ void crossing_runs_kernel(const int64_t* __restrict__ sorted, int64_t n, int64_t c,
                                     const float* __restrict__ first_part, const float* __restrict__ next_part,
                                     float* __restrict__ dw) {
  const int64_t p = blockIdx.x;
  const int64_t row = sorted[p];
  if (p > 0 && sorted[p - 1] == row) return;  // not a run's start
  const int64_t chunk = p / kChunk, chunks = (n + kChunk - 1) / kChunk;
  if (chunk + 1 >= chunks || sorted[(chunk + 1) * kChunk] != row) return;  // a whole run: pass 1 added it
  for (int64_t col = int64_t{threadIdx.x} * kVec; col < c; col += int64_t{blockDim.x} * kVec) {
    float acc[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = first_part[chunk * c + col + k];
    for (int64_t next = chunk + 1; next < chunks && sorted[next * kChunk] == row; ++next)
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] += next_part[next * c + col + k];
#pragma unroll
    for (int k = 0; k < kVec; ++k) dw[row * c + col + k] += acc[k];
  }
}

}  // namespace


void embedding_backward_add(const at::Tensor& grad, const at::Tensor& idx, const at::Tensor& dw) {
  TORCH_CHECK(grad.is_cuda() && grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.is_contiguous(),
              "embedding_backward_add: grad must be a contiguous CUDA fp32 [N, C] tensor, got ", grad.sizes(), " ",
              grad.scalar_type());
  TORCH_CHECK(dw.is_cuda() && dw.get_device() == grad.get_device() && dw.scalar_type() == at::kFloat && dw.dim() == 2 &&
                  dw.is_contiguous() && dw.size(1) == grad.size(1),
              "embedding_backward_add: dw must be a contiguous CUDA fp32 [V, ", grad.size(1),
              "] tensor on grad's device, got ", dw.sizes(), " ", dw.scalar_type());
  TORCH_CHECK(idx.is_cuda() && idx.get_device() == grad.get_device() && idx.scalar_type() == at::kLong &&
                  idx.numel() == grad.size(0),
              "embedding_backward_add: idx must be ", grad.size(0), " CUDA int64 indices on grad's device, got ",
              idx.sizes(), " ", idx.scalar_type());
  const int64_t n = grad.size(0), c = grad.size(1);
  if (n == 0 || c == 0) return;
  c10::cuda::CUDAGuard guard(grad.device());
  const auto by_index = at::sort(idx.reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& sorted = std::get<0>(by_index);
  const at::Tensor& order = std::get<1>(by_index);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  // Two partial rows per chunk at most: its first piece (continuing a run)
  // and its last (going on). Uninitialised: only the pieces written are read.
  auto first_part = at::empty({chunks, c}, grad.options());
  auto next_part = at::empty({chunks, c}, grad.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool vec4 = c % 4 == 0 && aligned(grad) && aligned(dw);
  auto launch = [&](auto kvec) {
    constexpr int kVec = decltype(kvec)::value;
    const int64_t slices = (c + 32 * kVec - 1) / (32 * kVec);
    TORCH_CHECK(slices <= 65535, "embedding_backward_add: ", c, " columns are more than a grid's 65,535 slices of ",
                32 * kVec, "; split the table's columns");
    pieces_kernel<kVec><<<dim3(static_cast<unsigned>((chunks + kWarps - 1) / kWarps), static_cast<unsigned>(slices)),
                          kWarps * 32, 0, stream>>>(
        as<float>(grad), as<int64_t>(sorted), as<int64_t>(order), n, c, as_mut<float>(dw), as_mut<float>(first_part),
        as_mut<float>(next_part));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (chunks < 2) return;  // no run can cross a chunk boundary
    crossing_runs_kernel<kVec><<<static_cast<unsigned>(n), kCrossThreads, 0, stream>>>(
        as<int64_t>(sorted), n, c, as<float>(first_part), as<float>(next_part), as_mut<float>(dw));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vec4) launch(std::integral_constant<int, 4>{});
  else launch(std::integral_constant<int, 1>{});
}

}  // namespace ddp::cuda
