// JPEG and PNG files to and from uint8 pixel tensors.
//
// Decoding uses libjpeg(-turbo) and libpng, the libraries Debian ships and
// PIL itself links. Every decoded image comes out as 3-channel RGB, H x W x 3:
// grayscale is replicated to three channels, palette images are expanded,
// 16-bit samples are reduced to 8 bits, and an alpha channel is dropped (not
// composited), which is what PIL's convert("RGB") does in torchvision's
// default loader. One channel count for every file keeps a folder of mixed
// images stackable into one batch. CMYK (and YCCK) JPEGs are read the way
// Adobe software writes them, inverted, whether or not the file carries
// Adobe's marker, and become RGB = (255 - C)(255 - K) / 255, rounded: both
// exactly as PIL 9 does.
//
// A file that cannot be decoded, including a truncated JPEG (which libjpeg
// would otherwise pad with grey and only warn about), raises CorruptImage
// with the path and the library's reason. The format is told by the file's
// first bytes, not its name, so a PNG saved as .jpg still loads.
//
// A caller that will shrink the image anyway can say how small it may come
// out (DecodeOptions::min_side). A JPEG is then decoded at 1/2, 1/4 or 1/8
// of its size when that still leaves its shorter side at least min_side:
// libjpeg-turbo scales in the DCT domain, so a 2000 x 1500 photo decoded at
// 1/4 skips most of the inverse DCT, colour conversion and chroma
// upsampling, and the resize after it has 1/16 of the pixels to read. These
// are the scales PIL's Image.draft() picks from, and the pixels are the
// ones draft() gives (the same library call). PNGs, and JPEGs too small to
// halve, are decoded at full size. The scale depends only on the file's
// dimensions and min_side, so a file always decodes the same way.
//
// The encoders exist for tests and the loader benchmark, which need real
// files without depending on an image tool being installed.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddp::data {

/// A file that is not a decodable JPEG or PNG. what() is
/// "<path>: <reason>"; path() and reason() give the two parts.
class CorruptImage : public std::runtime_error {
 public:
  CorruptImage(std::string path, std::string reason)
      : std::runtime_error(path + ": " + reason), path_(std::move(path)), reason_(std::move(reason)) {}
  const std::string& path() const { return path_; }
  const std::string& reason() const { return reason_; }

 private:
  std::string path_, reason_;
};

struct DecodeOptions {
  /// The shorter side, in pixels, the caller needs at least; 0: full size.
  /// A JPEG comes out at the smallest of 1/2, 1/4 and 1/8 of its size (each
  /// side rounded up, as libjpeg does) whose shorter side is still >=
  /// min_side, or at full size when none is; never larger than the file.
  TORCH_ARG(int64_t, min_side) = 0;
};

/// Reads and decodes a JPEG or PNG file into uint8 H x W x 3 (RGB).
/// Throws CorruptImage if the file is unreadable, of another format, or
/// damaged.
torch::Tensor decode_image_file(const std::string& path, const DecodeOptions& options = DecodeOptions());

/// Decodes JPEG or PNG bytes already in memory; `path` only names the
/// source in errors.
torch::Tensor decode_image(const uint8_t* bytes, size_t size, const std::string& path,
                           const DecodeOptions& options = DecodeOptions());

/// A rectangle of an image, in pixels: rows [top, top + height), columns
/// [left, left + width).
struct CropBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
};

/// decode_image cut to one box: `box_of` gets the height and width that
/// decode_image would return (after any scaling by `options`) and returns
/// the box, which `box` receives; the result holds the same pixels as
/// decode_image(...) narrowed to it. A crop that is resized afterwards (the
/// random-resized crop) only needs these, and a JPEG that ends with its
/// end-of-image marker is decoded only as far as the box needs:
/// libjpeg-turbo leaves out the inverse DCT and colour conversion of the
/// rows above it (jpeg_skip_scanlines) and of the columns beside it, to
/// within a block (jpeg_crop_scanline), and the decode stops after the
/// box's last row. Any other file (PNG, a JPEG cut short, one that
/// libjpeg-turbo will not crop) is decoded whole and cut, so a damaged file
/// is still reported as decode_image reports it. `decoded`, if given,
/// receives the part that was decoded: the box's rows and whole blocks of
/// columns around it, or the whole image.
torch::Tensor decode_image_box(const uint8_t* bytes, size_t size, const std::string& path, const DecodeOptions& options,
                               const std::function<CropBox(int64_t height, int64_t width)>& box_of, CropBox* box,
                               CropBox* decoded = nullptr);

/// The bytes of an image file. Throws CorruptImage if it cannot be read.
std::vector<uint8_t> read_image_file(const std::string& path);

/// Height, width and components (1 or 3) of a sequential, Huffman-coded
/// JPEG in YCbCr or grayscale that ends with its end-of-image marker: the
/// files a GPU decoder (nvJPEG) takes as they are. Anything else (PNG,
/// progressive, CMYK, a file cut short or with a damaged header) gives
/// nullopt, and is decoded on the CPU with decode_image, which reports it
/// by path if it is corrupt. Reads the header only.
struct JpegInfo {
  int64_t height = 0, width = 0;
  int components = 0;
};
std::optional<JpegInfo> plain_jpeg_info(const uint8_t* bytes, size_t size);

/// Writes uint8 H x W x C (C = 1 gray, 3 RGB, 4 RGBA) as an 8-bit PNG.
/// Throws std::runtime_error if the file cannot be written.
void write_png(const std::string& path, const torch::Tensor& hwc);

/// Writes uint8 H x W x C (C = 1 or 3) as a palette PNG; the image must use
/// at most 256 distinct colours. For tests of palette decoding.
void write_palette_png(const std::string& path, const torch::Tensor& hwc);

/// Writes uint8 H x W x C (C = 1 or 3) as a baseline JPEG of `quality` 1..100.
void write_jpeg(const std::string& path, const torch::Tensor& hwc, int quality = 90);

}  // namespace ddp::data
