// Per-image transforms for datasets of decoded files: resize, random-resized
// crop, centre crop, horizontal flip and normalisation.
//
// Files differ in size, so these run on one image at a time, before images
// are stacked into a batch (the batch transforms in transforms.h need equal
// sizes). Resampling is LibTorch's bilinear interpolation with antialiasing,
// so shrinking a large photo averages over its pixels instead of skipping
// most of them; there is no image library here that would do it for us on
// tensors, and the crop arithmetic is a few lines.
//
// Like transforms.h, every random draw is a pure function of (seed, epoch,
// rank, position): the same sample gets the same crop and flip whichever
// worker thread decodes it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/data/counter_rng.h"
#include "ddp/data/image_codec.h"  // CropBox
#include "ddp/data/dataset.h"

namespace ddp::data {

/// ImageNet's per-channel statistics on the 0..1 scale, used by torchvision's
/// pretrained models; the default for folders of photos.
inline const std::vector<double> kImageNetMean = {0.485, 0.456, 0.406};
inline const std::vector<double> kImageNetStd = {0.229, 0.224, 0.225};

struct ImageTransformOptions {
  /// Output side: every image comes out size x size.
  TORCH_ARG(int64_t, size) = 224;
  /// Training: random-resized crop + flip. Evaluation: resize the shorter
  /// side to size / eval_crop_fraction, then take the centre size x size.
  TORCH_ARG(bool, train) = true;
  /// Random-resized crop: fraction of the image area and aspect-ratio range
  /// (width / height) of the crop, torchvision's defaults.
  TORCH_ARG(double, min_scale) = 0.08;
  TORCH_ARG(double, max_scale) = 1.0;
  TORCH_ARG(double, min_ratio) = 3.0 / 4.0;
  TORCH_ARG(double, max_ratio) = 4.0 / 3.0;
  /// Mirror left-right with probability 1/2 (training only).
  TORCH_ARG(bool, flip) = true;
  /// Evaluation: the centre crop covers this fraction of the resized
  /// shorter side (224 of 256 for the ImageNet convention).
  TORCH_ARG(double, eval_crop_fraction) = 0.875;
  /// Per-channel mean and std on the 0..1 scale.
  TORCH_ARG(std::vector<double>, mean) = kImageNetMean;
  TORCH_ARG(std::vector<double>, std) = kImageNetStd;
};

/// The random-resized-crop rectangle for an image of height x width: up to
/// 10 tries at an area fraction in [min_scale, max_scale] and a log-uniform
/// aspect ratio in [min_ratio, max_ratio] that fit inside the image, else
/// the largest centred crop whose ratio lies in that range.
CropBox random_resized_crop_box(int64_t height, int64_t width, const ImageTransformOptions& options,
                                KeyedRandom& rng);

/// Bilinear, antialiased resize of float C x H x W to C x height x width.
torch::Tensor resize_image(const torch::Tensor& chw, int64_t height, int64_t width);

/// Resizes float C x H x W so that its shorter side is `size`, keeping the
/// aspect ratio (the longer side is rounded).
torch::Tensor resize_shorter_side(const torch::Tensor& chw, int64_t size);

/// The centred size x size window of C x H x W (a view; H, W >= size).
torch::Tensor center_crop(const torch::Tensor& chw, int64_t size);

/// Evaluation: the side the shorter image side is resized to before the
/// centre crop (size / eval_crop_fraction, at least size).
int64_t eval_resize_side(const ImageTransformOptions& options);

/// The shorter side a decoded image needs for this transform to lose
/// nothing it would otherwise keep, or little (see the .cpp for the rule);
/// image folders pass it to the decoder as DecodeOptions::min_side.
int64_t decode_min_side(const ImageTransformOptions& options);

/// Where an image's output comes from: its `source` window is resized to
/// resized_height x resized_width, of which the output is the size x size
/// window at (offset_y, offset_x), mirrored left-right if `flip`.
/// Training: the random-resized crop, resized to size x size, and the flip.
/// Evaluation: the whole image, its shorter side resized, and the centre.
struct TransformWindow {
  CropBox source;
  int64_t resized_height = 0, resized_width = 0, offset_y = 0, offset_x = 0;
  bool flip = false;
};

/// The window of transform_image for a height x width image: the same
/// draws, so a resampler elsewhere (the GPU path) makes the same crops.
TransformWindow transform_window(int64_t height, int64_t width, const ImageTransformOptions& options,
                                 const DrawKey& key, int64_t position);

/// Crops, resizes and flips uint8 H x W x 3 as `window` says, and
/// normalises: float32 3 x size x size.
torch::Tensor apply_transform_window(const torch::Tensor& hwc, const TransformWindow& window,
                                     const ImageTransformOptions& options);

/// The whole per-image pipeline: uint8 H x W x 3 in, normalised float32
/// 3 x size x size out. `key` and `position` fix the random draws; eval
/// ignores them.
torch::Tensor transform_image(const torch::Tensor& hwc, const ImageTransformOptions& options,
                              const DrawKey& key, int64_t position);

}  // namespace ddp::data
