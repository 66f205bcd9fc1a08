// The JPEG decoder against PIL's: real variants (4:2:0, 4:2:2, 4:4:4,
// progressive, restart markers, grayscale, CMYK with and without Adobe's
// marker, truncated) made by tools/gen_jpeg_testdata.py, decoded at full
// size and at 1/2, 1/4 and 1/8 scale, and compared with what PIL 9.4
// (Image.open(...).convert("RGB"), and Image.draft() for the scaled ones)
// produced from the same files. PIL links the same Debian libjpeg-turbo, so
// the pixels must be equal, not merely close. The scaled decode is also
// compared with a full decode resized, on a larger picture.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "ddp/data/image_codec.h"
#include "ddp/data/image_transforms.h"
#include "support/testing.h"

namespace {

using ddp::data::CorruptImage;
using ddp::data::decode_image_file;
using ddp::data::DecodeOptions;

const std::string kDir = DDP_TEST_DATA_DIR "/jpeg/";

nlohmann::json reference() {
  const std::string text = ddp::testing::read_file(kDir + "reference.json");
  EXPECT_FALSE(text.empty()) << "missing " << kDir << "reference.json; run /usr/bin/python3 tools/gen_jpeg_testdata.py";
  return nlohmann::json::parse(text);
}

// The largest difference between two uint8 images, in levels (-1: sizes differ).
int max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes()) return -1;
  return (a.to(torch::kInt) - b.to(torch::kInt)).abs().max().item<int>();
}

std::vector<int64_t> hw3(const nlohmann::json& entry) {
  return {entry["height"].get<int64_t>(), entry["width"].get<int64_t>(), 3};
}

TEST(JpegReference, EveryVariantDecodesExactlyAsPilDoes) {
  const auto ref = reference();
  ASSERT_EQ(ref["images"].size(), 8u);
  for (const auto& image : ref["images"]) {
    const std::string file = image["file"];
    const auto ours = decode_image_file(kDir + file);
    const auto pil = decode_image_file(kDir + image["reference"].get<std::string>());  // PNG: lossless
    EXPECT_EQ(ours.sizes(), hw3(image)) << file;
    EXPECT_EQ(max_difference(ours, pil), 0) << file << " differs from PIL's decode";
  }
}

TEST(JpegReference, ScaledDecodeIsPilsDraftAtHalfQuarterAndEighth) {
  for (const auto& image : reference()["images"]) {
    const std::string file = image["file"];
    for (const auto& scaled : image["scaled"]) {
      const int64_t denom = scaled["denominator"], height = scaled["height"];
      // Asking for exactly the scaled shorter side must give that scale.
      const auto ours = decode_image_file(kDir + file, DecodeOptions().min_side(height));
      const auto pil = decode_image_file(kDir + scaled["reference"].get<std::string>());
      EXPECT_EQ(ours.sizes(), hw3(scaled)) << file << " at 1/" << denom;
      EXPECT_EQ(max_difference(ours, pil), 0) << file << " at 1/" << denom << " differs from PIL's draft()";
    }
  }
}

TEST(JpegReference, ScaleIsTheLargestReductionThatKeepsMinSide) {
  // 37 x 23: 1/2 gives 19 x 12, 1/4 gives 10 x 6, 1/8 gives 5 x 3 (sides rounded up).
  const std::string file = kDir + "baseline_420.jpg";
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> cases = {
      {0, {23, 37, 3}},  {1, {3, 5, 3}},   {3, {3, 5, 3}},   {4, {6, 10, 3}},   {6, {6, 10, 3}},
      {7, {12, 19, 3}},  {12, {12, 19, 3}}, {13, {23, 37, 3}}, {23, {23, 37, 3}},
      {500, {23, 37, 3}},  // never upscaled
  };
  for (const auto& [min_side, size] : cases)
    EXPECT_EQ(decode_image_file(file, DecodeOptions().min_side(min_side)).sizes(), size) << "min_side " << min_side;
  // A PNG is always decoded at full size.
  const auto dir = ddp::testing::temp_dir("jpeg_scale");
  ddp::data::write_png(dir + "/big.png", torch::zeros({64, 80, 3}, torch::kByte));
  EXPECT_EQ(decode_image_file(dir + "/big.png", DecodeOptions().min_side(8)).sizes(), (std::vector<int64_t>{64, 80, 3}));
}

TEST(JpegReference, TruncatedFileIsRefusedAtEveryScale) {
  const std::string file = kDir + "truncated.jpg";
  for (int64_t min_side : {0, 3, 6, 12}) {
    try {
      decode_image_file(file, DecodeOptions().min_side(min_side));
      ADD_FAILURE() << file << " decoded at min_side " << min_side;
    } catch (const CorruptImage& e) {
      EXPECT_EQ(e.path(), file);
      EXPECT_NE(e.reason().find("truncated JPEG"), std::string::npos) << e.what();
    }
  }
}

// On a picture large enough to show it: decoding at 1/4 or 1/8 gives about
// what decoding in full and shrinking (antialiased, as the transforms do)
// gives. The two filters differ (libjpeg's reduced inverse DCT against a
// triangle filter), so this is a bound, not equality: on this picture the
// mean difference is under 1 level (measured 0.49 at 1/4, 0.64 at 1/8) and
// no pixel is more than 8 levels off (measured 4 and 5).
TEST(JpegScaledDecode, IsCloseToAFullDecodeResized) {
  const int64_t h = 360, w = 480;
  auto y = torch::arange(h, torch::kFloat).view({h, 1, 1});
  auto x = torch::arange(w, torch::kFloat).view({1, w, 1});
  auto c = torch::arange(3, torch::kFloat).view({1, 1, 3});
  const auto picture = (128 + 90 * torch::sin(y * 0.031 + x * 0.017 * (c + 1)) + 0.05 * (x - y))
                           .clamp(0, 255).to(torch::kByte).contiguous();
  const auto dir = ddp::testing::temp_dir("jpeg_scaled");
  ddp::data::write_jpeg(dir + "/p.jpg", picture, 95);
  const auto full = decode_image_file(dir + "/p.jpg").permute({2, 0, 1}).to(torch::kFloat);
  for (int64_t denom : {4, 8}) {
    const auto small = decode_image_file(dir + "/p.jpg", DecodeOptions().min_side(h / denom));
    ASSERT_EQ(small.sizes(), (std::vector<int64_t>{h / denom, w / denom, 3})) << "1/" << denom;
    const auto resized = ddp::data::resize_image(full, h / denom, w / denom).round().clamp(0, 255);
    const auto diff = (small.permute({2, 0, 1}).to(torch::kFloat) - resized).abs();
    EXPECT_LT(diff.mean().item<double>(), 1.0) << "1/" << denom;
    EXPECT_LE(diff.max().item<double>(), 8) << "1/" << denom;
  }
}

}  // namespace
