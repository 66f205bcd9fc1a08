// JPEG and PNG decoding: every PNG colour type to RGB, JPEG close to its
// source, and damaged files refused with their path.
#include <gtest/gtest.h>
#include <zlib.h>

#include <fstream>
#include <string>

#include "ddp/data/image_codec.h"
#include "support/capped_child.h"
#include "support/testing.h"

namespace {

using ddp::data::CorruptImage;
using ddp::data::decode_image_file;

// A smooth H x W x 3 image that differs in every channel and pixel position.
torch::Tensor gradient_image(int64_t h, int64_t w) {
  auto y = torch::arange(h, torch::kFloat).view({h, 1}).expand({h, w});
  auto x = torch::arange(w, torch::kFloat).view({1, w}).expand({h, w});
  auto r = (y * 255.0 / std::max<int64_t>(1, h - 1));
  auto g = (x * 255.0 / std::max<int64_t>(1, w - 1));
  auto b = (255.0 - (r + g) / 2);
  return torch::stack({r, g, b}, 2).round().to(torch::kByte).contiguous();
}

std::string bytes_of(const std::string& path) { return ddp::testing::read_file(path); }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// The reason CorruptImage gives for `path`; fails the test if none is thrown.
std::string corrupt_reason(const std::string& path) {
  try {
    decode_image_file(path);
  } catch (const CorruptImage& e) {
    EXPECT_EQ(e.path(), path);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
    return e.reason();
  }
  ADD_FAILURE() << path << " decoded without error";
  return "";
}

TEST(ImageCodec, RgbPngRoundTripsExactly) {
  const auto dir = ddp::testing::temp_dir("codec");
  const auto image = gradient_image(7, 11);
  ddp::data::write_png(dir + "/rgb.png", image);
  const auto back = decode_image_file(dir + "/rgb.png");
  EXPECT_EQ(back.sizes(), (std::vector<int64_t>{7, 11, 3}));
  EXPECT_TRUE(torch::equal(back, image));
}

TEST(ImageCodec, GrayPngBecomesThreeEqualChannels) {
  const auto dir = ddp::testing::temp_dir("codec");
  const auto gray = gradient_image(5, 9).select(2, 0).unsqueeze(2).contiguous();
  ddp::data::write_png(dir + "/gray.png", gray);
  const auto back = decode_image_file(dir + "/gray.png");
  ASSERT_EQ(back.sizes(), (std::vector<int64_t>{5, 9, 3}));
  for (int64_t c = 0; c < 3; ++c) EXPECT_TRUE(torch::equal(back.select(2, c), gray.select(2, 0))) << "channel " << c;
}

TEST(ImageCodec, RgbaPngDropsAlphaWithoutCompositing) {
  const auto dir = ddp::testing::temp_dir("codec");
  const auto rgb = gradient_image(6, 6);
  auto alpha = torch::arange(36, torch::kInt).view({6, 6, 1}).mul(7).to(torch::kByte);  // 0 .. 245, some transparent
  ddp::data::write_png(dir + "/rgba.png", torch::cat({rgb, alpha}, 2).contiguous());
  EXPECT_TRUE(torch::equal(decode_image_file(dir + "/rgba.png"), rgb));
}

TEST(ImageCodec, PalettePngIsExpandedToRgb) {
  const auto dir = ddp::testing::temp_dir("codec");
  // 4 colours in a checker pattern.
  auto image = torch::zeros({8, 8, 3}, torch::kByte);
  for (int64_t y = 0; y < 8; ++y)
    for (int64_t x = 0; x < 8; ++x) {
      const int k = static_cast<int>((y / 2 + x / 2) % 4);
      image[y][x][0] = 60 * k;
      image[y][x][1] = 255 - 50 * k;
      image[y][x][2] = k == 2 ? 200 : 10;
    }
  ddp::data::write_palette_png(dir + "/palette.png", image);
  // A palette PNG really has colour type 3 (byte 25 of the file).
  const std::string bytes = bytes_of(dir + "/palette.png");
  ASSERT_GT(bytes.size(), 26u);
  EXPECT_EQ(static_cast<int>(bytes[25]), 3);
  EXPECT_TRUE(torch::equal(decode_image_file(dir + "/palette.png"), image));
}

TEST(ImageCodec, JpegDecodesCloseToItsSource) {
  const auto dir = ddp::testing::temp_dir("codec");
  const auto image = gradient_image(40, 56);
  ddp::data::write_jpeg(dir + "/a.jpg", image, 95);
  const auto back = decode_image_file(dir + "/a.jpg");
  ASSERT_EQ(back.sizes(), image.sizes());
  const double mean_error = (back.to(torch::kFloat) - image.to(torch::kFloat)).abs().mean().item<double>();
  EXPECT_LT(mean_error, 3.0);  // lossy, but a smooth gradient survives quality 95
  // Not a blank or constant decode: the image spans the value range.
  EXPECT_GT(back.max().item<int>() - back.min().item<int>(), 200);
}

TEST(ImageCodec, GrayJpegBecomesThreeEqualChannels) {
  const auto dir = ddp::testing::temp_dir("codec");
  const auto gray = gradient_image(16, 16).select(2, 1).unsqueeze(2).contiguous();
  ddp::data::write_jpeg(dir + "/g.jpg", gray, 95);
  const auto back = decode_image_file(dir + "/g.jpg");
  ASSERT_EQ(back.sizes(), (std::vector<int64_t>{16, 16, 3}));
  EXPECT_TRUE(torch::equal(back.select(2, 0), back.select(2, 1)));
  EXPECT_TRUE(torch::equal(back.select(2, 0), back.select(2, 2)));
}

TEST(ImageCodec, FormatIsToldByContentNotName) {
  const auto dir = ddp::testing::temp_dir("codec");
  const auto image = gradient_image(4, 4);
  ddp::data::write_png(dir + "/really_a_png.jpg", image);
  EXPECT_TRUE(torch::equal(decode_image_file(dir + "/really_a_png.jpg"), image));
}

TEST(ImageCodec, TruncatedJpegIsCorrupt) {
  const auto dir = ddp::testing::temp_dir("codec");
  // Noise makes the entropy-coded data much larger than the headers, so a
  // cut at 3/4 lands inside the image data.
  torch::manual_seed(0);
  const auto noisy = (gradient_image(96, 128).to(torch::kInt) + torch::randint(-40, 40, {96, 128, 3}, torch::kInt))
                         .clamp(0, 255).to(torch::kByte).contiguous();
  ddp::data::write_jpeg(dir + "/full.jpg", noisy, 90);
  const std::string bytes = bytes_of(dir + "/full.jpg");
  ASSERT_GT(bytes.size(), 4000u);  // headers and tables are about 600 bytes
  write_bytes(dir + "/cut.jpg", bytes.substr(0, bytes.size() * 3 / 4));
  const std::string reason = corrupt_reason(dir + "/cut.jpg");
  EXPECT_NE(reason.find("truncated JPEG"), std::string::npos) << reason;
  // Cut inside the header: an error from libjpeg itself, not a warning.
  write_bytes(dir + "/stub.jpg", bytes.substr(0, 40));
  EXPECT_FALSE(corrupt_reason(dir + "/stub.jpg").empty());
}

TEST(ImageCodec, TruncatedPngIsCorrupt) {
  const auto dir = ddp::testing::temp_dir("codec");
  ddp::data::write_png(dir + "/full.png", gradient_image(64, 64));
  const std::string bytes = bytes_of(dir + "/full.png");
  write_bytes(dir + "/cut.png", bytes.substr(0, bytes.size() - 30));
  EXPECT_NE(corrupt_reason(dir + "/cut.png").find("PNG"), std::string::npos);
}

// A PNG header may promise up to 1,000,000 x 1,000,000 pixels (libpng's
// default limit): 3 TB asked of the allocator for a file of a few hundred
// bytes. Deflate packs at most about 1032 bytes into one, so a file cannot
// hold more; such a header is corrupt, said before anything is allocated.
TEST(ImageCodec, PngThatPromisesMorePixelsThanItsFileCanHoldIsCorrupt) {
  const auto dir = ddp::testing::temp_dir("codec");
  ddp::data::write_png(dir + "/small.png", gradient_image(8, 8));
  std::string bytes = bytes_of(dir + "/small.png");
  const size_t ihdr = bytes.find("IHDR");
  ASSERT_NE(ihdr, std::string::npos);
  auto put_be32 = [&](size_t at, uint32_t v) {
    for (int k = 0; k < 4; ++k) bytes[at + k] = static_cast<char>(v >> (24 - 8 * k));
  };
  put_be32(ihdr + 4, 1000000);  // width
  put_be32(ihdr + 8, 1000000);  // height
  put_be32(ihdr + 17, static_cast<uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(bytes.data() + ihdr), 17)));
  write_bytes(dir + "/huge.png", bytes);
  EXPECT_NE(corrupt_reason(dir + "/huge.png").find("1000000 x 1000000"), std::string::npos);
}

// A JPEG whose frame header claims 65500 x 65500 pixels (12.9 GB of RGB)
// in a file of a few hundred bytes: refused before anything is allocated,
// as Pillow refuses a decompression bomb, inside a child that may grow by
// 1 GB. (Its rows were allocated first: bad_alloc.)
TEST(ImageCodec, JpegThatClaimsMorePixelsThanPillowAllowsIsCorrupt) {
  const auto dir = ddp::testing::temp_dir("codec");
  ddp::data::write_jpeg(dir + "/small.jpg", gradient_image(16, 16), 90);
  std::string bytes = bytes_of(dir + "/small.jpg");
  size_t sof = std::string::npos;
  for (size_t i = 0; i + 9 < bytes.size(); ++i)
    if (static_cast<unsigned char>(bytes[i]) == 0xFF && (static_cast<unsigned char>(bytes[i + 1]) == 0xC0 ||
                                                          static_cast<unsigned char>(bytes[i + 1]) == 0xC2)) {
      sof = i;
      break;
    }
  ASSERT_NE(sof, std::string::npos) << "no SOF0/SOF2 marker";
  for (size_t at : {sof + 5, sof + 7}) {  // height, then width: 65500 = 0xFFDC
    bytes[at] = static_cast<char>(0xFF);
    bytes[at + 1] = static_cast<char>(0xDC);
  }
  write_bytes(dir + "/huge.jpg", bytes);
  const std::string out = ddp::testing::in_capped_child(
      [&] {
        try {
          decode_image_file(dir + "/huge.jpg");
          return std::string("decoded");
        } catch (const CorruptImage& e) {
          return std::string("corrupt: ") + e.reason();
        }
      },
      size_t{1} << 30);
  EXPECT_NE(out.find("corrupt: "), std::string::npos) << out;
  EXPECT_NE(out.find("65500 x 65500"), std::string::npos) << out;
  // Nor is it handed to the GPU's decoder (nvJPEG) as a plain JPEG.
  EXPECT_FALSE(ddp::data::plain_jpeg_info(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  EXPECT_TRUE(ddp::data::plain_jpeg_info(reinterpret_cast<const uint8_t*>(bytes_of(dir + "/small.jpg").data()),
                                         bytes_of(dir + "/small.jpg").size()));
}

TEST(ImageCodec, GarbageAndEmptyAndMissingFilesAreCorrupt) {
  const auto dir = ddp::testing::temp_dir("codec");
  write_bytes(dir + "/garbage.png", "this is not an image at all, just some text\n");
  EXPECT_NE(corrupt_reason(dir + "/garbage.png").find("neither a JPEG nor a PNG"), std::string::npos);
  // The PNG signature followed by garbage reaches libpng, which refuses it.
  write_bytes(dir + "/bad_chunks.png", std::string("\x89PNG\r\n\x1a\n", 8) + std::string(100, 'x'));
  EXPECT_NE(corrupt_reason(dir + "/bad_chunks.png").find("not a valid PNG"), std::string::npos);
  write_bytes(dir + "/empty.jpg", "");
  EXPECT_EQ(corrupt_reason(dir + "/empty.jpg"), "empty file");
  EXPECT_EQ(corrupt_reason(dir + "/missing.png"), "cannot open for reading");
}

}  // namespace
