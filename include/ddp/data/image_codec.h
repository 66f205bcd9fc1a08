// JPEG and PNG files to and from uint8 pixel tensors.
//
// Decoding uses libjpeg(-turbo) and libpng, the libraries Debian ships and
// PIL itself links. Every decoded image comes out as 3-channel RGB, H x W x 3:
// grayscale is replicated to three channels, palette images are expanded,
// 16-bit samples are reduced to 8 bits, and an alpha channel is dropped (not
// composited), which is what PIL's convert("RGB") does in torchvision's
// default loader. One channel count for every file keeps a folder of mixed
// images stackable into one batch.
//
// A file that cannot be decoded, including a truncated JPEG (which libjpeg
// would otherwise pad with grey and only warn about), raises CorruptImage
// with the path and the library's reason. The format is told by the file's
// first bytes, not its name, so a PNG saved as .jpg still loads.
//
// The encoders exist for tests and the loader benchmark, which need real
// files without depending on an image tool being installed.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

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

/// Reads and decodes a JPEG or PNG file into uint8 H x W x 3 (RGB).
/// Throws CorruptImage if the file is unreadable, of another format, or
/// damaged.
torch::Tensor decode_image_file(const std::string& path);

/// Decodes JPEG or PNG bytes already in memory; `path` only names the
/// source in errors.
torch::Tensor decode_image(const uint8_t* bytes, size_t size, const std::string& path);

/// Writes uint8 H x W x C (C = 1 gray, 3 RGB, 4 RGBA) as an 8-bit PNG.
/// Throws std::runtime_error if the file cannot be written.
void write_png(const std::string& path, const torch::Tensor& hwc);

/// Writes uint8 H x W x C (C = 1 or 3) as a palette PNG; the image must use
/// at most 256 distinct colours. For tests of palette decoding.
void write_palette_png(const std::string& path, const torch::Tensor& hwc);

/// Writes uint8 H x W x C (C = 1 or 3) as a baseline JPEG of `quality` 1..100.
void write_jpeg(const std::string& path, const torch::Tensor& hwc, int quality = 90);

}  // namespace ddp::data
