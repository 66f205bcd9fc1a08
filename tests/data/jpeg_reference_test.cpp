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

#include <random>
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

nlohmann::json jpeg_reference() {
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
  const auto ref = jpeg_reference();
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
  for (const auto& image : jpeg_reference()["images"]) {
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

// decode_image_box: every variant, at full size and scaled, cut to boxes
// on and off block boundaries, gives the whole decode's pixels exactly;
// the plain JPEGs are decoded only around the box (fewer columns than the
// image has), the others whole; a truncated file is refused as a whole
// decode refuses it, whatever the box.
TEST(JpegReference, ABoxDecodesToTheWholeDecodesPixels) {
  using ddp::data::CropBox;
  std::mt19937 rng(5);
  auto boxes = [&](int64_t h, int64_t w) {
    std::vector<CropBox> out{{0, 0, h, w}, {0, 0, 1, 1}, {h - 1, w - 1, 1, 1}, {h / 2, w / 3, h - h / 2, w - w / 3}};
    for (int i = 0; i < 40; ++i) {
      const int64_t top = std::uniform_int_distribution<int64_t>(0, h - 1)(rng);
      const int64_t left = std::uniform_int_distribution<int64_t>(0, w - 1)(rng);
      out.push_back({top, left, std::uniform_int_distribution<int64_t>(1, h - top)(rng),
                     std::uniform_int_distribution<int64_t>(1, w - left)(rng)});
    }
    return out;
  };
  auto check = [&](const std::string& file, int64_t min_side, bool plain) {
    const auto bytes = ddp::testing::read_file(file);
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
    const auto whole = decode_image_file(file, DecodeOptions().min_side(min_side));
    const int64_t h = whole.size(0), w = whole.size(1);
    bool cropped = false;
    for (const CropBox& want : boxes(h, w)) {
      CropBox got, decoded;
      const auto part = ddp::data::decode_image_box(
          data, bytes.size(), file, DecodeOptions().min_side(min_side),
          [&](int64_t bh, int64_t bw) {
            EXPECT_EQ(bh, h);
            EXPECT_EQ(bw, w);
            return want;
          },
          &got, &decoded);
      const std::string what = file + " min_side " + std::to_string(min_side) + " box " + std::to_string(want.top) +
                               "," + std::to_string(want.left) + " " + std::to_string(want.height) + "x" +
                               std::to_string(want.width);
      EXPECT_EQ(got.top, want.top);
      EXPECT_EQ(got.width, want.width);
      ASSERT_TRUE(torch::equal(part, whole.narrow(0, want.top, want.height).narrow(1, want.left, want.width)))
          << what;
      EXPECT_LE(decoded.left, want.left) << what;
      EXPECT_GE(decoded.left + decoded.width, want.left + want.width) << what;
      if (!plain) {
        EXPECT_EQ(decoded.width, w) << what << ": decoded whole";
      }
      cropped |= decoded.width < w;
    }
    if (plain) {
      EXPECT_TRUE(cropped) << file << " min_side " << min_side << ": never decoded around a box";
    }
  };
  for (const auto& image : jpeg_reference()["images"]) {
    const std::string file = image["file"];
    // Every variant here ends with its end-of-image marker, so each is decoded around the box.
    check(kDir + file, 0, true);
    for (const auto& scaled : image["scaled"]) check(kDir + file, scaled["height"].get<int64_t>(), true);
  }
  const auto dir = ddp::testing::temp_dir("jpeg_box");
  ddp::data::write_png(dir + "/p.png", torch::randint(0, 256, {40, 50, 3}, torch::kByte));
  check(dir + "/p.png", 0, false);
  // Noise: every pixel differs from its neighbours, so a column upsampled
  // from the wrong chroma shows (it did, before the crop's margin).
  ddp::data::write_jpeg(dir + "/big.jpg", torch::randint(0, 256, {120, 200, 3}, torch::kByte), 90);
  for (int64_t min_side : {0, 15, 30, 60}) check(dir + "/big.jpg", min_side, true);
  const std::string truncated = kDir + "truncated.jpg";
  const auto bytes = ddp::testing::read_file(truncated);
  try {
    ddp::data::decode_image_box(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), truncated,
                                DecodeOptions(), [](int64_t, int64_t) { return CropBox{0, 0, 1, 1}; }, nullptr);
    ADD_FAILURE() << truncated << " decoded";
  } catch (const CorruptImage& e) {
    EXPECT_NE(e.reason().find("truncated JPEG"), std::string::npos) << e.what();
  }
  const std::string plain = kDir + "baseline_420.jpg";
  const auto plain_bytes = ddp::testing::read_file(plain);
  EXPECT_THROW(ddp::data::decode_image_box(reinterpret_cast<const uint8_t*>(plain_bytes.data()), plain_bytes.size(),
                                           plain, DecodeOptions(),
                                           [](int64_t h, int64_t) { return CropBox{0, 0, h + 1, 1}; }, nullptr),
               c10::Error);
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
