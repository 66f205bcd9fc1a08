// Training-time augmentation: random crop with padding, horizontal flip.
//
// The random draws for a sample depend only on (seed, epoch, rank, position),
// where position is the sample's place in this rank's order for the epoch.
// Which worker thread builds a batch, and how many there are, therefore never
// changes the result, and a resumed run replays the same augmentations.
//
// Augmentation works on normalised float batches B x C x H x W, after the
// dataset's normalisation. The crop's border is filled with `fill` per
// channel, 0 by default: after normalisation 0 is the dataset's mean colour,
// not black. Pass fill = -mean / std per channel to pad with black pixels
// as torchvision's RandomCrop does before normalising.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/data/dataset.h"

namespace ddp::data {

// DrawKey (what a sample's random draws depend on) lives in dataset.h.

/// A batch transform. `first_position` is the position of the batch's first
/// sample in this rank's order for the epoch; sample j of the batch sits at
/// first_position + j. Must be safe to call from several threads at once.
using Transform = std::function<void(Batch& batch, const DrawKey& key, int64_t first_position)>;

struct AugmentOptions {
  /// Shift the image by up to `pad` pixels each way, filling the border
  /// (a random crop of the image padded by `pad` on every side).
  TORCH_ARG(bool, crop) = true;
  /// Padding for the crop; unset: 4 for images 32 pixels or wider, else 2.
  TORCH_ARG(std::optional<int64_t>, pad) = std::nullopt;
  /// Mirror left-right with probability 1/2.
  TORCH_ARG(bool, flip) = true;
  /// Border value per channel, in normalised units; empty: 0 in every channel.
  TORCH_ARG(std::vector<double>, fill) = {};
};

/// The padding augment() uses for images `width` pixels wide.
int64_t crop_padding(const AugmentOptions& options, int64_t width);

/// Returns a crop/flip-augmented copy of `input` (float32, B x C x H x W).
torch::Tensor augment(const torch::Tensor& input, const AugmentOptions& options,
                      const DrawKey& key, int64_t first_position);

/// augment() as a Transform on a batch's input, for the Loader.
Transform make_augment(AugmentOptions options);

/// Whether --augment `mode` adds augment() to the training batches of
/// `data`: auto does for ddptrain's own image datasets (`builtin_data`)
/// only, standard for any data whose examples hold a float "input" image
/// C x H x W, none never (nor for data that augments itself). standard on
/// data without such an image is a UserError naming --augment.
bool augment_applies(const std::string& mode, bool builtin_data, const Splits& data);

}  // namespace ddp::data
