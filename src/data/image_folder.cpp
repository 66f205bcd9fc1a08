// Scanning, splitting and decoding of image folders.
#include "ddp/data/image_folder.h"
#include "ddp/program.h"
#include "ddp/data/subset.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <tuple>
#include <utility>

#include "ddp/data/identity.h"
#include "ddp/data/image_codec.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kTagSplit = 0x76616c73;

// torchvision's IMG_EXTENSIONS, and the subset this build decodes.
const std::vector<std::string> kImageExtensions = {".jpg", ".jpeg", ".png", ".ppm", ".bmp",
                                                   ".pgm", ".tif",  ".tiff", ".webp"};
const std::vector<std::string> kDecodable = {".jpg", ".jpeg", ".png"};

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

bool has_extension(const std::string& name_lower, const std::vector<std::string>& extensions) {
  return std::any_of(extensions.begin(), extensions.end(), [&](const std::string& e) {
    return name_lower.size() >= e.size() && name_lower.compare(name_lower.size() - e.size(), e.size(), e) == 0;
  });
}

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);  // follows symlinks, as os.scandir's is_dir() does
}

// 64-bit FNV-1a of a string, then mixed: a hash that, unlike std::hash, is
// the same with every standard library.
uint64_t stable_hash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return mix64(h);
}

const std::string kScanHint = "lay images out as ROOT/<class>/<image>.jpg|png, one folder per class.";

}  // namespace

bool is_image_file_name(const std::string& name) { return has_extension(lower(name), kImageExtensions); }

ImageFolderIndex scan_image_folder(const std::string& root) {
  check_user(is_dir(root), "data root '" + root + "' is not a directory.",
             "pass --data_root ROOT with the layout ROOT/<class>/<image>.jpg|png.");
  ImageFolderIndex index;
  index.root = root;
  for (const auto& entry : fs::directory_iterator(root))
    if (is_dir(entry.path())) index.classes.push_back(entry.path().filename().string());
  std::sort(index.classes.begin(), index.classes.end());  // byte order, like Python's sorted()
  check_user(!index.classes.empty(), "data root '" + root + "' has no class folders.", kScanHint);

  int64_t undecodable = 0;
  std::string undecodable_example;
  for (size_t label = 0; label < index.classes.size(); ++label) {
    // Every folder under the class, keyed by its path string, so that the
    // folders come out in sorted order and their files in name order.
    const fs::path class_dir = fs::path(root) / index.classes[label];
    std::map<std::string, std::vector<std::string>> folders;
    folders[class_dir.string()];
    const auto opts = fs::directory_options::follow_directory_symlink | fs::directory_options::skip_permission_denied;
    for (auto it = fs::recursive_directory_iterator(class_dir, opts); it != fs::recursive_directory_iterator(); ++it) {
      if (is_dir(it->path())) {
        folders[it->path().string()];
        continue;
      }
      const std::string name = it->path().filename().string();
      const std::string name_lower = lower(name);
      if (!has_extension(name_lower, kImageExtensions)) continue;
      folders[it->path().parent_path().string()].push_back(name);
      if (!has_extension(name_lower, kDecodable) && undecodable++ == 0) undecodable_example = it->path().string();
    }
    const size_t before = index.paths.size();
    for (auto& [folder, names] : folders) {
      std::sort(names.begin(), names.end());
      for (const auto& name : names) {
        index.paths.push_back((fs::path(folder) / name).string());
        index.labels.push_back(static_cast<int64_t>(label));
      }
    }
    check_user(index.paths.size() > before,
               "class folder '" + class_dir.string() + "' holds no image (.jpg, .jpeg or .png).",
               "add images to it or remove the folder.");
  }
  check_user(undecodable == 0,
             "'" + root + "' holds " + std::to_string(undecodable) +
                 " image(s) in a format this build does not decode, e.g. '" + undecodable_example + "'.",
             "only JPEG and PNG are read; convert the others (e.g. mogrify -format png FILE) and remove the originals.");
  return index;
}

std::pair<ImageFolderIndex, ImageFolderIndex> split_image_folder(const ImageFolderIndex& all, double fraction) {
  check_user(fraction > 0 && fraction < 1,
             "validation fraction " + std::to_string(fraction) + " is outside (0, 1).",
             "pass e.g. --val-split 0.1, or a separate folder with --val-root DIR.");
  const size_t prefix = fs::path(all.root).string().size();
  std::vector<bool> to_val(all.paths.size(), false);
  std::vector<std::vector<std::pair<uint64_t, size_t>>> by_class(all.classes.size());
  for (size_t i = 0; i < all.paths.size(); ++i)
    by_class[static_cast<size_t>(all.labels[i])].push_back(
        {hash_words({kTagSplit, stable_hash(all.paths[i].substr(prefix))}), i});
  for (auto& members : by_class) {
    const auto n = static_cast<int64_t>(members.size());
    const int64_t k = std::min<int64_t>(std::llround(fraction * static_cast<double>(n)), n - 1);
    // The k files with the smallest hashes go to validation; ties (equal
    // hashes) fall back to the index so the choice is total.
    std::sort(members.begin(), members.end());
    for (int64_t j = 0; j < k; ++j) to_val[members[static_cast<size_t>(j)].second] = true;
  }
  ImageFolderIndex train, val;
  train.root = val.root = all.root;
  train.classes = val.classes = all.classes;
  for (size_t i = 0; i < all.paths.size(); ++i) {
    ImageFolderIndex& part = to_val[i] ? val : train;
    part.paths.push_back(all.paths[i]);
    part.labels.push_back(all.labels[i]);
  }
  return {std::move(train), std::move(val)};
}

ImageFolderDataset::ImageFolderDataset(ImageFolderIndex files, ImageFolderOptions options, std::string name)
    : files_(std::move(files)), options_(std::move(options)), name_(std::move(name)) {
  TORCH_CHECK(files_.paths.size() == files_.labels.size(), "ImageFolderDataset: one label per path");
  check_user(options_.transform().size() >= 1,
             "image size " + std::to_string(options_.transform().size()) + " is not positive.",
             "pass e.g. --image-size 224.");
  if (options_.scaled_jpeg_decode()) decode_.min_side(decode_min_side(options_.transform()));
  // With gpu_decode, files nvJPEG refuses are decoded at full size, like the rest.
  if (options_.gpu_decode()) decode_.min_side(0);
}

std::shared_ptr<DeviceStage> ImageFolderDataset::device_stage() const {
  if (!options_.gpu_decode()) return nullptr;
  std::call_once(stage_once_, [this] {
    stage_ = make_gpu_jpeg_stage(options_.transform(), options_.gpu_decode_in_flight(), [this](int64_t index, const DrawKey& key, int64_t position) {
      return decode_on_cpu(index, key, position);
    });
  });
  return stage_;
}

std::vector<std::string> ImageFolderDataset::corrupt_files() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return corrupt_order_;
}

torch::Tensor ImageFolderDataset::decode(int64_t index, int64_t rank, int64_t* label, int64_t* used,
                                         const std::function<CropBox(int64_t, int64_t)>& box_of) const {
  const int64_t n = size();
  for (int64_t step = 0; step < n; ++step) {
    const int64_t i = (index + step) % n;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (corrupt_.count(i)) continue;
    }
    const std::string& path = files_.paths[static_cast<size_t>(i)];
    try {
      torch::Tensor image;
      if (box_of) {
        const auto bytes = read_image_file(path);
        image = decode_image_box(bytes.data(), bytes.size(), path, decode_, box_of, nullptr);
      } else {
        image = decode_image_file(path, decode_);
      }
      *label = files_.labels[static_cast<size_t>(i)];
      if (used) *used = i;
      return image;
    } catch (const CorruptImage& e) {
      if (options_.strict())
        throw UserError("corrupt image " + std::string(e.what()) + ".",
                        "repair or delete the file, or run without --strict-data to skip corrupt images.");
      bool first = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        first = corrupt_.insert(i).second;
        if (first) corrupt_order_.push_back(path);
      }
      // Once per file and process; each rank reads its own share of the
      // files, so each reports what it met.
      if (first)
        std::fprintf(stderr,
                     "%s rank %lld: warning: skipping corrupt image %s; its samples use the next image "
                     "that decodes (--strict-data makes this an error).\n",
                     program_name(), static_cast<long long>(rank), e.what());
    }
  }
  throw UserError("none of the " + std::to_string(n) + " images of " + name_ + " decodes.",
                  "check that the files are JPEG or PNG images.");
}

torch::Tensor ImageFolderDataset::decode_crop(int64_t index, const DrawKey& key, int64_t position, int64_t* label,
                                              int64_t* used, TransformWindow* window) const {
  const torch::Tensor crop = decode(index, key.rank, label, used, [&](int64_t h, int64_t w) {
    *window = transform_window(h, w, options_.transform(), key, position);
    return window->source;
  });
  window->source = CropBox{0, 0, crop.size(0), crop.size(1)};
  return crop;
}

EncodedSample ImageFolderDataset::decode_on_cpu(int64_t index, const DrawKey& key, int64_t position) const {
  EncodedSample s;
  s.kind = kEncodedRgb;
  // Only the crop's pixels are decoded (most of a JPEG's, at least) and
  // travel: the resample kernel reads nothing outside the window.
  const torch::Tensor crop = decode_crop(index, key, position, &s.label, &s.index, &s.window).contiguous();
  s.height = crop.size(0);
  s.width = crop.size(1);
  s.bytes.assign(crop.data_ptr<uint8_t>(), crop.data_ptr<uint8_t>() + crop.numel());
  return s;
}

EncodedSample ImageFolderDataset::encode(int64_t index, const DrawKey& key, int64_t position) const {
  bool known_corrupt = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    known_corrupt = corrupt_.count(index) > 0;
  }
  if (!known_corrupt) {
    try {
      auto bytes = read_image_file(files_.paths[static_cast<size_t>(index)]);
      if (auto s = plain_jpeg_sample(bytes, index, files_.labels[static_cast<size_t>(index)], options_.transform(), key,
                                     position))
        return std::move(*s);
    } catch (const CorruptImage&) {
      // Unreadable: decode_on_cpu reports it as the CPU path does.
    }
  }
  return decode_on_cpu(index, key, position);
}

Batch ImageFolderDataset::get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                                          int64_t first_position) const {
  if (!options_.gpu_decode()) return decoded_batch(indices, key, first_position);
  std::vector<EncodedSample> samples;
  samples.reserve(indices.size());
  for (size_t j = 0; j < indices.size(); ++j) {
    check_index(indices[j]);
    const int64_t position = first_position + static_cast<int64_t>(j);
    samples.push_back(uses_cpu_decode(position, options_.cpu_decode_share()) ? decode_on_cpu(indices[j], key, position)
                                                                             : encode(indices[j], key, position));
  }
  return encoded_batch(samples, key, first_position);
}

bool uses_cpu_decode(int64_t position, double share) {
  if (share <= 0) return false;
  if (share >= 1) return true;
  const auto p = static_cast<double>(position);
  return std::floor((p + 1) * share) > std::floor(p * share);
}

void ImageFolderDataset::check_index(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < size(), name_, ": index ", i, " outside [0, ", size(), ")");
}

Batch ImageFolderDataset::decoded_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                                        int64_t first_position) const {
  const int64_t s = options_.transform().size(), b = static_cast<int64_t>(indices.size());
  for (int64_t i : indices) check_index(i);
  Batch batch{torch::empty({b, 3, s, s}), torch::empty({b}, torch::kLong)};
  int64_t* labels = batch.target().data_ptr<int64_t>();
  for (int64_t j = 0; j < b; ++j) {
    // Only the crop is decoded, then resized: the same pixels as
    // transform_image on the whole image.
    TransformWindow window;
    const torch::Tensor crop =
        decode_crop(indices[static_cast<size_t>(j)], key, first_position + j, &labels[j], nullptr, &window);
    batch.input()[j].copy_(apply_transform_window(crop, window, options_.transform()));
  }
  return batch;
}

Batch ImageFolderDataset::get_batch(const std::vector<int64_t>& indices) const {
  // Decoded here even with gpu_decode: get() and get_batch() give tensors.
  return decoded_batch(indices, DrawKey{}, 0);
}

Example ImageFolderDataset::get(int64_t index) const {
  Batch b = get_batch({index});
  return {b.input()[0], b.target()[0]};
}

std::string ImageFolderDataset::fingerprint() const {
  Fingerprint f;
  for (const auto& c : files_.classes) f.add(c);
  // Every path starts with the root as scanned; what follows it, less the
  // separator ("data" and "data/" spell one root), is where the file lies
  // in the folder.
  const size_t prefix = files_.root.size();
  for (size_t i = 0; i < files_.paths.size(); ++i) {
    const std::string& p = files_.paths[i];
    const size_t from = std::min(p.find_first_not_of('/', prefix), p.size());
    f.add(p.substr(from)).add(files_.labels[i]);
  }
  return f.hex();
}

std::vector<int64_t> ImageFolderDataset::input_shape() const {
  return {3, options_.transform().size(), options_.transform().size()};
}

Splits load_image_folder(const ImageFolderSplitOptions& options) {
  ImageFolderIndex train = scan_image_folder(options.root());
  ImageFolderIndex val;
  std::string val_name;
  if (!options.val_root().empty()) {
    val = scan_image_folder(options.val_root());
    check_user(val.classes == train.classes,
               "validation folder '" + options.val_root() + "' has " + std::to_string(val.classes.size()) +
                   " class folders that differ from the " + std::to_string(train.classes.size()) + " of '" +
                   options.root() + "'.",
               "give both folders the same class sub-folders (names decide the labels).");
    val_name = "imagefolder " + options.val_root();
  } else {
    check_user(options.val_fraction() > 0,
               "--dataset imagefolder needs validation images, but --val-split is 0 and no --val-root is given.",
               "pass --val-split 0.1 (hold out 10% of each class) or --val-root DIR.");
    std::tie(train, val) = split_image_folder(train, options.val_fraction());
    check_user(!val.paths.empty(),
               "--val-split " + std::to_string(options.val_fraction()) + " leaves no validation image in '" +
                   options.root() + "'.",
               "raise --val-split, add images, or pass --val-root DIR.");
    val_name = "imagefolder " + options.root() + " (val split)";
  }
  auto transform = ImageTransformOptions().size(options.image_size());
  Splits splits;
  splits.mean = kImageNetMean;
  splits.std = kImageNetStd;
  splits.train_augmented = true;  // crop and flip per image, or none at all
  splits.train = std::make_shared<ImageFolderDataset>(
      std::move(train),
      ImageFolderOptions().transform(ImageTransformOptions(transform).train(options.augment())).strict(options.strict())
          .gpu_decode(options.gpu_decode()).cpu_decode_share(options.cpu_decode_share()),
      "imagefolder " + options.root() + " (train)");
  // The held-out images (or --val-root's) are a validation split: they
  // choose best.pt. An image folder brings no test split of its own.
  splits.val = std::make_shared<ImageFolderDataset>(
      std::move(val),
      ImageFolderOptions().transform(ImageTransformOptions(transform).train(false)).strict(options.strict())
          .gpu_decode(options.gpu_decode()).cpu_decode_share(options.cpu_decode_share()),
      val_name);
  splits.test = empty_like(splits.val, "imagefolder (no test split)");
  return splits;
}

}  // namespace ddp::data
