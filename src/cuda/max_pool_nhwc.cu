// Channels-last max pooling with uint8 argmax offsets; see the header for
// the semantics (ATen's, bit for bit) and why.
//
// Layout: x is an [N, H, W, C] row-major array (channels-last), and each
// thread owns one 16-byte vector of channels (8 bf16 or 4 fp32) of one
// output pixel (forward) or one input pixel (backward). Neighbouring
// threads take neighbouring channel vectors, so a warp's loads are
// contiguous 512-byte runs. The argmax array has y's layout, one byte per
// element, so a thread's offsets are one 8-byte (bf16) or 4-byte load.
#include "ddp/cuda/max_pool_nhwc.h"
#include "tensor_access.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace ddp::cuda {
namespace {

constexpr int kThreads = 256;
// The argmax of a window in which nothing beat the initial -inf and that
// does not hold the plane's element (0, 0): matches no input element.
constexpr uint8_t kNowhere = 255;

template <typename T>
struct Traits;
template <>
struct Traits<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ __nv_bfloat16 neg_inf() { return __ushort_as_bfloat16(0xFF80); }
};
template <>
struct Traits<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
  static __device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7F800000); }
};

// One 16-byte vector of T, and the matching argmax bytes.
template <typename T>
struct alignas(16) Vec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};
template <typename T>
struct alignas(Vec<T>::n) Codes {
  uint8_t c[Vec<T>::n];
};

// K > 0: the kernel size known at compile time (the loops unroll); K == 0:
// the runtime k.
template <typename T, int K>
__global__ void max_pool_forward_kernel(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ argmax,
                                        int64_t total, int cv, int H, int W, int OH, int OW, int k_rt, int s, int p) {
  using Tr = Traits<T>;
  constexpr int V = Vec<T>::n;
  const int k = K > 0 ? K : k_rt;
  const int64_t C = static_cast<int64_t>(cv) * V;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c0 = static_cast<int>(i % cv) * V;
    int64_t pix = i / cv;
    const int ow = static_cast<int>(pix % OW);
    pix /= OW;
    const int oh = static_cast<int>(pix % OH);
    const int64_t n = pix / OH;
    const int h0 = oh * s - p, w0 = ow * s - p;  // the padded window's corner
    // ATen's channels-last kernel starts every window at index 0 (the
    // plane's first element) and -inf, and moves only for a value above
    // the best so far or a NaN. Index 0 is an offset here only if the
    // window holds (0, 0); with padding <= kernel / 2 that is h0, w0 <= 0.
    const uint8_t init = (h0 <= 0 && w0 <= 0) ? static_cast<uint8_t>(-h0 * k - w0) : kNowhere;
    Vec<T> best;
    Codes<T> code;
    float bf[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      best.v[e] = Tr::neg_inf();
      bf[e] = -__int_as_float(0x7F800000);
      code.c[e] = init;
    }
    const T* base = x + n * H * W * C + c0;
#pragma unroll
    for (int dh = 0; dh < k; ++dh) {
      const int ih = h0 + dh;
      if (ih < 0 || ih >= H) continue;
#pragma unroll
      for (int dw = 0; dw < k; ++dw) {
        const int iw = w0 + dw;
        if (iw < 0 || iw >= W) continue;
        const Vec<T> v = *reinterpret_cast<const Vec<T>*>(base + (static_cast<int64_t>(ih) * W + iw) * C);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float f = Tr::to_float(v.v[e]);
          // Strictly greater: the first maximum in scan order wins a tie.
          // A NaN always takes over (ATen's _isnan), so the last NaN wins.
          if (f > bf[e] || isnan(f)) {
            bf[e] = f;
            best.v[e] = v.v[e];  // the input's own bits (NaN payloads too)
            code.c[e] = static_cast<uint8_t>(dh * k + dw);
          }
        }
      }
    }
    const int64_t o = i * V;  // y and argmax share the [N, OH, OW, C] layout
    *reinterpret_cast<Vec<T>*>(y + o) = best;
    *reinterpret_cast<Codes<T>*>(argmax + o) = code;
  }
}

// First output row (or column) whose window holds input row h: ATen's
// p_start; one past the last: p_end.
__device__ __forceinline__ int first_cover(int h, int p, int k, int s) { return h + p < k ? 0 : (h + p - k) / s + 1; }
__device__ __forceinline__ int end_cover(int h, int p, int s, int out) { return min((h + p) / s + 1, out); }

template <typename T, int K>
__global__ void max_pool_backward_kernel(const T* __restrict__ dy, const uint8_t* __restrict__ argmax,
                                         T* __restrict__ dx, int64_t total, int cv, int H, int W, int OH, int OW,
                                         int k_rt, int s, int p) {
  using Tr = Traits<T>;
  constexpr int V = Vec<T>::n;
  const int k = K > 0 ? K : k_rt;
  const int64_t C = static_cast<int64_t>(cv) * V;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c0 = static_cast<int>(i % cv) * V;
    int64_t pix = i / cv;
    const int w = static_cast<int>(pix % W);
    pix /= W;
    const int h = static_cast<int>(pix % H);
    const int64_t n = pix / H;
    const int ph0 = first_cover(h, p, k, s), ph1 = end_cover(h, p, s, OH);
    const int pw0 = first_cover(w, p, k, s), pw1 = end_cover(w, p, s, OW);
    const int64_t plane = n * OH * OW;
    Vec<T> out;
    if (ph1 - ph0 == 1 && pw1 - pw0 == 1) {
      // One window holds this element: its gradient or zero, copied as is
      // (ATen does the same, without an fp32 round trip).
      const int64_t o = (plane + static_cast<int64_t>(ph0) * OW + pw0) * C + c0;
      const Vec<T> g = *reinterpret_cast<const Vec<T>*>(dy + o);
      const Codes<T> code = *reinterpret_cast<const Codes<T>*>(argmax + o);
      const int want = (h - (ph0 * s - p)) * k + (w - (pw0 * s - p));
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = code.c[e] == want ? g.v[e] : Tr::from_float(0.f);
    } else {
      // Several (or none): an fp32 sum from +0 in ATen's order, output rows
      // then columns, so the rounding matches too.
      float acc[V];
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = 0.f;
      for (int oh = ph0; oh < ph1; ++oh)
        for (int ow = pw0; ow < pw1; ++ow) {
          const int64_t o = (plane + static_cast<int64_t>(oh) * OW + ow) * C + c0;
          const int want = (h - (oh * s - p)) * k + (w - (ow * s - p));
          const Codes<T> code = *reinterpret_cast<const Codes<T>*>(argmax + o);
          const Vec<T> g = *reinterpret_cast<const Vec<T>*>(dy + o);
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (code.c[e] == want) acc[e] += Tr::to_float(g.v[e]);
        }
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = Tr::from_float(acc[e]);
    }
    *reinterpret_cast<Vec<T>*>(dx + i * V) = out;
  }
}

int grid_for(int64_t total) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, sms * 32)));
}

int64_t vec_elems(at::ScalarType t) { return t == at::kBFloat16 ? 8 : 4; }

int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p) { return (in + 2 * p - k) / s + 1; }

template <typename T>
void launch_forward(const at::Tensor& x, const at::Tensor& y, const at::Tensor& argmax, int k, int s, int p) {
  const int H = static_cast<int>(x.size(2)), W = static_cast<int>(x.size(3));
  const int OH = static_cast<int>(y.size(2)), OW = static_cast<int>(y.size(3));
  const int cv = static_cast<int>(x.size(1) / Vec<T>::n);
  const int64_t total = y.numel() / Vec<T>::n;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (k == 3)
    max_pool_forward_kernel<T, 3><<<grid_for(total), kThreads, 0, stream>>>(
        as<T>(x), as_mut<T>(y), as_mut<uint8_t>(argmax), total, cv, H, W, OH, OW, k, s, p);
  else
    max_pool_forward_kernel<T, 0><<<grid_for(total), kThreads, 0, stream>>>(
        as<T>(x), as_mut<T>(y), as_mut<uint8_t>(argmax), total, cv, H, W, OH, OW, k, s, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_backward(const at::Tensor& dy, const at::Tensor& argmax, const at::Tensor& dx, int k, int s, int p) {
  const int H = static_cast<int>(dx.size(2)), W = static_cast<int>(dx.size(3));
  const int OH = static_cast<int>(dy.size(2)), OW = static_cast<int>(dy.size(3));
  const int cv = static_cast<int>(dx.size(1) / Vec<T>::n);
  const int64_t total = dx.numel() / Vec<T>::n;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (k == 3)
    max_pool_backward_kernel<T, 3><<<grid_for(total), kThreads, 0, stream>>>(
        as<T>(dy), as<uint8_t>(argmax), as_mut<T>(dx), total, cv, H, W, OH, OW, k, s, p);
  else
    max_pool_backward_kernel<T, 0><<<grid_for(total), kThreads, 0, stream>>>(
        as<T>(dy), as<uint8_t>(argmax), as_mut<T>(dx), total, cv, H, W, OH, OW, k, s, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool max_pool_nhwc_supported(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding) {
  if (!x.defined() || !x.is_cuda() || x.dim() != 4) return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  if (kernel < 1 || kernel * kernel > 255 || stride < 1 || padding < 0 || padding > kernel / 2) return false;
  if (x.numel() == 0 || x.size(1) % vec_elems(x.scalar_type()) != 0) return false;
  // int indexing of rows and columns inside the kernels
  if (x.size(2) > (1 << 30) || x.size(3) > (1 << 30)) return false;
  if (out_size(x.size(2), kernel, stride, padding) < 1 || out_size(x.size(3), kernel, stride, padding) < 1)
    return false;
  return x.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned(x);
}

std::vector<at::Tensor> max_pool_nhwc_forward(const at::Tensor& x, int64_t kernel, int64_t stride, int64_t padding) {
  TORCH_CHECK(max_pool_nhwc_supported(x, kernel, stride, padding), "max_pool_nhwc_forward: unsupported input ",
              x.sizes(), " ", x.scalar_type(), " strides ", x.strides(), " (kernel ", kernel, ", stride ", stride,
              ", padding ", padding, ")");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0), C = x.size(1);
  const int64_t OH = out_size(x.size(2), kernel, stride, padding), OW = out_size(x.size(3), kernel, stride, padding);
  auto y = at::empty({N, C, OH, OW}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  auto argmax = at::empty({N, OH, OW, C}, x.options().dtype(at::kByte));
  const int k = static_cast<int>(kernel), s = static_cast<int>(stride), p = static_cast<int>(padding);
  if (x.scalar_type() == at::kBFloat16) launch_forward<__nv_bfloat16>(x, y, argmax, k, s, p);
  else launch_forward<float>(x, y, argmax, k, s, p);
  return {y, argmax};
}

at::Tensor max_pool_nhwc_backward(const at::Tensor& dy_in, const at::Tensor& argmax, int64_t H, int64_t W,
                                  int64_t kernel, int64_t stride, int64_t padding) {
  TORCH_CHECK(dy_in.defined() && dy_in.is_cuda() && dy_in.dim() == 4 &&
                  (dy_in.scalar_type() == at::kBFloat16 || dy_in.scalar_type() == at::kFloat),
              "max_pool_nhwc_backward: dy must be a 4-D bf16 or fp32 CUDA tensor, got ", dy_in.sizes(), " ",
              dy_in.scalar_type());
  const int64_t N = dy_in.size(0), C = dy_in.size(1), OH = dy_in.size(2), OW = dy_in.size(3);
  TORCH_CHECK(kernel >= 1 && kernel * kernel <= 255 && stride >= 1 && padding >= 0 && padding <= kernel / 2 &&
                  out_size(H, kernel, stride, padding) == OH && out_size(W, kernel, stride, padding) == OW &&
                  C % vec_elems(dy_in.scalar_type()) == 0,
              "max_pool_nhwc_backward: dy ", dy_in.sizes(), " is not the output of a ", H, "x", W, " input (kernel ",
              kernel, ", stride ", stride, ", padding ", padding, ")");
  TORCH_CHECK(argmax.defined() && argmax.scalar_type() == at::kByte && argmax.is_contiguous() &&
                  argmax.sizes() == at::IntArrayRef({N, OH, OW, C}) && argmax.device() == dy_in.device(),
              "max_pool_nhwc_backward: argmax must be the forward's uint8 [N, OH, OW, C]");
  c10::cuda::CUDAGuard guard(dy_in.device());
  auto dy = dy_in.contiguous(at::MemoryFormat::ChannelsLast);
  if (!aligned(dy)) dy = dy.clone(at::MemoryFormat::ChannelsLast);
  auto dx = at::empty({N, C, H, W}, dy.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (dx.numel() == 0) return dx;
  const int k = static_cast<int>(kernel), s = static_cast<int>(stride), p = static_cast<int>(padding);
  if (dy.scalar_type() == at::kBFloat16) launch_backward<__nv_bfloat16>(dy, argmax, dx, k, s, p);
  else launch_backward<float>(dy, argmax, dx, k, s, p);
  return dx;
}

}  // namespace ddp::cuda
