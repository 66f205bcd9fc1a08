// A folder of images, one sub-folder per class: torchvision's ImageFolder.
//
//   root/<class>/<image>   (images may also sit deeper, root/<class>/a/b.jpg)
//
// Classes are the sub-folders of root, sorted by the bytes of their names,
// and get labels 0, 1, ... in that order. Within a class, folders are walked
// in sorted order of their paths and files in sorted order of their names;
// files count when their extension is one of torchvision's IMG_EXTENSIONS,
// in any case. So sample i and label k here are sample i and label k of
// torchvision.datasets.ImageFolder on the same folder. Only JPEG and PNG are
// decoded (image_codec.h); a folder holding .bmp/.ppm/.pgm/.tif/.tiff/.webp
// files is refused when scanned, not halfway through an epoch.
//
// Images are decoded when a batch is built, on the Loader's worker threads,
// and transformed one at a time (image_transforms.h): random-resized crop
// and flip for training, resize and centre crop for evaluation, keyed on
// (seed, epoch, rank, position) like every other random draw in ddptrain.
// A JPEG much larger than the transform needs is decoded at a reduced
// scale (image_codec.h); the scale is fixed by the file and the options, so
// the draws stay a function of (seed, epoch, rank, position).
//
// A file that fails to decode is reported once per process on stderr, by the
// rank that met it (each rank reads different files), and the sample is
// replaced by the next file of the dataset, in index order, that decodes.
// Which files are broken is a property of the folder, so the replacement is
// the same for any worker count. With `strict`, the first corrupt file stops
// the run with a UserError naming it.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ddp/data/dataset.h"
#include "ddp/data/gpu_images.h"
#include "ddp/data/image_codec.h"
#include "ddp/data/image_transforms.h"

namespace ddp::data {

/// The file list of an image folder.
struct ImageFolderIndex {
  std::string root;
  std::vector<std::string> classes;  // sorted; label k is classes[k]
  std::vector<std::string> paths;    // full paths, in torchvision's order
  std::vector<int64_t> labels;       // one per path
};

/// Lists root/<class>/... as described above. UserError if root is not a
/// directory, has no class folders, a class has no image, or an image has an
/// extension this build cannot decode.
ImageFolderIndex scan_image_folder(const std::string& root);

/// True for a file name with one of torchvision's image extensions (any case).
bool is_image_file_name(const std::string& name);

/// Splits `all` into {train, val}: in every class, round(fraction x n)
/// files go to validation (at most n - 1, so no class vanishes from
/// training). Which ones is a hash of each file's path relative to the root,
/// so the split is the same on every rank, for every --seed and worker
/// count, and changes only when the folder's contents change. Both parts
/// keep the index order.
std::pair<ImageFolderIndex, ImageFolderIndex> split_image_folder(const ImageFolderIndex& all, double fraction);

struct ImageFolderOptions {
  /// How each image becomes a 3 x size x size tensor.
  TORCH_ARG(ImageTransformOptions, transform) = ImageTransformOptions();
  /// Stop at the first corrupt file instead of replacing the sample.
  TORCH_ARG(bool, strict) = false;
  /// Decode large JPEGs at 1/2, 1/4 or 1/8 scale when the transform needs
  /// no more pixels (decode_min_side, image_transforms.h); off: every file
  /// at full size, as torchvision's default loader does.
  TORCH_ARG(bool, scaled_jpeg_decode) = true;
  /// Leave decoding and the transform to the GPU (gpu_images.h): batches
  /// carry the files' bytes, and device_stage() finishes them on the device.
  TORCH_ARG(bool, gpu_decode) = false;
  /// With gpu_decode: batches nvJPEG may hold at once. With 2, the host
  /// parses batch k+1 while the decode engine still works on batch k, so
  /// the engine does not wait for the host between batches; 1 serialises.
  TORCH_ARG(int64_t, gpu_decode_in_flight) = 2;
  /// With gpu_decode: the share of each batch's samples decoded here, on
  /// the loader's threads (as files nvJPEG refuses are), while nvJPEG
  /// decodes the rest on the device. A sample decoded here decodes and
  /// sends only its crop's pixels (decode_image_box); the GPU still
  /// resizes, flips and normalises every sample. Which samples is a
  /// function of their position in the epoch only (uses_cpu_decode), so
  /// batches stay a function of (seed, epoch, rank).
  /// The default, 1, leaves nvJPEG nothing: on the H200 machine (16 cores),
  /// ResNet-50 from 20,000 JPEGs ran at 98.6% of its resident-batch step
  /// with 1, 91% with 0.7 and 79% with 0 (bench/RESULTS.md, session 14).
  /// nvJPEG's hardware engine waits for one conversion kernel per image,
  /// and those kernels queue behind the step's. Lower it where the
  /// loader's threads cannot keep up (few cores per GPU).
  TORCH_ARG(double, cpu_decode_share) = 1;
};

/// With a CPU share s of the decoding: whether the sample at epoch position
/// p is decoded on the CPU. Evenly spread: floor((p + 1) s) > floor(p s),
/// so any run of n positions holds floor(n s) or ceil(n s) of them.
bool uses_cpu_decode(int64_t position, double share);

class ImageFolderDataset : public Dataset {
 public:
  ImageFolderDataset(ImageFolderIndex files, ImageFolderOptions options, std::string name);

  int64_t size() const override { return static_cast<int64_t>(files_.paths.size()); }
  /// Without a draw key, samples are drawn as positions 0, 1, ... of epoch 0
  /// with seed 0 and rank 0 (this matters for training datasets only;
  /// evaluation has no random draws). The Loader uses get_keyed_batch.
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  Batch get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                        int64_t first_position) const override;
  std::vector<int64_t> input_shape() const override;
  int64_t num_classes() const override { return static_cast<int64_t>(files_.classes.size()); }
  std::string name() const override { return name_; }
  /// A hash of the class names and of each file's path below the root and
  /// label, in order: what the scan found, without reading a file. The
  /// same folder elsewhere (or spelt otherwise) keeps it; a file added,
  /// removed or renamed changes it.
  std::string fingerprint() const override;

  /// With gpu_decode, the stage that decodes and transforms on the device.
  /// Made on first use; UserError if this build has no nvJPEG.
  std::shared_ptr<DeviceStage> device_stage() const override;

  const ImageFolderIndex& files() const { return files_; }
  /// Files found corrupt so far, in the order they were met.
  std::vector<std::string> corrupt_files() const;

 private:
  // Decodes sample `index`, or the next one that decodes; sets *label and
  // *used (the index of the file it decoded). With `box_of`, only the box it
  // gives for the image's height and width (decode_image_box).
  torch::Tensor decode(int64_t index, int64_t rank, int64_t* label, int64_t* used = nullptr,
                       const std::function<CropBox(int64_t, int64_t)>& box_of = nullptr) const;
  // The crop of sample `index` (or of the next that decodes) that the
  // transform window for (key, position) reads, decoded alone
  // (decode_image_box); *window receives that window, its source rebased
  // onto the crop.
  torch::Tensor decode_crop(int64_t index, const DrawKey& key, int64_t position, int64_t* label, int64_t* used,
                            TransformWindow* window) const;
  // gpu_decode: sample `index` as it travels to the device, its bytes if
  // nvJPEG takes the file as it is, else decoded here (decode_on_cpu).
  EncodedSample encode(int64_t index, const DrawKey& key, int64_t position) const;
  EncodedSample decode_on_cpu(int64_t index, const DrawKey& key, int64_t position) const;
  // The CPU path: decoded, transformed and stacked here.
  Batch decoded_batch(const std::vector<int64_t>& indices, const DrawKey& key, int64_t first_position) const;
  void check_index(int64_t index) const;

  ImageFolderIndex files_;
  ImageFolderOptions options_;
  DecodeOptions decode_;
  std::string name_;
  mutable std::mutex mutex_;           // guards the two below
  mutable std::set<int64_t> corrupt_;  // indices known not to decode
  mutable std::vector<std::string> corrupt_order_;
  mutable std::once_flag stage_once_;
  mutable std::shared_ptr<DeviceStage> stage_;
};

/// Train and validation splits of an image folder, for ddptrain's flags.
struct ImageFolderSplitOptions {
  /// The training folder (--data_root).
  TORCH_ARG(std::string, root);
  /// A separate validation folder with the same class folders (--val-root);
  /// empty: take `val_fraction` of root instead.
  TORCH_ARG(std::string, val_root);
  TORCH_ARG(double, val_fraction) = 0.1;
  /// Output side (--image-size).
  TORCH_ARG(int64_t, image_size) = 224;
  /// Random-resized crop and flip on training images (--augment standard);
  /// off: training images get the evaluation transform.
  TORCH_ARG(bool, augment) = true;
  TORCH_ARG(bool, strict) = false;
  /// Decode and transform on the GPU (--image-decode gpu); see gpu_images.h.
  TORCH_ARG(bool, gpu_decode) = false;
  /// With gpu_decode: ImageFolderOptions::cpu_decode_share (--cpu-decode-share).
  TORCH_ARG(double, cpu_decode_share) = 1;
};

/// ImageFolderDataset splits, normalised with ImageNet's statistics.
Splits load_image_folder(const ImageFolderSplitOptions& options);

}  // namespace ddp::data
