// JPEG (libjpeg-turbo) and PNG (libpng) decoding and encoding.
//
// Both libraries report fatal errors through a callback that must not
// return; the documented way out is longjmp back to a setjmp in the caller.
// Each decoder therefore keeps every C++ object it needs alive across the
// setjmp (created before it, only assigned after), so the jump skips no
// destructor, and turns the jump into a CorruptImage exception.
#include "ddp/data/image_codec.h"

#include <algorithm>
#include <csetjmp>
#include <cstdio>  // before jpeglib.h, which needs FILE
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <vector>

#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

namespace ddp::data {
namespace {

// ---- JPEG -------------------------------------------------------------------

struct JpegErrors {
  jpeg_error_mgr mgr;  // first member: libjpeg hands back a pointer to it
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegErrors*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}

// libjpeg only warns about a file that ends early and fills the rest of the
// image with grey. PIL refuses such files by default; so does this decoder.
// Other warnings (e.g. stray bytes between markers) leave a usable image and
// are ignored, as PIL ignores them.
void jpeg_message(j_common_ptr c, int level) {
  auto* e = reinterpret_cast<JpegErrors*>(c->err);
  if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF && !e->truncated) {
    e->truncated = true;
    (*c->err->format_message)(c, e->message);
  }
}

// The strongest reduction, 1/8, 1/4 or 1/2 (else none), that leaves the
// shorter side of a height x width JPEG at least min_side; libjpeg rounds
// each scaled side up. PIL's draft() offers the same three.
unsigned jpeg_scale_denominator(int64_t height, int64_t width, int64_t min_side) {
  const int64_t shorter = std::min(height, width);
  for (unsigned denom : {8u, 4u, 2u})
    if (min_side > 0 && (shorter + denom - 1) / denom >= min_side) return denom;
  return 1;
}

// Whether the last kilobyte holds the end-of-image marker: a whole JPEG
// ends with it, possibly followed by a few stray bytes; one cut short does
// not. Only the tail is searched, so this costs nothing next to a decode.
bool ends_with_end_of_image(const uint8_t* bytes, size_t size) {
  if (size < 4) return false;
  const size_t tail = std::min<size_t>(size, 1024);
  for (size_t i = size - 1; i > size - tail; --i)
    if (bytes[i - 1] == 0xFF && bytes[i] == 0xD9) return true;
  return false;
}

// Adobe writes CMYK JPEGs inverted (0 = full ink); nearly all CMYK JPEGs
// come from Adobe software, so PIL reads every one that way, and so does
// this: R = C * K / 255 on the stored bytes, rounded to nearest as PIL's
// cmyk2rgb does (a product over 255 never falls on a half).
torch::Tensor adobe_cmyk_to_rgb(const torch::Tensor& cmyk) {
  auto f = cmyk.to(torch::kInt);
  auto k = f.select(2, 3).unsqueeze(2);
  return (f.narrow(2, 0, 3) * k + 127).div(255, "floor").to(torch::kByte).contiguous();
}

CropBox checked_box(const CropBox& b, int64_t height, int64_t width) {
  TORCH_CHECK(b.top >= 0 && b.left >= 0 && b.height > 0 && b.width > 0 && b.top + b.height <= height &&
                  b.left + b.width <= width,
              "decode_image_box: box (top ", b.top, ", left ", b.left, ", height ", b.height, ", width ", b.width,
              ") is not inside the ", height, " x ", width, " image");
  return b;
}

// The most pixels a JPEG may claim: Pillow's decompression-bomb error
// threshold (twice Image.MAX_IMAGE_PIXELS), which users of PyTorch's image
// loaders already know. A JPEG's size does not bound its pixels as a PNG's
// does (progressive scans code runs of empty blocks in a few bits), so a
// header of a few hundred bytes could otherwise claim 65500 x 65500 and
// have its rows allocated before the first scan is read.
constexpr int64_t kMaxJpegPixels = 2 * 89478485;

// Decodes a JPEG whole (box_of empty), or only the rows of box_of's box and,
// to within a block, its columns (see decode_image_box).
torch::Tensor decode_jpeg(const uint8_t* bytes, size_t size, const std::string& path, const DecodeOptions& options,
                          const std::function<CropBox(int64_t, int64_t)>& box_of = nullptr, CropBox* box = nullptr,
                          CropBox* decoded = nullptr) {
  jpeg_decompress_struct cinfo;
  JpegErrors errors{};
  torch::Tensor out;
  CropBox b;
  JDIMENSION x = 0, columns = 0;
  cinfo.err = jpeg_std_error(&errors.mgr);
  errors.mgr.error_exit = jpeg_fail;
  errors.mgr.emit_message = jpeg_message;
  if (setjmp(errors.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw CorruptImage(path, std::string("not a valid JPEG (") + errors.message + ")");
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, const_cast<unsigned char*>(bytes), static_cast<unsigned long>(size));  // const in newer libjpeg
  jpeg_read_header(&cinfo, TRUE);
  if (int64_t{cinfo.image_width} * int64_t{cinfo.image_height} > kMaxJpegPixels) {
    const std::string claimed = std::to_string(cinfo.image_width) + " x " + std::to_string(cinfo.image_height);
    jpeg_destroy_decompress(&cinfo);
    throw CorruptImage(path, "a JPEG header of " + claimed + " pixels, more than the " +
                                 std::to_string(kMaxJpegPixels) + " an image may have (Pillow's limit)");
  }
  // libjpeg-turbo converts grayscale and YCbCr to RGB itself; CMYK it only
  // passes through, and it is converted below.
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = jpeg_scale_denominator(cinfo.image_height, cinfo.image_width, options.min_side());
  jpeg_calc_output_dimensions(&cinfo);
  b = CropBox{0, 0, cinfo.output_height, cinfo.output_width};
  if (box_of) {
    try {
      b = checked_box(box_of(b.height, b.width), b.height, b.width);
    } catch (...) {
      jpeg_destroy_decompress(&cinfo);
      throw;
    }
  }
  jpeg_start_decompress(&cinfo);
  // The columns asked for reach kCropMargin past the box on each side:
  // libjpeg-turbo upsamples the chroma of a cropped row as if its ends were
  // the image's, so a box column next to either end would come out
  // differently from a whole decode (measured on a 4:2:0 file); a margin
  // of a chroma sample (up to 4 pixels) is enough, and 16 leaves room.
  // jpeg_crop_scanline widens the left end further, to a block boundary.
  constexpr int64_t kCropMargin = 16;
  x = static_cast<JDIMENSION>(std::max<int64_t>(b.left - kCropMargin, 0));
  columns = static_cast<JDIMENSION>(std::min<int64_t>(b.left + b.width + kCropMargin, cinfo.output_width) - x);
  if (columns < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x, &columns);
  const int64_t c = cinfo.output_components;
  out = torch::empty({b.height, static_cast<int64_t>(columns), c}, torch::kByte);
  uint8_t* base = out.data_ptr<uint8_t>();
  if (b.top > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(b.top));
  for (int64_t r = 0; r < b.height; ++r) {
    JSAMPROW row = base + r * static_cast<int64_t>(columns) * c;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  if (cinfo.output_scanline < cinfo.output_height || errors.truncated)
    jpeg_abort_decompress(&cinfo);  // the rows below the box are never decoded
  else
    jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (errors.truncated)
    throw CorruptImage(path, std::string("truncated JPEG (") + errors.message + ")");
  if (static_cast<int64_t>(columns) != b.width) out = out.narrow(1, b.left - x, b.width).contiguous();
  if (box) *box = b;
  if (decoded) *decoded = CropBox{b.top, static_cast<int64_t>(x), b.height, static_cast<int64_t>(columns)};
  return cmyk ? adobe_cmyk_to_rgb(out) : out;
}

// ---- PNG --------------------------------------------------------------------

struct PngSource {
  const uint8_t* data;
  size_t size, offset;
};

void png_read_memory(png_structp png, png_bytep out, png_size_t n) {
  auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > src->size - src->offset) png_error(png, "file ends early (truncated)");
  std::memcpy(out, src->data + src->offset, n);
  src->offset += n;
}

struct PngErrors {
  char message[256];
};

[[noreturn]] void png_fail(png_structp png, png_const_charp msg) {
  auto* e = static_cast<PngErrors*>(png_get_error_ptr(png));
  std::snprintf(e->message, sizeof e->message, "%s", msg);
  png_longjmp(png, 1);
}
// Warnings (e.g. a known-bad sRGB profile) leave a usable image; stay quiet.
void png_warn(png_structp, png_const_charp) {}

torch::Tensor decode_png(const uint8_t* bytes, size_t size, const std::string& path) {
  PngErrors errors{};
  PngSource src{bytes, size, 0};
  torch::Tensor out;
  std::vector<png_bytep> rows;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &errors, png_fail, png_warn);
  if (!png) throw std::bad_alloc();
  png_infop info = png_create_info_struct(png);
  if (!info) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    throw std::bad_alloc();
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw CorruptImage(path, std::string("not a valid PNG (") + errors.message + ")");
  }
  png_set_read_fn(png, &src, png_read_memory);
  png_read_info(png, info);
  // Deflate packs at most about 1032 bytes into one, so the rows a header
  // promises (a filter byte and the samples of each) must fit in that many
  // times the file's size. libpng allows 1,000,000 x 1,000,000 pixels: a
  // crafted header of a few hundred bytes would ask for 3 TB below.
  const int64_t height = png_get_image_height(png, info), width = png_get_image_width(png, info);
  const int64_t bits = int64_t{png_get_bit_depth(png, info)} * png_get_channels(png, info);
  const double row_bytes = static_cast<double>((width * bits + 7) / 8 + 1);
  if (row_bytes * static_cast<double>(height) > 1040.0 * static_cast<double>(size) + 4096) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw CorruptImage(path, "a PNG header of " + std::to_string(width) + " x " + std::to_string(height) +
                                 " pixels, more than its " + std::to_string(size) + " bytes can hold");
  }
  // To 8-bit RGB whatever the colour type: palette and low-bit gray are
  // expanded, 16-bit samples keep their high byte, alpha is dropped.
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const int64_t h = png_get_image_height(png, info), w = png_get_image_width(png, info);
  if (png_get_channels(png, info) != 3 || png_get_rowbytes(png, info) != static_cast<size_t>(w * 3))
    png_error(png, "unexpected layout after conversion to 8-bit RGB");
  out = torch::empty({h, w, 3}, torch::kByte);
  rows.resize(static_cast<size_t>(h));
  for (int64_t y = 0; y < h; ++y) rows[static_cast<size_t>(y)] = out.data_ptr<uint8_t>() + y * w * 3;
  png_read_image(png, rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  return out;
}

// ---- Encoders ---------------------------------------------------------------

struct File {
  explicit File(const std::string& path) : f(std::fopen(path.c_str(), "wb")) {
    if (!f) throw std::runtime_error(path + ": cannot open for writing");
  }
  ~File() {
    if (f) std::fclose(f);
  }
  std::FILE* f;
};

torch::Tensor checked_hwc(const torch::Tensor& hwc, const std::set<int64_t>& channels, const char* who) {
  TORCH_CHECK(hwc.dim() == 3 && hwc.scalar_type() == torch::kByte && channels.count(hwc.size(2)) &&
                  hwc.size(0) > 0 && hwc.size(1) > 0,
              who, ": wants a non-empty uint8 H x W x C image, got ", hwc.sizes(), " ", hwc.scalar_type());
  return hwc.contiguous();
}

void write_png_rows(const std::string& path, const torch::Tensor& pixels, int color_type,
                    const std::vector<png_color>* palette) {
  // Everything the jump may not skip is built before setjmp.
  File file(path);
  const int64_t stride = pixels.numel() / pixels.size(0);
  std::vector<png_bytep> rows(static_cast<size_t>(pixels.size(0)));
  for (size_t y = 0; y < rows.size(); ++y)
    rows[y] = const_cast<uint8_t*>(pixels.data_ptr<uint8_t>()) + static_cast<int64_t>(y) * stride;
  const auto h = static_cast<png_uint_32>(pixels.size(0)), w = static_cast<png_uint_32>(pixels.size(1));
  PngErrors errors{};
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &errors, png_fail, png_warn);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    throw std::bad_alloc();
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error(path + ": cannot write PNG (" + errors.message + ")");
  }
  png_init_io(png, file.f);
  png_set_IHDR(png, info, w, h, 8, color_type, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (palette) png_set_PLTE(png, info, palette->data(), static_cast<int>(palette->size()));
  png_set_rows(png, info, rows.data());
  png_write_png(png, info, PNG_TRANSFORM_IDENTITY, nullptr);
  png_destroy_write_struct(&png, &info);
}

}  // namespace

torch::Tensor decode_image(const uint8_t* bytes, size_t size, const std::string& path, const DecodeOptions& options) {
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size >= 8 && std::memcmp(bytes, kPng, 8) == 0) return decode_png(bytes, size, path);
  if (size >= 3 && bytes[0] == 0xff && bytes[1] == 0xd8 && bytes[2] == 0xff)
    return decode_jpeg(bytes, size, path, options);
  if (size == 0) throw CorruptImage(path, "empty file");
  throw CorruptImage(path, "neither a JPEG nor a PNG (unrecognised first bytes)");
}

torch::Tensor decode_image_box(const uint8_t* bytes, size_t size, const std::string& path, const DecodeOptions& options,
                               const std::function<CropBox(int64_t height, int64_t width)>& box_of, CropBox* box,
                               CropBox* decoded) {
  if (size >= 3 && bytes[0] == 0xff && bytes[1] == 0xd8 && bytes[2] == 0xff && ends_with_end_of_image(bytes, size)) {
    try {
      return decode_jpeg(bytes, size, path, options, box_of, box, decoded);
    } catch (const CorruptImage&) {
      // Decoded whole below: that reports a damaged file as decode_image
      // does, and decodes one whose crop libjpeg-turbo refuses.
    }
  }
  const auto full = decode_image(bytes, size, path, options);
  const CropBox b = checked_box(box_of(full.size(0), full.size(1)), full.size(0), full.size(1));
  if (box) *box = b;
  if (decoded) *decoded = CropBox{0, 0, full.size(0), full.size(1)};
  return full.narrow(0, b.top, b.height).narrow(1, b.left, b.width).contiguous();
}

std::vector<uint8_t> read_image_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw CorruptImage(path, "cannot open for reading");
  const std::streamoff size = f.tellg();
  if (size < 0) throw CorruptImage(path, "cannot read");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  f.seekg(0);
  if (size > 0 && !f.read(reinterpret_cast<char*>(bytes.data()), size)) throw CorruptImage(path, "read error");
  return bytes;
}

torch::Tensor decode_image_file(const std::string& path, const DecodeOptions& options) {
  const auto bytes = read_image_file(path);
  return decode_image(bytes.data(), bytes.size(), path, options);
}

std::optional<JpegInfo> plain_jpeg_info(const uint8_t* bytes, size_t size) {
  if (size < 4 || bytes[0] != 0xFF || bytes[1] != 0xD8 || !ends_with_end_of_image(bytes, size)) return std::nullopt;
  jpeg_decompress_struct cinfo;
  JpegErrors errors{};
  cinfo.err = jpeg_std_error(&errors.mgr);
  errors.mgr.error_exit = jpeg_fail;
  errors.mgr.emit_message = jpeg_message;
  if (setjmp(errors.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return std::nullopt;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, const_cast<unsigned char*>(bytes), static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  const bool colour = cinfo.jpeg_color_space == JCS_YCbCr && cinfo.num_components == 3;
  const bool gray = cinfo.jpeg_color_space == JCS_GRAYSCALE && cinfo.num_components == 1;
  // Too many pixels: not for the GPU either; decode_image says why.
  const bool plain = (colour || gray) && !cinfo.progressive_mode && !cinfo.arith_code &&
                     int64_t{cinfo.image_width} * int64_t{cinfo.image_height} <= kMaxJpegPixels;
  const JpegInfo info{cinfo.image_height, cinfo.image_width, cinfo.num_components};
  jpeg_destroy_decompress(&cinfo);
  if (!plain) return std::nullopt;
  return info;
}

void write_png(const std::string& path, const torch::Tensor& hwc) {
  const auto pixels = checked_hwc(hwc, {1, 3, 4}, "write_png");
  const int64_t c = pixels.size(2);
  write_png_rows(path, pixels, c == 1 ? PNG_COLOR_TYPE_GRAY : c == 3 ? PNG_COLOR_TYPE_RGB : PNG_COLOR_TYPE_RGBA, nullptr);
}

void write_palette_png(const std::string& path, const torch::Tensor& hwc) {
  auto rgb = checked_hwc(hwc, {1, 3}, "write_palette_png");
  if (rgb.size(2) == 1) rgb = rgb.expand({-1, -1, 3}).contiguous();
  const int64_t n = rgb.size(0) * rgb.size(1);
  const uint8_t* p = rgb.data_ptr<uint8_t>();
  std::vector<png_color> palette;
  auto indices = torch::empty({rgb.size(0), rgb.size(1)}, torch::kByte);
  uint8_t* idx = indices.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const png_color colour{p[3 * i], p[3 * i + 1], p[3 * i + 2]};
    size_t k = 0;
    while (k < palette.size() && std::memcmp(&palette[k], &colour, sizeof colour) != 0) ++k;
    if (k == palette.size()) {
      TORCH_CHECK(palette.size() < 256, "write_palette_png: more than 256 colours");
      palette.push_back(colour);
    }
    idx[i] = static_cast<uint8_t>(k);
  }
  write_png_rows(path, indices, PNG_COLOR_TYPE_PALETTE, &palette);
}

void write_jpeg(const std::string& path, const torch::Tensor& hwc, int quality) {
  const auto pixels = checked_hwc(hwc, {1, 3}, "write_jpeg");
  TORCH_CHECK(quality >= 1 && quality <= 100, "write_jpeg: quality ", quality, " outside 1..100");
  File file(path);
  jpeg_compress_struct cinfo;
  JpegErrors errors{};
  cinfo.err = jpeg_std_error(&errors.mgr);
  errors.mgr.error_exit = jpeg_fail;
  if (setjmp(errors.jump)) {
    jpeg_destroy_compress(&cinfo);
    throw std::runtime_error(path + ": cannot write JPEG (" + errors.message + ")");
  }
  jpeg_create_compress(&cinfo);
  jpeg_stdio_dest(&cinfo, file.f);
  cinfo.image_width = static_cast<JDIMENSION>(pixels.size(1));
  cinfo.image_height = static_cast<JDIMENSION>(pixels.size(0));
  cinfo.input_components = static_cast<int>(pixels.size(2));
  cinfo.in_color_space = pixels.size(2) == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  const int64_t stride = pixels.size(1) * pixels.size(2);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data_ptr<uint8_t>()) + static_cast<int64_t>(cinfo.next_scanline) * stride;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
}

}  // namespace ddp::data
