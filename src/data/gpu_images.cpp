// Encoded batches (gpu_images.h); the nvJPEG stage itself is gpu_jpeg.cpp.
#include "ddp/data/gpu_images.h"

#include <cstring>

#include "ddp/data/image_codec.h"
#include "ddp/error.h"

namespace ddp::data {

std::optional<EncodedSample> plain_jpeg_sample(std::vector<uint8_t>& bytes, int64_t index, int64_t label,
                                               const ImageTransformOptions& transform, const DrawKey& key,
                                               int64_t position) {
  const auto info = plain_jpeg_info(bytes.data(), bytes.size());
  if (!info) return std::nullopt;
  EncodedSample s;
  s.kind = kEncodedJpeg;
  s.height = info->height;
  s.width = info->width;
  s.index = index;
  s.label = label;
  s.window = transform_window(s.height, s.width, transform, key, position);
  s.bytes = std::move(bytes);
  return s;
}

TensorDict encoded_batch(const std::vector<EncodedSample>& samples, const DrawKey& key, int64_t first_position) {
  const auto n = static_cast<int64_t>(samples.size());
  int64_t total = 0;
  for (const auto& s : samples) total += static_cast<int64_t>(s.bytes.size());
  auto bytes = torch::empty({total}, torch::kByte);
  auto images = torch::empty({n, kEncodedColumns}, torch::kLong);
  auto target = torch::empty({n}, torch::kLong);
  uint8_t* b = bytes.data_ptr<uint8_t>();
  int64_t* labels = target.data_ptr<int64_t>();
  int64_t* r = images.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i, r += kEncodedColumns) {
    const EncodedSample& s = samples[static_cast<size_t>(i)];
    if (!s.bytes.empty()) std::memcpy(b + offset, s.bytes.data(), s.bytes.size());
    const TransformWindow& w = s.window;
    const int64_t row[kEncodedColumns] = {s.kind, offset, static_cast<int64_t>(s.bytes.size()), s.height, s.width,
                                          s.index, first_position + i, w.source.top, w.source.left, w.source.height,
                                          w.source.width, w.resized_height, w.resized_width, w.offset_y, w.offset_x,
                                          w.flip ? 1 : 0, static_cast<int64_t>(key.seed), key.epoch, key.rank};
    std::memcpy(r, row, sizeof row);
    labels[i] = s.label;
    offset += static_cast<int64_t>(s.bytes.size());
  }
  return TensorDict{{kEncodedBytes, bytes}, {kEncodedImages, images}, {"target", target}};
}

bool gpu_decode_chosen(const std::string& mode, const torch::Device& device) {
  return mode == "gpu" || (mode == "auto" && device.is_cuda() && gpu_jpeg_available());
}

#ifndef DDP_WITH_NVJPEG
bool gpu_jpeg_available() { return false; }

std::shared_ptr<DeviceStage> make_gpu_jpeg_stage(const ImageTransformOptions&, int64_t, CpuDecode) {
  throw UserError("--image-decode gpu needs a CUDA build of ddptrain with nvJPEG (libnvjpeg and nvjpeg.h from the "
                  "CUDA toolkit), and this build has none.",
                  "use --image-decode cpu, or rebuild on a machine with the CUDA toolkit's nvJPEG.");
}
#endif

}  // namespace ddp::data
