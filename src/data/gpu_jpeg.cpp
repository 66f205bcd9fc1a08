// The GPU stage of image folders: nvJPEG batched decode, then one resample
// kernel (gpu_images.h). Built only with CUDA LibTorch and nvJPEG's header
// and library (CMake defines DDP_WITH_NVJPEG); elsewhere make_gpu_jpeg_stage
// refuses with a hint (gpu_images.cpp).
#ifdef DDP_WITH_NVJPEG
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <nvjpeg.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ddp/cuda/image_resample.h"
#include "ddp/program.h"
#include "ddp/data/gpu_images.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

const char* nvjpeg_status_name(nvjpegStatus_t s) {
  switch (s) {
    case NVJPEG_STATUS_SUCCESS: return "success";
    case NVJPEG_STATUS_NOT_INITIALIZED: return "not initialized";
    case NVJPEG_STATUS_INVALID_PARAMETER: return "invalid parameter";
    case NVJPEG_STATUS_BAD_JPEG: return "bad JPEG";
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED: return "JPEG not supported";
    case NVJPEG_STATUS_ALLOCATOR_FAILURE: return "allocator failure";
    case NVJPEG_STATUS_EXECUTION_FAILED: return "execution failed";
    case NVJPEG_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case NVJPEG_STATUS_INTERNAL_ERROR: return "internal error";
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED: return "implementation not supported";
    default: return "error";
  }
}

void check_nvjpeg(nvjpegStatus_t s, const char* what) {
  TORCH_CHECK(s == NVJPEG_STATUS_SUCCESS, "nvJPEG ", what, " failed: ", nvjpeg_status_name(s), " (", static_cast<int>(s), ")");
}

// One decoder per device and process: the hardware engine's handle where
// the GPU has one (A100, H100, H200), and the CUDA decoder, which takes
// what the engine refuses and decodes single files. Both allocate through
// nvJPEG's own allocators; their buffers are reused from batch to batch.
//
// Batched decodes go through slots, used in turn: each has its own nvJPEG
// state, its own buffer for the decoded pixels, and the event and file
// bytes of the batch it last decoded. A slot is reused only once that batch
// is done (a host wait on its event), so with two slots the host parses
// batch k+1 while the engine decodes batch k. The slots live here, not in a
// stage, because every stage on a device (training, evaluation) shares
// them, possibly from different streams.
//
// Why the pixels have a buffer of the slot's own: nvJPEG's hardware engine
// writes its output without waiting for the work already queued on the
// stream it is given (torchcodec#1634, vision#9606). A block from the
// caching allocator is handed out as soon as it is freed on the stream,
// while queued kernels may still read it, and the engine overwrote it: a
// --cuda-graph run of ResNet-50 from JPEGs validated to test_loss nan on
// the H200 (bench/RESULTS.md, session 9). A slot's buffer is free once
// take_slot has waited for its last batch; a new one (the first, or a
// larger one) is used only after the stream has drained.
struct Decoder {
  struct Slot {
    nvjpegJpegState_t state = nullptr;
    int initialized_batch = 0;
    at::cuda::CUDAEvent done;
    torch::Tensor bytes;   // the host bytes the decode may still read
    torch::Tensor pixels;  // uint8 on the device, reused from batch to batch
  };
  nvjpegHandle_t batched = nullptr;  // hardware if available, else default
  nvjpegHandle_t single = nullptr;
  nvjpegJpegState_t single_state = nullptr;
  bool hardware = false;
  bool announced = false;  // said which decoder it is, at its first JPEG
  std::vector<std::unique_ptr<Slot>> slots;
  size_t next_slot = 0;
  std::mutex mutex;  // one stage at a time

  Decoder() {
    hardware = nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &batched) == NVJPEG_STATUS_SUCCESS;
    if (!hardware) check_nvjpeg(nvjpegCreateEx(NVJPEG_BACKEND_DEFAULT, nullptr, nullptr, 0, &batched), "create");
    check_nvjpeg(nvjpegCreateEx(NVJPEG_BACKEND_DEFAULT, nullptr, nullptr, 0, &single), "create");
    check_nvjpeg(nvjpegJpegStateCreate(single, &single_state), "state create");
  }
  // No destructor: decoder_for() never destroys a decoder (see there).
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // The next slot of `in_flight`, free: its previous batch is decoded.
  Slot& take_slot(size_t in_flight) {
    while (slots.size() < in_flight) {
      slots.push_back(std::make_unique<Slot>());
      check_nvjpeg(nvjpegJpegStateCreate(batched, &slots.back()->state), "state create");
    }
    Slot& slot = *slots[next_slot % in_flight];
    next_slot = (next_slot + 1) % in_flight;
    if (slot.bytes.defined()) {
      slot.done.synchronize();
      slot.bytes = torch::Tensor();
    }
    return slot;
  }

  // `slot`'s pixel buffer, at least `bytes` long, safe for the engine to
  // write now (see above). It grows with 25% headroom, so a run with images
  // of varying sizes drains the stream a few times, not at every batch.
  static torch::Tensor pixels_of(Slot& slot, int64_t bytes, torch::Device device, const c10::cuda::CUDAStream& stream) {
    bytes = std::max<int64_t>(bytes, 1);
    if (!slot.pixels.defined() || slot.pixels.numel() < bytes) {
      slot.pixels = torch::Tensor();  // its last batch is done: take_slot waited
      slot.pixels = torch::empty({bytes + bytes / 4}, torch::TensorOptions().dtype(torch::kByte).device(device));
      stream.synchronize();  // whatever queued work used this memory before is done
    }
    return slot.pixels.narrow(0, 0, bytes);
  }
};

// The decoders live as long as the process and are never destroyed: at exit
// the CUDA context and LibTorch's host allocator may already be gone, and
// freeing a slot's event or pinned bytes then aborts the process.
Decoder& decoder_for(int device) {
  static std::mutex mutex;
  static auto& decoders = *new std::map<int, std::unique_ptr<Decoder>>;
  std::lock_guard<std::mutex> lock(mutex);
  auto& d = decoders[device];
  if (!d) d = std::make_unique<Decoder>();
  return *d;
}

class GpuJpegStage : public DeviceStage {
 public:
  GpuJpegStage(const ImageTransformOptions& transform, int64_t in_flight, CpuDecode cpu_decode)
      : size_(transform.size()), in_flight_(static_cast<size_t>(in_flight)), cpu_decode_(std::move(cpu_decode)) {
    TORCH_CHECK(in_flight >= 1, "GPU JPEG stage: in_flight must be at least 1, got ", in_flight);
    TORCH_CHECK(transform.mean().size() == 3 && transform.std().size() == 3, "GPU JPEG stage: mean and std need 3 values");
    for (int c = 0; c < 3; ++c) mean_[c] = transform.mean()[c], std_[c] = transform.std()[c];
  }

  void run(TensorDict& batch, torch::Device device) override {
    if (!batch.contains(kEncodedImages)) return;
    TORCH_CHECK(device.is_cuda(), "the GPU JPEG stage needs a CUDA device, got ", device.str());
    const c10::cuda::CUDAGuard guard(device);
    const auto stream = at::cuda::getCurrentCUDAStream(device.index());
    Decoder& dec = decoder_for(device.index());
    const std::lock_guard<std::mutex> lock(dec.mutex);
    Decoder::Slot& slot = dec.take_slot(in_flight_);
    torch::Tensor bytes = batch.at(kEncodedBytes);
    torch::Tensor images = batch.at(kEncodedImages).contiguous();
    torch::Tensor& target = batch.target();
    const int64_t n = images.size(0);
    TORCH_CHECK(images.dim() == 2 && images.size(1) == kEncodedColumns && bytes.scalar_type() == torch::kByte,
                "GPU JPEG stage: malformed encoded batch");
    auto* rows = images.data_ptr<int64_t>();
    const uint8_t* host = bytes.data_ptr<uint8_t>();

    // Decoded pixels, image after image, each at a 256-byte boundary.
    std::vector<int64_t> where(static_cast<size_t>(n));
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* r = rows + i * kEncodedColumns;
      where[static_cast<size_t>(i)] = total;
      total += (r[kEcHeight] * r[kEcWidth] * 3 + 255) / 256 * 256;
    }
    torch::Tensor pixels = Decoder::pixels_of(slot, total, device, stream);

    std::vector<int64_t> jpegs, failed;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* r = rows + i * kEncodedColumns;
      if (r[kEcKind] == kEncodedJpeg) {
        jpegs.push_back(i);
      } else {
        pixels.narrow(0, where[static_cast<size_t>(i)], r[kEcByteLength])
            .copy_(bytes.narrow(0, r[kEcByteOffset], r[kEcByteLength]), /*non_blocking=*/true);
      }
    }
    auto destination = [&](int64_t i) {
      const int64_t* r = rows + i * kEncodedColumns;
      nvjpegImage_t out{};
      out.channel[0] = pixels.data_ptr<uint8_t>() + where[static_cast<size_t>(i)];
      out.pitch[0] = static_cast<size_t>(r[kEcWidth] * 3);
      return out;
    };
    if (!jpegs.empty() && !dec.announced) {
      dec.announced = true;
      std::fprintf(stderr, "%s: decoding JPEGs on GPU %d with nvJPEG (%s)\n", program_name(), static_cast<int>(device.index()),
                   dec.hardware ? "hardware engine" : "CUDA decoder");
    }
    if (!jpegs.empty()) {
      std::vector<const unsigned char*> data;
      std::vector<size_t> lengths;
      std::vector<nvjpegImage_t> outs;
      for (int64_t i : jpegs) {
        const int64_t* r = rows + i * kEncodedColumns;
        data.push_back(host + r[kEcByteOffset]);
        lengths.push_back(static_cast<size_t>(r[kEcByteLength]));
        outs.push_back(destination(i));
      }
      const int count = static_cast<int>(jpegs.size());
      nvjpegStatus_t s = NVJPEG_STATUS_SUCCESS;
      if (slot.initialized_batch != count) {
        s = nvjpegDecodeBatchedInitialize(dec.batched, slot.state, count, 1, NVJPEG_OUTPUT_RGBI);
        slot.initialized_batch = s == NVJPEG_STATUS_SUCCESS ? count : 0;
      }
      if (s == NVJPEG_STATUS_SUCCESS)
        s = nvjpegDecodeBatched(dec.batched, slot.state, data.data(), lengths.data(), outs.data(), stream.stream());
      if (s != NVJPEG_STATUS_SUCCESS) {
        // One file the batch call refuses fails the call: decode them one by
        // one, and leave those the CUDA decoder refuses too to the CPU.
        for (size_t k = 0; k < jpegs.size(); ++k) {
          if (nvjpegDecode(dec.single, dec.single_state, data[k], lengths[k], NVJPEG_OUTPUT_RGBI, &outs[k],
                           stream.stream()) != NVJPEG_STATUS_SUCCESS)
            failed.push_back(jpegs[k]);
        }
      }
    }
    if (!failed.empty()) pixels = replace_on_cpu(failed, rows, target, pixels, where, device);

    // The geometry table of the resample kernel, in pinned memory: a copy
    // from pageable memory would wait for the decode on this stream, and
    // hold up the training thread (the caching host allocator keeps the
    // block until the asynchronous copy is done).
    auto geometry = torch::empty({n, cuda::kResampleColumns},
                                 torch::TensorOptions().dtype(torch::kLong).pinned_memory(true));
    auto* g = geometry.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* r = rows + i * kEncodedColumns;
      int64_t* o = g + i * cuda::kResampleColumns;
      o[cuda::kPixelOffset] = where[static_cast<size_t>(i)];
      o[cuda::kImageWidth] = r[kEcWidth];
      o[cuda::kTop] = r[kEcTop];
      o[cuda::kLeft] = r[kEcLeft];
      o[cuda::kWindowHeight] = r[kEcWindowHeight];
      o[cuda::kWindowWidth] = r[kEcWindowWidth];
      o[cuda::kVirtualHeight] = r[kEcResizedHeight];
      o[cuda::kVirtualWidth] = r[kEcResizedWidth];
      o[cuda::kOffsetY] = r[kEcOffsetY];
      o[cuda::kOffsetX] = r[kEcOffsetX];
      o[cuda::kFlip] = r[kEcFlip];
    }
    auto input = torch::empty({n, 3, size_, size_}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    cuda::resample_normalize(pixels, geometry.to(device, /*non_blocking=*/true), input, mean_, std_);
    slot.done.record(stream);
    slot.bytes = bytes;
    TensorDict out{{"input", input}, {"target", target}};
    for (const auto& [name, t] : batch)  // a task's own fields (shards.h) ride along
      if (name != kEncodedBytes && name != kEncodedImages && !out.contains(name)) out[name] = t;
    batch = std::move(out);
  }

 private:
  // Decodes `failed` rows on the CPU (the CPU path's decode, which reports
  // corrupt files and replaces them by the next that decodes), rewrites
  // their rows and labels, and returns pixels with theirs appended.
  torch::Tensor replace_on_cpu(const std::vector<int64_t>& failed, int64_t* rows, torch::Tensor& target,
                               const torch::Tensor& pixels, std::vector<int64_t>& where, torch::Device device) {
    std::vector<torch::Tensor> parts{pixels};
    int64_t end = pixels.numel();
    for (int64_t i : failed) {
      int64_t* r = rows + i * kEncodedColumns;
      const DrawKey key{static_cast<uint64_t>(r[kEcSeed]), r[kEcEpoch], r[kEcRank]};
      EncodedSample s = cpu_decode_(r[kEcIndex], key, r[kEcPosition]);
      auto hwc = torch::from_blob(s.bytes.data(), {static_cast<int64_t>(s.bytes.size())}, torch::kByte).clone();
      const int64_t padded = (hwc.numel() + 255) / 256 * 256;
      parts.push_back(torch::constant_pad_nd(hwc, {0, padded - hwc.numel()}).to(device));
      where[static_cast<size_t>(i)] = end;
      end += padded;
      r[kEcHeight] = s.height, r[kEcWidth] = s.width, r[kEcIndex] = s.index;
      r[kEcTop] = s.window.source.top, r[kEcLeft] = s.window.source.left;
      r[kEcWindowHeight] = s.window.source.height, r[kEcWindowWidth] = s.window.source.width;
      r[kEcResizedHeight] = s.window.resized_height, r[kEcResizedWidth] = s.window.resized_width;
      r[kEcOffsetY] = s.window.offset_y, r[kEcOffsetX] = s.window.offset_x, r[kEcFlip] = s.window.flip;
      target[i] = s.label;
    }
    return torch::cat(parts);
  }

  int64_t size_;
  size_t in_flight_;
  CpuDecode cpu_decode_;
  std::array<double, 3> mean_{}, std_{};
};

}  // namespace

bool gpu_jpeg_available() { return torch::cuda::is_available(); }

std::shared_ptr<DeviceStage> make_gpu_jpeg_stage(const ImageTransformOptions& transform, int64_t in_flight,
                                                 CpuDecode cpu_decode) {
  return std::make_shared<GpuJpegStage>(transform, in_flight, std::move(cpu_decode));
}

}  // namespace ddp::data

#endif  // DDP_WITH_NVJPEG
