// Cross-entropy over [N, V] logits: one block per row, forward and backward.
//
// Forward: each thread keeps a running (max m, sum s of exp(x - m)) over its
// share of the row and rescales s when the max grows (the "online softmax":
// one pass instead of a max pass and a sum pass); the block then merges the
// threads' pairs, and thread 0 writes lse = m + log(s) and the row's loss
// lse - x[target]. A second, one-block kernel sums the N row losses in
// double in a fixed order (no atomics, so the loss is deterministic) and
// divides by the number of targets not ignored, read on the device: nothing
// waits on the host, so a CUDA graph can capture it.
//
// Backward: dx[j] = (exp(x[j] - lse) - [j == target]) * g, g = the loss's
// gradient / count (or / 1 for a sum), also read on the device (fp16 loss
// scaling multiplies it). Each element is read and then written by the same
// thread, so the gradient may go over the logits in place.
//
// Rows are read 16 bytes at a time. A row of V elements need not start on a
// 16-byte boundary (V = 7 bf16 rows start every 14 bytes), so each row is
// split into an unaligned head read element by element, the aligned 16-byte
// vectors, and a tail.
#include "ddp/cuda/cross_entropy.h"
#include "tensor_access.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace ddp::cuda {
namespace {

constexpr int kMaxThreads = 512;  // per row: V = 50304 bf16 is 6288 vectors, ~12 per thread
constexpr int kUnroll = 4;        // vectors in flight per thread

template <typename T>
constexpr int kPerVec = 16 / static_cast<int>(sizeof(T));  // elements in 16 bytes

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// One 16-byte vector to and from fp32. (The element-wise conversions; the
// kernels are bound by memory, not by these.)
template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float* f) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int k = 0; k < kPerVec<T>; ++k) f[k] = to_float(e[k]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int k = 0; k < kPerVec<T>; ++k) e[k] = from_float<T>(f[k]);
  return v;
}

// A row as [head elements][vecs 16-byte vectors][tail elements]. The head
// runs up to the first 16-byte boundary; with vectorize false (the input
// and output rows are aligned differently), the whole row is "head".
struct RowSplit {
  int64_t head, vecs;
};

template <typename T>
__device__ __forceinline__ RowSplit split_row(const T* row, int64_t V, bool vectorize) {
  if (!vectorize) return {V, 0};
  const auto misalign = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(row) % 16);
  int64_t head = misalign == 0 ? 0 : (16 - misalign) / static_cast<int64_t>(sizeof(T));
  if (head > V) head = V;
  return {head, (V - head) / kPerVec<T>};
}

// Running max and sum of exp(x - max).
struct MaxSum {
  float m = -INFINITY, s = 0.f;

  // Adds n values whose max is vmax.
  __device__ __forceinline__ void add(const float* x, int n, float vmax) {
    if (vmax > m) {
      s *= __expf(m - vmax);  // exp(-inf) = 0 on the first finite value
      m = vmax;
    }
    if (m == -INFINITY) return;  // everything so far is -inf: exp(-inf - -inf) would be NaN
    for (int k = 0; k < n; ++k) s += __expf(x[k] - m);
  }

  __device__ __forceinline__ void add(float x) { add(&x, 1, x); }

  __device__ __forceinline__ void merge(float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
  }
};

// Merges every thread's (m, s) into thread 0's. blockDim.x is a multiple of
// 32 and at most 1024.
__device__ __forceinline__ MaxSum block_merge(MaxSum a) {
  __shared__ float sm[32], ss[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a.merge(__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    sm[warp] = a.m;
    ss[warp] = a.s;
  }
  __syncthreads();
  if (warp == 0) {
    MaxSum b;
    if (lane < warps) {
      b.m = sm[lane];
      b.s = ss[lane];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      b.merge(__shfl_xor_sync(0xffffffffu, b.m, o), __shfl_xor_sync(0xffffffffu, b.s, o));
    a = b;
  }
  return a;
}

// This thread's share of a row's running max and sum of exp: the head
// element by element, the 16-byte vectors kUnroll at a time, the tail. With
// kStage, each value read is also copied to `stage`, shared memory laid out
// as the row (stage[j] holds row[j], at the same offset from a 16-byte
// boundary), so that the vectors can be stored as they were read.
template <typename T, bool kStage>
__device__ __forceinline__ MaxSum thread_max_sum(const T* row, RowSplit split, int64_t V, T* stage) {
  constexpr int kN = kPerVec<T>;
  const int64_t step = blockDim.x;
  MaxSum acc;
  auto element = [&](int64_t j) {
    const T x = row[j];
    if constexpr (kStage) stage[j] = x;
    acc.add(to_float(x));
  };
  auto vector = [&](const uint4& raw, int64_t v) {
    if constexpr (kStage) reinterpret_cast<uint4*>(stage + split.head)[v] = raw;
    float f[kN];
    unpack<T>(raw, f);
    float vmax = f[0];
#pragma unroll
    for (int k = 1; k < kN; ++k) vmax = fmaxf(vmax, f[k]);
    acc.add(f, kN, vmax);
  };
  for (int64_t j = threadIdx.x; j < split.head; j += step) element(j);
  const auto* vec = reinterpret_cast<const uint4*>(row + split.head);
  int64_t v = threadIdx.x;
  for (; v + (kUnroll - 1) * step < split.vecs; v += kUnroll * step) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = vec[v + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) vector(raw[u], v + u * step);
  }
  for (; v < split.vecs; v += step) vector(vec[v], v);
  for (int64_t j = split.head + split.vecs * kN + threadIdx.x; j < V; j += step) element(j);
  return acc;
}

// Writes this thread's share of a row's gradient, out[j] = (exp(in[j] - l)
// - [j == t]) * g, reading `in` (the row in global memory, or its staged
// copy in shared memory: either way at `split`'s alignment); an ignored
// row's gradient is 0 and its input is not read. `in` may be `out` itself.
template <typename T>
__device__ __forceinline__ void row_gradient(const T* in, T* out, RowSplit split, int64_t V, int64_t t, bool ignored,
                                             float l, float g) {
  constexpr int kN = kPerVec<T>;
  const int64_t step = blockDim.x;
  auto d = [&](float x, int64_t j) { return (__expf(x - l) - (j == t ? 1.f : 0.f)) * g; };
  auto element = [&](int64_t j) { out[j] = from_float<T>(ignored ? 0.f : d(to_float(in[j]), j)); };
  const auto* vin = reinterpret_cast<const uint4*>(in + split.head);
  auto* vout = reinterpret_cast<uint4*>(out + split.head);
  auto one = [&](const uint4& raw, int64_t v) {
    float f[kN];
    unpack<T>(raw, f);
    const int64_t j0 = split.head + v * kN;
#pragma unroll
    for (int k = 0; k < kN; ++k) f[k] = ignored ? 0.f : d(f[k], j0 + k);
    vout[v] = pack<T>(f);
  };
  for (int64_t j = threadIdx.x; j < split.head; j += step) element(j);
  int64_t v = threadIdx.x;
  if (!ignored) {
    for (; v + (kUnroll - 1) * step < split.vecs; v += kUnroll * step) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) raw[u] = vin[v + u * step];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) one(raw[u], v + u * step);
    }
  }
  for (; v < split.vecs; v += step) one(ignored ? uint4{0, 0, 0, 0} : vin[v], v);
  for (int64_t j = split.head + split.vecs * kN + threadIdx.x; j < V; j += step) element(j);
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t V,
                               int64_t ignore_index, bool vectorize, float* __restrict__ lse,
                               float* __restrict__ row_loss) {
  const int64_t i = blockIdx.x;
  const T* row = logits + i * V;
  MaxSum acc = block_merge(thread_max_sum<T, false>(row, split_row(row, V, vectorize), V, nullptr));
  if (threadIdx.x != 0) return;
  const float l = acc.m + logf(acc.s);
  const int64_t t = targets[i];
  float loss = 0.f;
  if (t != ignore_index) {
    CUDA_KERNEL_ASSERT(t >= 0 && t < V);
    loss = l - to_float(row[t]);
  }
  lse[i] = l;
  row_loss[i] = loss;
}

// The forward and the backward for an incoming gradient of 1 in one pass
// over the logits: the row is read once into shared memory while its max
// and sum of exp accumulate (the same order as forward_kernel, so the same
// lse to the bit), then the gradient is computed from the shared copy and
// written over the row. `count` (the rows not ignored) is already known
// (count_kernel), so a mean's 1/count is applied here too. An ignored row is
// not read: its loss and gradient are 0.
template <typename T>
__global__ void one_pass_kernel(T* logits, const int64_t* __restrict__ targets, int64_t V, int64_t ignore_index,
                                const float* __restrict__ count, bool sum, float* __restrict__ row_loss) {
  extern __shared__ uint4 stage_raw[];
  __shared__ float row_lse;
  const int64_t i = blockIdx.x;
  T* row = logits + i * V;
  const int64_t t = targets[i];
  const bool ignored = t == ignore_index;  // the same for the whole block
  const auto split = split_row(row, V, true);
  // stage[j] sits at row[j]'s offset from a 16-byte boundary.
  T* stage = reinterpret_cast<T*>(stage_raw) + (reinterpret_cast<std::uintptr_t>(row) % 16) / sizeof(T);
  float l = 0.f;
  if (!ignored) {
    const MaxSum acc = block_merge(thread_max_sum<T, true>(row, split, V, stage));
    if (threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT(t >= 0 && t < V);
      row_lse = acc.m + logf(acc.s);
      row_loss[i] = row_lse - to_float(stage[t]);
    }
    __syncthreads();
    l = row_lse;
  } else if (threadIdx.x == 0) {
    row_loss[i] = 0.f;
  }
  row_gradient<T>(stage, row, split, V, t, ignored, l, sum ? 1.f : 1.f / *count);
}

// One block: count = the targets not ignored, for one_pass_kernel's mean.
__global__ void count_kernel(const int64_t* __restrict__ targets, int64_t N, int64_t ignore_index,
                             float* __restrict__ count) {
  __shared__ int64_t sc[32];
  int64_t c = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) c += targets[i] != ignore_index ? 1 : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sc[warp] = c;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) c += sc[w];
  *count = static_cast<float>(c);
}

// One block: loss = sum of the row losses (/ count unless sum), count = the
// rows not ignored. In double, each thread over a fixed stride of rows, then
// a fixed tree: the same bits on every run.
__global__ void reduce_kernel(const float* __restrict__ row_loss, const int64_t* __restrict__ targets, int64_t N,
                              int64_t ignore_index, bool sum, float* __restrict__ loss, float* __restrict__ count) {
  __shared__ double sl[32], sc[32];
  double l = 0, c = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    l += row_loss[i];
    c += targets[i] != ignore_index ? 1.0 : 0.0;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    l += __shfl_xor_sync(0xffffffffu, l, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sl[warp] = l;
    sc[warp] = c;
  }
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x / 32;
  l = lane < warps ? sl[lane] : 0.0;
  c = lane < warps ? sc[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    l += __shfl_xor_sync(0xffffffffu, l, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
  if (lane == 0) {
    *count = static_cast<float>(c);
    *loss = static_cast<float>(sum ? l : l / c);  // 0/0 = NaN when every target is ignored, as PyTorch
  }
}

// dlogits may be logits itself (in place): no __restrict__ on either.
template <typename T>
__global__ void backward_kernel(const T* logits, T* dlogits, const int64_t* __restrict__ targets,
                                const float* __restrict__ lse, const float* __restrict__ grad,
                                const float* __restrict__ count, bool sum, int64_t V, int64_t ignore_index,
                                bool vectorize) {
  const int64_t i = blockIdx.x;
  const T* in = logits + i * V;
  const int64_t t = targets[i];
  const bool ignored = t == ignore_index;
  // An ignored row's gradient is 0 (its logits need not be read).
  const float g = ignored ? 0.f : (sum ? *grad : *grad / *count);
  row_gradient<T>(in, dlogits + i * V, split_row(in, V, vectorize), V, t, ignored, ignored ? 0.f : lse[i], g);
}

// x *= *grad over n elements, unless *grad is exactly 1 (the usual case:
// nothing scales the loss), when every block returns at once: the one-pass
// gradient is then final as written. Read on the device, so a CUDA graph
// replays either case.
template <typename T>
__global__ void scale_kernel(T* x, int64_t head, int64_t vecs, int64_t n, const float* __restrict__ grad) {
  constexpr int kN = kPerVec<T>;
  const float g = *grad;
  if (g == 1.f) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t j = first; j < head; j += stride) x[j] = from_float<T>(to_float(x[j]) * g);
  auto* vec = reinterpret_cast<uint4*>(x + head);
  for (int64_t v = first; v < vecs; v += stride) {
    float f[kN];
    unpack<T>(vec[v], f);
#pragma unroll
    for (int k = 0; k < kN; ++k) f[k] *= g;
    vec[v] = pack<T>(f);
  }
  for (int64_t j = head + vecs * kN + first; j < n; j += stride) x[j] = from_float<T>(to_float(x[j]) * g);
}

int threads_for(int64_t V, int64_t elem_size) {
  const int64_t vecs = (V * elem_size + 15) / 16;
  return static_cast<int>(std::clamp<int64_t>((vecs + 31) / 32 * 32, 32, kMaxThreads));
}

std::uintptr_t misalignment(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16; }

template <typename T>
void launch_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const at::Tensor& lse,
                    const at::Tensor& row_loss, cudaStream_t stream) {
  const int64_t N = logits.size(0), V = logits.size(1);
  forward_kernel<T><<<static_cast<unsigned>(N), threads_for(V, sizeof(T)), 0, stream>>>(
      as<T>(logits), as<int64_t>(targets), V, ignore_index, true, as_mut<float>(lse), as_mut<float>(row_loss));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_backward(const at::Tensor& logits, const at::Tensor& dlogits, const at::Tensor& targets,
                     const at::Tensor& lse, const at::Tensor& grad, const at::Tensor& count, bool sum,
                     int64_t ignore_index, cudaStream_t stream) {
  const int64_t N = logits.size(0), V = logits.size(1);
  // The head/vector split is computed on the input row; the output row must
  // sit at the same offset from a 16-byte boundary (always so in place).
  const bool vectorize = misalignment(logits) == misalignment(dlogits);
  backward_kernel<T><<<static_cast<unsigned>(N), threads_for(V, sizeof(T)), 0, stream>>>(
      as<T>(logits), as_mut<T>(dlogits), as<int64_t>(targets), as<float>(lse), as<float>(grad), as<float>(count),
      sum, V, ignore_index, vectorize);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One-pass: the shared-memory copy of a row (one 16-byte vector more, for
// the row's offset from a 16-byte boundary), and whether a block may have it.
template <typename T>
size_t stage_bytes(int64_t V) {
  return static_cast<size_t>((V * static_cast<int64_t>(sizeof(T)) + 31) / 16 * 16);
}

template <typename T>
bool one_pass_fits(int64_t V) {
  return stage_bytes<T>(V) <= dynamic_shared_limit(reinterpret_cast<const void*>(one_pass_kernel<T>));
}

template <typename T>
void launch_one_pass(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                     const at::Tensor& count, bool sum, const at::Tensor& row_loss, cudaStream_t stream) {
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto kernel = one_pass_kernel<T>;
  const size_t shared = stage_bytes<T>(V);
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), shared);
  kernel<<<static_cast<unsigned>(N), threads_for(V, sizeof(T)), shared, stream>>>(
      as_mut<T>(logits), as<int64_t>(targets), V, ignore_index, as<float>(count), sum, as_mut<float>(row_loss));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_scale(const at::Tensor& x, const at::Tensor& grad, cudaStream_t stream) {
  constexpr int64_t kN = kPerVec<T>;
  const int64_t n = x.numel();
  const int64_t head = std::min<int64_t>(n, (16 - static_cast<int64_t>(misalignment(x))) % 16 / sizeof(T));
  const int64_t vecs = (n - head) / kN;
  constexpr int kThreads = 256;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // A grid-stride loop; the head and tail (under 16 bytes each) go to the first threads.
  const auto blocks = static_cast<unsigned>(std::clamp<int64_t>((vecs + kThreads - 1) / kThreads, 1, 4 * sms));
  scale_kernel<T><<<blocks, kThreads, 0, stream>>>(as_mut<T>(x), head, vecs, n, as<float>(grad));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Both forwards' fp32 outputs: the per-row losses, the loss, the count of
// targets.
std::tuple<at::Tensor, at::Tensor, at::Tensor> loss_buffers(const at::Tensor& logits) {
  const auto f32 = logits.options().dtype(at::kFloat);
  return {at::empty({logits.size(0)}, f32), at::empty({}, f32), at::empty({}, f32)};
}

}  // namespace

bool cross_entropy_supported(const at::Tensor& logits, const at::Tensor& targets) {
  const auto dt = logits.defined() ? logits.scalar_type() : at::kFloat;
  return logits.defined() && targets.defined() && logits.is_cuda() && logits.dim() == 2 &&
         (dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat) && logits.is_contiguous() &&
         logits.size(0) >= 1 && logits.size(0) <= std::numeric_limits<int32_t>::max() && logits.size(1) >= 1 &&
         targets.device() == logits.device() && targets.scalar_type() == at::kLong && targets.dim() == 1 &&
         targets.size(0) == logits.size(0);
}

std::vector<at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets_in, bool sum,
                                              int64_t ignore_index) {
  TORCH_CHECK(cross_entropy_supported(logits, targets_in), "cross_entropy_forward: unsupported logits ",
              logits.sizes(), " ", logits.scalar_type(), " or targets ", targets_in.sizes(), " ",
              targets_in.scalar_type());
  c10::cuda::CUDAGuard guard(logits.device());
  const auto targets = targets_in.contiguous();
  const int64_t N = logits.size(0);
  auto [row_loss, loss, count] = loss_buffers(logits);
  auto lse = at::empty_like(row_loss);
  auto stream = at::cuda::getCurrentCUDAStream();
  switch (logits.scalar_type()) {
    case at::kBFloat16: launch_forward<__nv_bfloat16>(logits, targets, ignore_index, lse, row_loss, stream); break;
    case at::kHalf: launch_forward<__half>(logits, targets, ignore_index, lse, row_loss, stream); break;
    default: launch_forward<float>(logits, targets, ignore_index, lse, row_loss, stream); break;
  }
  reduce_kernel<<<1, 1024, 0, stream>>>(as<float>(row_loss), as<int64_t>(targets), N, ignore_index, sum,
                                        as_mut<float>(loss), as_mut<float>(count));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, lse, count};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad_in, const at::Tensor& logits, const at::Tensor& targets_in,
                                  const at::Tensor& lse, const at::Tensor& count, bool sum, bool in_place,
                                  int64_t ignore_index) {
  TORCH_CHECK(cross_entropy_supported(logits, targets_in), "cross_entropy_backward: unsupported logits ",
              logits.sizes(), " ", logits.scalar_type());
  const int64_t N = logits.size(0);
  TORCH_CHECK(grad_in.defined() && grad_in.numel() == 1 && grad_in.device() == logits.device(),
              "cross_entropy_backward: the loss's gradient must be one element on ", logits.device());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == N &&
                  lse.device() == logits.device() && count.scalar_type() == at::kFloat && count.numel() == 1 &&
                  count.device() == logits.device(),
              "cross_entropy_backward: lse and count must be the forward's");
  c10::cuda::CUDAGuard guard(logits.device());
  const auto targets = targets_in.contiguous();
  const auto grad = grad_in.to(at::kFloat).contiguous();
  auto dlogits = in_place ? logits : at::empty({N, logits.size(1)}, logits.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  switch (logits.scalar_type()) {
    case at::kBFloat16:
      launch_backward<__nv_bfloat16>(logits, dlogits, targets, lse, grad, count, sum, ignore_index, stream);
      break;
    case at::kHalf: launch_backward<__half>(logits, dlogits, targets, lse, grad, count, sum, ignore_index, stream); break;
    default: launch_backward<float>(logits, dlogits, targets, lse, grad, count, sum, ignore_index, stream); break;
  }
  return dlogits;
}

bool cross_entropy_one_pass_supported(const at::Tensor& logits, const at::Tensor& targets) {
  if (!cross_entropy_supported(logits, targets)) return false;
  c10::cuda::CUDAGuard guard(logits.device());
  switch (logits.scalar_type()) {
    case at::kBFloat16: return one_pass_fits<__nv_bfloat16>(logits.size(1));
    case at::kFloat: return one_pass_fits<float>(logits.size(1));
    default: return false;  // fp16: see the header
  }
}

std::vector<at::Tensor> cross_entropy_one_pass(const at::Tensor& logits, const at::Tensor& targets_in, bool sum,
                                               int64_t ignore_index) {
  TORCH_CHECK(cross_entropy_one_pass_supported(logits, targets_in), "cross_entropy_one_pass: unsupported logits ",
              logits.sizes(), " ", logits.scalar_type(), " or targets ", targets_in.sizes(), " ",
              targets_in.scalar_type());
  c10::cuda::CUDAGuard guard(logits.device());
  const auto targets = targets_in.contiguous();
  const int64_t N = logits.size(0);
  auto [row_loss, loss, count] = loss_buffers(logits);
  auto stream = at::cuda::getCurrentCUDAStream();
  count_kernel<<<1, 1024, 0, stream>>>(as<int64_t>(targets), N, ignore_index, as_mut<float>(count));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (logits.scalar_type() == at::kBFloat16)
    launch_one_pass<__nv_bfloat16>(logits, targets, ignore_index, count, sum, row_loss, stream);
  else
    launch_one_pass<float>(logits, targets, ignore_index, count, sum, row_loss, stream);
  // The loss as the two-pass forward sums it (it counts the targets again:
  // the same number, and a few microseconds).
  reduce_kernel<<<1, 1024, 0, stream>>>(as<float>(row_loss), as<int64_t>(targets), N, ignore_index, sum,
                                        as_mut<float>(loss), as_mut<float>(count));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, count};
}

void scale_unless_one(const at::Tensor& grad_in, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "scale_unless_one: x must be contiguous CUDA bf16 or fp32, not ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(grad_in.defined() && grad_in.numel() == 1 && grad_in.device() == x.device(),
              "scale_unless_one: the gradient must be one element on ", x.device());
  if (x.numel() == 0) return;
  c10::cuda::CUDAGuard guard(x.device());
  const auto grad = grad_in.to(at::kFloat).contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kBFloat16)
    launch_scale<__nv_bfloat16>(x, grad, stream);
  else
    launch_scale<float>(x, grad, stream);
}

}  // namespace ddp::cuda
