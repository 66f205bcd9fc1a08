// Crop, resize, flip and normalise a batch of decoded images on the GPU, into
// the float32 N x 3 x S x S batch the CPU path makes (image_transforms.h).
//
// Why by hand: the images of a batch differ in size, and each has its own
// crop. LibTorch's interpolate works on one equal-sized batch, so the CPU
// path calls it once per image; on a GPU that would be thousands of small
// launches a step. One launch here covers the batch: every output pixel
// finds its image's window and resamples it with the same antialiased
// bilinear filter as LibTorch's interpolate(..., antialias=true) (a
// triangle filter stretched by the scale factor when shrinking, plain
// bilinear when enlarging, align_corners=false), then normalises.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

namespace ddp::cuda {

/// Columns of the per-image geometry table (int64 [N, kResampleColumns]).
/// Each image is resampled as if its source window (top, left, height,
/// width) were resized to virtual_h x virtual_w, of which the output shows
/// the S x S window at (offset_y, offset_x), mirrored left-right if flip.
/// Training: the window is the random crop, virtual = S x S, offsets 0.
/// Evaluation: the window is the whole image, virtual = the shorter-side
/// resize, offsets = the centre crop's.
enum ResampleColumn : int {
  kPixelOffset = 0,  // byte offset of the image's H x W x 3 pixels in `pixels`
  kImageWidth,       // W (the row pitch is 3 W bytes)
  kTop,
  kLeft,
  kWindowHeight,
  kWindowWidth,
  kVirtualHeight,
  kVirtualWidth,
  kOffsetY,
  kOffsetX,
  kFlip,
  kResampleColumns
};

/// pixels: uint8 CUDA buffer holding every image as H x W x 3 RGB.
/// geometry: int64 [N, kResampleColumns] on the same device.
/// out: float32 CUDA [N, 3, S, S], contiguous; written on the current stream.
/// Pixel values are scaled as (v / 255 - mean) / std per channel.
void resample_normalize(const at::Tensor& pixels, const at::Tensor& geometry, at::Tensor& out,
                        const std::array<double, 3>& mean, const std::array<double, 3>& std);

}  // namespace ddp::cuda
