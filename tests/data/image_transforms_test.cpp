// Per-image transforms: crop rectangles inside the image and within the
// scale/ratio ranges, resize/centre-crop geometry, exact pixels where the
// arithmetic is exact, and draws fixed by (seed, epoch, rank, position).
#include <gtest/gtest.h>

#include <cmath>

#include "ddp/data/image_transforms.h"

namespace {

using ddp::data::CropBox;
using ddp::data::DrawKey;
using ddp::data::ImageTransformOptions;
using ddp::data::KeyedRandom;
using ddp::data::transform_image;

// uint8 H x W x 3 where pixel (y, x) holds (y, x, y + x) modulo 256.
torch::Tensor coordinate_image(int64_t h, int64_t w) {
  auto y = torch::arange(h, torch::kLong).view({h, 1}).expand({h, w});
  auto x = torch::arange(w, torch::kLong).view({1, w}).expand({h, w});
  return torch::stack({y, x, y + x}, 2).remainder(256).to(torch::kByte).contiguous();
}

// Undo the normalisation, back to 0..255.
torch::Tensor unnormalise(const torch::Tensor& chw, const ImageTransformOptions& o) {
  auto mean = torch::tensor(o.mean(), torch::kDouble).view({3, 1, 1});
  auto sd = torch::tensor(o.std(), torch::kDouble).view({3, 1, 1});
  return (chw.to(torch::kDouble) * sd + mean) * 255.0;
}

TEST(ImageTransforms, RandomResizedCropStaysInsideAndInRange) {
  const ImageTransformOptions o;
  int full_fallbacks = 0;
  for (auto [h, w] : std::vector<std::pair<int64_t, int64_t>>{{300, 400}, {64, 64}, {500, 40}, {17, 900}}) {
    for (uint64_t k = 0; k < 500; ++k) {
      KeyedRandom rng(k);
      const CropBox b = ddp::data::random_resized_crop_box(h, w, o, rng);
      ASSERT_GE(b.top, 0);
      ASSERT_GE(b.left, 0);
      ASSERT_GE(b.height, 1);
      ASSERT_GE(b.width, 1);
      ASSERT_LE(b.top + b.height, h);
      ASSERT_LE(b.left + b.width, w);
      const double area = static_cast<double>(b.height * b.width) / static_cast<double>(h * w);
      const double ratio = static_cast<double>(b.width) / static_cast<double>(b.height);
      // Rounding to whole pixels moves both a little beyond the nominal range.
      if (h == 300 || h == 64) {
        EXPECT_GE(area, 0.08 * 0.8) << h << "x" << w;
        EXPECT_LE(area, 1.0);
        EXPECT_GE(ratio, 0.75 * 0.9);
        EXPECT_LE(ratio, 4.0 / 3.0 * 1.1);
      } else {
        // Very thin images: tries often fail and the fallback is the whole
        // width/height trimmed to the allowed ratio.
        full_fallbacks += (b.height == h || b.width == w);
      }
    }
  }
  EXPECT_GT(full_fallbacks, 0);
}

TEST(ImageTransforms, RandomResizedCropCoversTheScaleRange) {
  const ImageTransformOptions o;
  double lo = 1, hi = 0;
  for (uint64_t k = 0; k < 2000; ++k) {
    KeyedRandom rng(k);
    const CropBox b = ddp::data::random_resized_crop_box(1000, 1000, o, rng);
    const double area = static_cast<double>(b.height * b.width) / 1e6;
    lo = std::min(lo, area);
    hi = std::max(hi, area);
  }
  EXPECT_LT(lo, 0.1);
  EXPECT_GT(hi, 0.9);
}

TEST(ImageTransforms, ResizeShorterSideKeepsTheAspectRatio) {
  auto img = torch::rand({3, 120, 200});
  EXPECT_EQ(ddp::data::resize_shorter_side(img, 60).sizes(), (std::vector<int64_t>{3, 60, 100}));
  EXPECT_EQ(ddp::data::resize_shorter_side(img.transpose(1, 2), 60).sizes(), (std::vector<int64_t>{3, 100, 60}));
  // Resizing a constant image keeps the constant (antialiasing weights sum to 1).
  auto flat = torch::full({3, 97, 131}, 42.0f);
  EXPECT_TRUE(torch::allclose(ddp::data::resize_shorter_side(flat, 33), torch::full({3, 33, 45}, 42.0f), 0, 1e-3));
}

TEST(ImageTransforms, CenterCropTakesTheMiddle) {
  auto img = torch::arange(5 * 7, torch::kFloat).view({1, 5, 7});
  const auto c = ddp::data::center_crop(img, 3);
  EXPECT_TRUE(torch::equal(c, img.narrow(1, 1, 3).narrow(2, 2, 3)));
}

TEST(ImageTransforms, EvalAtNativeSizeIsExactNormalisation) {
  // size == shorter side and crop fraction 1: no resampling, only the crop
  // of the longer side's centre and the normalisation.
  const auto img = coordinate_image(32, 40);
  const auto o = ImageTransformOptions().size(32).train(false).eval_crop_fraction(1.0);
  const auto out = transform_image(img, o, DrawKey{}, 0);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 32, 32}));
  const auto expected = img.narrow(1, 4, 32).permute({2, 0, 1}).to(torch::kDouble);
  EXPECT_TRUE(torch::allclose(unnormalise(out, o), expected, 0, 1e-3));
}

TEST(ImageTransforms, EvalResizesThenCropsTheCentre) {
  const auto img = coordinate_image(256, 320);
  const auto o = ImageTransformOptions().size(112).train(false);  // resize to 128, crop 112
  const auto out = unnormalise(transform_image(img, o, DrawKey{}, 0), o);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 112, 112}));
  // Channel 0 holds y: after halving and cropping 8 rows off the top, row r
  // shows source rows around 2 * (r + 8) + 0.5.
  for (int64_t r : {0, 50, 111}) EXPECT_NEAR(out[0][r][56].item<double>(), 2.0 * (r + 8) + 0.5, 1.0) << r;
  // Channel 1 holds x (mod 256): 160 columns at scale 1/2, the centre 112
  // of them start at 24.
  for (int64_t q : {0, 50, 90}) EXPECT_NEAR(out[1][56][q].item<double>(), 2.0 * (q + 24) + 0.5, 1.0) << q;
}

TEST(ImageTransforms, TrainDrawsDependOnlyOnTheKeyAndPosition) {
  const auto img = coordinate_image(90, 120);
  const auto o = ImageTransformOptions().size(48);
  const auto a = transform_image(img, o, DrawKey{7, 2, 1}, 5);
  EXPECT_TRUE(torch::equal(a, transform_image(img, o, DrawKey{7, 2, 1}, 5)));
  EXPECT_FALSE(torch::equal(a, transform_image(img, o, DrawKey{7, 2, 1}, 6)));   // position
  EXPECT_FALSE(torch::equal(a, transform_image(img, o, DrawKey{7, 3, 1}, 5)));   // epoch
  EXPECT_FALSE(torch::equal(a, transform_image(img, o, DrawKey{7, 2, 0}, 5)));   // rank
  EXPECT_FALSE(torch::equal(a, transform_image(img, o, DrawKey{8, 2, 1}, 5)));   // seed
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{3, 48, 48}));
}

TEST(ImageTransforms, TrainFlipsAboutHalfAndOnlyFlips) {
  // With the crop fixed to the whole image (scale 1, ratio of the image),
  // the only randomness left is the flip.
  const auto img = coordinate_image(24, 24);
  const auto o = ImageTransformOptions().size(24).min_scale(1).max_scale(1).min_ratio(1).max_ratio(1);
  const auto plain = transform_image(img, ImageTransformOptions(o).flip(false), DrawKey{}, 0);
  int flipped = 0;
  for (int64_t p = 0; p < 200; ++p) {
    const auto out = transform_image(img, o, DrawKey{3, 0, 0}, p);
    if (torch::equal(out, plain.flip({2}))) {
      ++flipped;
    } else {
      EXPECT_TRUE(torch::equal(out, plain)) << "position " << p;
    }
  }
  EXPECT_GT(flipped, 70);
  EXPECT_LT(flipped, 130);
}

}  // namespace
