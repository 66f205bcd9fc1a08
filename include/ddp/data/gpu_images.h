// JPEG folders decoded on the GPU: batches that carry the files' bytes from
// the loader's threads to the device, where nvJPEG decodes them and one
// kernel crops, resizes, flips and normalises the batch (cuda/image_resample.h).
//
// The loader's threads still do the cheap part: read each file, read its
// JPEG header for the size, and draw the crop and flip with the same keyed
// draws as the CPU path (transform_window). Files nvJPEG does not take as
// they are (PNG, progressive or CMYK JPEGs, files cut short or with a
// damaged header) are decoded on those threads as before and travel as
// pixels; corrupt files are reported by path and replaced by the next
// file that decodes, exactly as on the CPU path. On the device, nvJPEG
// decodes the rest in one batched call (with the GPU's hardware JPEG
// engine where it has one), and a file it rejects is decoded on the CPU
// instead. So batches are a function of (seed, epoch, rank) on both paths.
//
// How the two paths differ: the crops, flips and filters are the same, but
// nvJPEG's inverse DCT and chroma upsampling are not libjpeg-turbo's, so
// pixels differ by a few levels (bounded in tests/data/gpu_images_test.cpp),
// and the GPU path decodes every file at full size where the CPU path may
// decode a large JPEG at 1/2, 1/4 or 1/8 scale (image_codec.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ddp/data/dataset.h"
#include "ddp/data/image_transforms.h"

namespace ddp::data {

/// The two tensors of an encoded batch, besides "target".
inline constexpr const char* kEncodedBytes = "encoded_bytes";    // uint8 [total bytes]
inline constexpr const char* kEncodedImages = "encoded_images";  // int64 [N, kEncodedColumns]

enum EncodedKind : int64_t {
  kEncodedJpeg = 0,  // a plain JPEG file's bytes, for nvJPEG
  kEncodedRgb = 1,   // pixels decoded on the CPU: height x width x 3 bytes
};

enum EncodedColumn : int {
  kEcKind = 0,
  kEcByteOffset,  // into encoded_bytes
  kEcByteLength,
  kEcHeight,      // of the full image
  kEcWidth,
  kEcIndex,       // the dataset index whose file this is (after any replacement)
  kEcPosition,    // the sample's position in this rank's epoch order
  kEcTop,         // TransformWindow, in image pixels
  kEcLeft,
  kEcWindowHeight,
  kEcWindowWidth,
  kEcResizedHeight,
  kEcResizedWidth,
  kEcOffsetY,
  kEcOffsetX,
  kEcFlip,
  kEcSeed,        // the draw key, for a replacement decoded on the CPU
  kEcEpoch,
  kEcRank,
  kEncodedColumns
};

/// One sample of an encoded batch, as a loader thread prepares it.
struct EncodedSample {
  EncodedKind kind = kEncodedJpeg;
  std::vector<uint8_t> bytes;  // the file, or H x W x 3 pixels
  int64_t height = 0, width = 0, index = 0, label = 0;
  TransformWindow window;
};

/// The sample nvJPEG decodes from `bytes` when they are a plain JPEG
/// (plain_jpeg_info): its size from the header and the CPU path's window
/// for (key, position), the bytes moved in. nullopt, the bytes untouched,
/// for any other file.
std::optional<EncodedSample> plain_jpeg_sample(std::vector<uint8_t>& bytes, int64_t index, int64_t label,
                                               const ImageTransformOptions& transform, const DrawKey& key,
                                               int64_t position);

/// Stacks samples into {encoded_bytes, encoded_images, target}.
TensorDict encoded_batch(const std::vector<EncodedSample>& samples, const DrawKey& key, int64_t first_position);

/// A decoded replacement for a sample nvJPEG could not decode: what the CPU
/// path gives for (index, key, position), as pixels with its window.
using CpuDecode = std::function<EncodedSample(int64_t index, const DrawKey& key, int64_t position)>;

/// True when this build decodes JPEGs with nvJPEG and a CUDA device is present.
bool gpu_jpeg_available();

/// Whether --image-decode `mode` (auto, cpu or gpu) takes the GPU stage for
/// training on `device`: gpu always (checked elsewhere), auto on a CUDA
/// device of a build with nvJPEG.
bool gpu_decode_chosen(const std::string& mode, const torch::Device& device);

/// The device stage of an image folder with GPU decoding: turns
/// {encoded_bytes, encoded_images, target} into {input, target}, input
/// float32 N x 3 x S x S on the device as the CPU path makes it.
/// `in_flight` batches may be decoding at once (1 or more; see
/// ImageFolderOptions::gpu_decode_in_flight). UserError if
/// !gpu_jpeg_available().
std::shared_ptr<DeviceStage> make_gpu_jpeg_stage(const ImageTransformOptions& transform, int64_t in_flight,
                                                 CpuDecode cpu_decode);

}  // namespace ddp::data
