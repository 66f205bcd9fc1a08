// One launch crops, resizes, flips and normalises a whole batch of decoded
// images (see the header). A thread computes one output pixel, all three
// channels: it walks the source rows and columns its output pixel's filter
// covers, as LibTorch's antialiased bilinear interpolation does (weights
// from a triangle filter, normalised to sum to 1), summing each row over
// its columns first, then the rows, as LibTorch's separable passes do.
#include "ddp/cuda/image_resample.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace ddp::cuda {
namespace {

// The filter span of output index i over an input of `in` samples resized
// to `out`: first input index, count, the centre and the filter's
// horizontal scale. The formulas are LibTorch's for antialiased bilinear
// (align_corners=false, no explicit scale factor).
struct Span {
  int first, count;
  float center, inv_scale;
};

__device__ __forceinline__ Span filter_span(int i, int in, int out) {
  const float scale = static_cast<float>(in) / static_cast<float>(out);
  const float support = scale >= 1.f ? scale : 1.f;
  Span s;
  s.center = scale * (static_cast<float>(i) + 0.5f);
  s.inv_scale = scale >= 1.f ? 1.f / scale : 1.f;
  s.first = max(static_cast<int>(s.center - support + 0.5f), 0);
  s.count = min(static_cast<int>(s.center + support + 0.5f), in) - s.first;
  return s;
}

__device__ __forceinline__ float tap(const Span& s, int j) {
  const float x = fabsf((static_cast<float>(j + s.first) - s.center + 0.5f) * s.inv_scale);
  return x < 1.f ? 1.f - x : 0.f;
}

__device__ __forceinline__ float total(const Span& s) {
  float t = 0.f;
  for (int j = 0; j < s.count; ++j) t += tap(s, j);
  return t;
}

struct Norm {
  float scale[3], shift[3];
};

__global__ void resample_kernel(const uint8_t* __restrict__ pixels, const int64_t* __restrict__ geometry,
                                float* __restrict__ out, int size, Norm norm) {
  const int n = blockIdx.z;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  if (y >= size || x >= size) return;
  const int64_t* g = geometry + static_cast<int64_t>(n) * kResampleColumns;
  const uint8_t* image = pixels + g[kPixelOffset];
  const int64_t pitch = 3 * g[kImageWidth];
  const int top = static_cast<int>(g[kTop]), left = static_cast<int>(g[kLeft]);
  const int wh = static_cast<int>(g[kWindowHeight]), ww = static_cast<int>(g[kWindowWidth]);
  const int vy = y + static_cast<int>(g[kOffsetY]);
  const int xs = g[kFlip] ? size - 1 - x : x;
  const int vx = xs + static_cast<int>(g[kOffsetX]);
  const Span sy = filter_span(vy, wh, static_cast<int>(g[kVirtualHeight]));
  const Span sx = filter_span(vx, ww, static_cast<int>(g[kVirtualWidth]));
  const float ty = total(sy), tx = total(sx);
  float acc[3] = {0.f, 0.f, 0.f};
  for (int j = 0; j < sy.count; ++j) {
    const float wy = tap(sy, j) / ty;
    if (wy == 0.f) continue;
    const uint8_t* row = image + static_cast<int64_t>(top + sy.first + j) * pitch + 3 * (left + sx.first);
    float r[3] = {0.f, 0.f, 0.f};
    for (int k = 0; k < sx.count; ++k) {
      const float wx = tap(sx, k) / tx;
      r[0] += wx * row[3 * k];
      r[1] += wx * row[3 * k + 1];
      r[2] += wx * row[3 * k + 2];
    }
    acc[0] += wy * r[0];
    acc[1] += wy * r[1];
    acc[2] += wy * r[2];
  }
  const int64_t plane = static_cast<int64_t>(size) * size;
  float* o = out + static_cast<int64_t>(n) * 3 * plane + static_cast<int64_t>(y) * size + x;
#pragma unroll
  for (int c = 0; c < 3; ++c) o[c * plane] = acc[c] * norm.scale[c] + norm.shift[c];
}

}  // namespace

void resample_normalize(const at::Tensor& pixels, const at::Tensor& geometry, at::Tensor& out,
                        const std::array<double, 3>& mean, const std::array<double, 3>& std) {
  TORCH_CHECK(pixels.is_cuda() && pixels.scalar_type() == at::kByte && pixels.is_contiguous(),
              "resample_normalize: pixels must be a contiguous uint8 CUDA tensor");
  TORCH_CHECK(geometry.is_cuda() && geometry.scalar_type() == at::kLong && geometry.dim() == 2 &&
                  geometry.size(1) == kResampleColumns && geometry.is_contiguous(),
              "resample_normalize: geometry must be int64 [N, ", static_cast<int>(kResampleColumns), "] on the GPU");
  const int64_t n = geometry.size(0);
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 4 &&
                  out.size(0) == n && out.size(1) == 3 && out.size(2) == out.size(3),
              "resample_normalize: out must be float32 [", n, ", 3, S, S], got ", out.sizes());
  if (n == 0) return;
  const int size = static_cast<int>(out.size(2));
  Norm norm;
  for (int c = 0; c < 3; ++c) {
    // The CPU path's arithmetic: one multiply-add with constants made in double.
    norm.scale[c] = static_cast<float>(1.0 / (255.0 * std[c]));
    norm.shift[c] = static_cast<float>(-mean[c] / std[c]);
  }
  const c10::cuda::CUDAGuard guard(out.device());
  const dim3 block(32, 8);
  const dim3 grid((size + block.x - 1) / block.x, (size + block.y - 1) / block.y, static_cast<unsigned>(n));
  resample_kernel<<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
      pixels.data_ptr<uint8_t>(), geometry.data_ptr<int64_t>(), out.data_ptr<float>(), size, norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ddp::cuda
