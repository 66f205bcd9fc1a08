// Crop-and-flip augmentation with keyed random draws.
#include "ddp/data/transforms.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>

#include "ddp/data/counter_rng.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

constexpr uint64_t kTagAugment = 0x61756732;

}  // namespace

int64_t crop_padding(const AugmentOptions& options, int64_t width) {
  if (options.pad().has_value()) return *options.pad();
  return width >= 32 ? 4 : 2;
}

torch::Tensor augment(const torch::Tensor& input, const AugmentOptions& options,
                      const DrawKey& key, int64_t first_position) {
  TORCH_CHECK(input.dim() == 4 && input.scalar_type() == torch::kFloat,
              "augment() wants a float32 B x C x H x W batch, got ", input.sizes(), " ",
              input.scalar_type());
  const int64_t B = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  const int64_t pad = options.crop() ? crop_padding(options, W) : 0;
  check_user(pad >= 0 && pad < std::min(H, W),
             "crop padding " + std::to_string(pad) + " does not fit " + std::to_string(H) + " x " +
                 std::to_string(W) + " images.",
             "use a padding between 0 and " + std::to_string(std::min(H, W) - 1) + ".");
  const auto& fill = options.fill();
  check_user(fill.empty() || fill.size() == static_cast<size_t>(C),
             "augmentation fill has " + std::to_string(fill.size()) + " values for " +
                 std::to_string(C) + " channels.",
             "give one value per channel, or none for 0.");

  const torch::Tensor src_t = input.contiguous();
  torch::Tensor out_t = torch::empty_like(src_t);
  const float* src = src_t.data_ptr<float>();
  float* out = out_t.data_ptr<float>();
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      KeyedRandom rng(hash_words({key.seed, kTagAugment, static_cast<uint64_t>(key.epoch),
                                  static_cast<uint64_t>(key.rank),
                                  static_cast<uint64_t>(first_position + b)}));
      // Draw all three even when unused, so turning one option off leaves
      // the others' draws unchanged.
      const int64_t oy = rng.below(2 * pad + 1) - pad;
      const int64_t ox = rng.below(2 * pad + 1) - pad;
      const bool coin = (rng.next() >> 63) != 0;
      const bool mirror = options.flip() && coin;
      for (int64_t c = 0; c < C; ++c) {
        const float border = fill.empty() ? 0.0f : static_cast<float>(fill[c]);
        const float* plane = src + (b * C + c) * H * W;
        float* dst = out + (b * C + c) * H * W;
        // Output pixel (y, x) shows input pixel (y + oy, x + ox) of the
        // shifted crop, read mirrored when flipping.
        for (int64_t y = 0; y < H; ++y) {
          const int64_t sy = y + oy;
          for (int64_t x = 0; x < W; ++x) {
            const int64_t sx = (mirror ? W - 1 - x : x) + ox;
            dst[y * W + x] = sy >= 0 && sy < H && sx >= 0 && sx < W ? plane[sy * W + sx] : border;
          }
        }
      }
    }
  });
  return out_t;
}

Transform make_augment(AugmentOptions options) {
  return [options = std::move(options)](Batch& batch, const DrawKey& key, int64_t first_position) {
    batch.input() = augment(batch.input(), options, key, first_position);
  };
}

bool augment_applies(const std::string& mode, bool builtin_data, const Splits& data) {
  if (mode == "none" || (mode == "auto" && !builtin_data) || data.train_augmented || data.train->size() == 0) return false;
  // One example tells: a dataset gives the same names and ranks throughout.
  const Example first = data.train->get(0);
  const bool image = first.contains("input") && first.at("input").dim() == 3 && first.at("input").is_floating_point();
  if (image) return true;
  std::string has;
  for (const auto& name : first.names())
    has += (has.empty() ? "" : ", ") + name + " " + c10::str(first.at(name).sizes());
  check_user(mode == "auto",
             "--augment " + mode + " crops and flips images, but " + data.train->name() +
                 " holds no float \"input\" image C x H x W (its examples hold " + has + ").",
             "drop --augment (or set config.augment = \"none\" in add_flags): it applies to image data only.");
  return false;
}

}  // namespace ddp::data
