// Resize, random-resized crop, centre crop, flip, normalise: one image at a time.
#include "ddp/data/image_transforms.h"

#include <algorithm>
#include <cmath>

#include "ddp/error.h"

namespace ddp::data {
namespace {

namespace F = torch::nn::functional;

// Keeps this file's draws apart from every other user of the same key.
constexpr uint64_t kTagCrop = 0x72726372, kTagFlip = 0x666c6970;

}  // namespace

CropBox random_resized_crop_box(int64_t height, int64_t width, const ImageTransformOptions& options,
                                KeyedRandom& rng) {
  const double area = static_cast<double>(height) * static_cast<double>(width);
  const double log_lo = std::log(options.min_ratio()), log_hi = std::log(options.max_ratio());
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * rng.uniform(options.min_scale(), options.max_scale());
    const double ratio = std::exp(rng.uniform(log_lo, log_hi));
    const int64_t w = std::llround(std::sqrt(target * ratio));
    const int64_t h = std::llround(std::sqrt(target / ratio));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      const int64_t top = rng.below(height - h + 1);
      const int64_t left = rng.below(width - w + 1);
      return {top, left, h, w};
    }
  }
  // No try fitted (a very long or thin image): the whole image, trimmed to
  // the nearest allowed aspect ratio, centred.
  const double ratio = static_cast<double>(width) / static_cast<double>(height);
  int64_t w = width, h = height;
  if (ratio < options.min_ratio()) {
    h = std::max<int64_t>(1, std::llround(static_cast<double>(width) / options.min_ratio()));
  } else if (ratio > options.max_ratio()) {
    w = std::max<int64_t>(1, std::llround(static_cast<double>(height) * options.max_ratio()));
  }
  h = std::min(h, height);
  w = std::min(w, width);
  return {(height - h) / 2, (width - w) / 2, h, w};
}

torch::Tensor resize_image(const torch::Tensor& chw, int64_t height, int64_t width) {
  TORCH_CHECK(chw.dim() == 3 && chw.is_floating_point(), "resize_image wants float C x H x W, got ",
              chw.sizes(), " ", chw.scalar_type());
  if (chw.size(1) == height && chw.size(2) == width) return chw;
  return F::interpolate(chw.unsqueeze(0), F::InterpolateFuncOptions()
                                              .size(std::vector<int64_t>{height, width})
                                              .mode(torch::kBilinear)
                                              .align_corners(false)
                                              .antialias(true))
      .squeeze(0);
}

torch::Tensor resize_shorter_side(const torch::Tensor& chw, int64_t size) {
  const int64_t h = chw.size(1), w = chw.size(2);
  if (h <= w) return resize_image(chw, size, std::max<int64_t>(1, std::llround(static_cast<double>(w) * size / h)));
  return resize_image(chw, std::max<int64_t>(1, std::llround(static_cast<double>(h) * size / w)), size);
}

torch::Tensor center_crop(const torch::Tensor& chw, int64_t size) {
  const int64_t h = chw.size(1), w = chw.size(2);
  TORCH_CHECK(h >= size && w >= size, "center_crop: ", h, " x ", w, " is smaller than ", size);
  return chw.narrow(1, (h - size) / 2, size).narrow(2, (w - size) / 2, size);
}

int64_t eval_resize_side(const ImageTransformOptions& options) {
  return std::max<int64_t>(options.size(),
                           std::llround(static_cast<double>(options.size()) / options.eval_crop_fraction()));
}

// Evaluation resizes the whole image to a shorter side of eval_resize_side,
// so a decode that keeps at least that many pixels loses nothing the resize
// would keep: it is what fast validation pipelines do (PIL's draft() before
// Resize(256)).
//
// Training crops a random fraction of the area, between min_scale (8%) and
// max_scale, and resizes it to size x size. The rule here: the decoded
// shorter side is at least `size`, so a crop of the whole image is never
// upsampled. Smaller crops then come from fewer pixels than in the file:
// an 8% crop of a decoded 375 px side spans ~106 px, stretched to 224. That
// is the resolution of ImageNet's own photos (most are 500 x 375 or
// 500 x 333; a scaled decode keeps a shorter side between size and
// 2 x size), the one the standard recipes were tuned on. The stricter
// rule, no crop ever upsampled (size / sqrt(min_scale) = 792 px for 224),
// would decode a 2000 x 1500 photo at full size (1/2 gives 750 < 792) and
// a 4000 x 3000 one at 1/2 only, giving up most of the speed-up.
int64_t decode_min_side(const ImageTransformOptions& options) {
  return options.train() ? options.size() : eval_resize_side(options);
}

TransformWindow transform_window(int64_t height, int64_t width, const ImageTransformOptions& options,
                                 const DrawKey& key, int64_t position) {
  const int64_t size = options.size();
  check_user(size >= 1, "image size " + std::to_string(size) + " is not positive.", "pass e.g. --image-size 224.");
  TransformWindow t;
  if (options.train()) {
    const auto seed = key.seed, epoch = static_cast<uint64_t>(key.epoch), rank = static_cast<uint64_t>(key.rank),
               pos = static_cast<uint64_t>(position);
    KeyedRandom crop_rng(hash_words({seed, kTagCrop, epoch, rank, pos}));
    KeyedRandom flip_rng(hash_words({seed, kTagFlip, epoch, rank, pos}));
    t.source = random_resized_crop_box(height, width, options, crop_rng);
    t.resized_height = t.resized_width = size;
    t.flip = options.flip() && (flip_rng.next() >> 63) != 0;
  } else {
    // Shorter side to eval_resize_side (the longer one rounded), then the
    // centre size x size.
    const int64_t side = eval_resize_side(options);
    t.source = CropBox{0, 0, height, width};
    t.resized_height = height <= width ? side : std::max<int64_t>(1, std::llround(static_cast<double>(height) * side / width));
    t.resized_width = height <= width ? std::max<int64_t>(1, std::llround(static_cast<double>(width) * side / height)) : side;
    TORCH_CHECK(t.resized_height >= size && t.resized_width >= size, "transform_window: ", t.resized_height, " x ",
                t.resized_width, " is smaller than ", size);
    t.offset_y = (t.resized_height - size) / 2;
    t.offset_x = (t.resized_width - size) / 2;
  }
  return t;
}

torch::Tensor apply_transform_window(const torch::Tensor& hwc, const TransformWindow& t,
                                     const ImageTransformOptions& options) {
  TORCH_CHECK(hwc.dim() == 3 && hwc.size(2) == 3 && hwc.scalar_type() == torch::kByte,
              "transform_image wants uint8 H x W x 3, got ", hwc.sizes(), " ", hwc.scalar_type());
  const int64_t size = options.size();
  // Crop the bytes first: only the window is converted and resampled.
  const auto window = hwc.narrow(0, t.source.top, t.source.height).narrow(1, t.source.left, t.source.width);
  torch::Tensor out = resize_image(window.permute({2, 0, 1}).to(torch::kFloat), t.resized_height, t.resized_width)
                          .narrow(1, t.offset_y, size)
                          .narrow(2, t.offset_x, size);
  if (t.flip) out = out.flip({2});
  const auto& mean = options.mean();
  const auto& stdev = options.std();
  TORCH_CHECK(mean.size() == 3 && stdev.size() == 3, "transform_image: mean and std need 3 values");
  out = out.contiguous();
  // Per channel: (pixel / 255 - mean) / std, in one multiply-add.
  float* p = out.data_ptr<float>();
  const int64_t plane = size * size;
  for (int64_t c = 0; c < 3; ++c) {
    const auto scale = static_cast<float>(1.0 / (255.0 * stdev[c]));
    const auto shift = static_cast<float>(-mean[c] / stdev[c]);
    for (int64_t i = 0; i < plane; ++i) p[c * plane + i] = p[c * plane + i] * scale + shift;
  }
  return out;
}

torch::Tensor transform_image(const torch::Tensor& hwc, const ImageTransformOptions& options,
                              const DrawKey& key, int64_t position) {
  TORCH_CHECK(hwc.dim() == 3, "transform_image wants uint8 H x W x 3, got ", hwc.sizes(), " ", hwc.scalar_type());
  return apply_transform_window(hwc, transform_window(hwc.size(0), hwc.size(1), options, key, position), options);
}

}  // namespace ddp::data
