// IDX reading and validation for MNIST-like datasets.
#include "ddp/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "ddp/data/identity.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

namespace fs = std::filesystem;

// Per-channel statistics of the training images on the 0..1 scale, the
// values the PyTorch examples use.
constexpr double kFashionMean = 0.2860, kFashionStd = 0.3530;
constexpr double kMnistMean = 0.1307, kMnistStd = 0.3081;

std::string corrupt_hint(const std::string& dataset) {
  return dataset == "mnist"
             ? "the file is corrupt or not an IDX file; download MNIST's four IDX files again."
             : "the file is corrupt or not an IDX file; re-install with "
               "apt-get install --reinstall dataset-fashion-mnist.";
}

std::string missing_hint(const std::string& dataset) {
  return dataset == "mnist"
             ? "put MNIST's four IDX files (train-images-idx3-ubyte.gz, ...) in one directory "
               "and pass it with --data_root DIR."
             : std::string("install Fashion-MNIST with apt-get install dataset-fashion-mnist "
                           "(it goes to ") +
                   kFashionMnistRoot + "), or pass --data_root DIR.";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The uncompressed size a gzip file records in its last 4 bytes (modulo
// 2^32), used only to reserve memory up front: growing a 47 MB string by
// doubling costs more than the decompression. 0 if unreadable.
size_t gzip_size_hint(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f || f.tellg() < 18) return 0;  // shorter than an empty gzip member
  f.seekg(-4, std::ios::end);
  unsigned char b[4] = {};
  if (!f.read(reinterpret_cast<char*>(b), 4)) return 0;
  const size_t size = size_t{b[0]} | size_t{b[1]} << 8 | size_t{b[2]} << 16 | size_t{b[3]} << 24;
  return std::min<size_t>(size, size_t{1} << 30);  // a corrupt trailer must not exhaust memory
}

int64_t big_endian_u32(const std::string& bytes, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data()) + offset;
  return (int64_t{p[0]} << 24) | (int64_t{p[1]} << 16) | (int64_t{p[2]} << 8) | int64_t{p[3]};
}

// Once `bytes` holds an IDX header (magic, then one 32-bit size per
// dimension): lowers `limit` to one byte past the file it promises, and
// returns true; false while the header is incomplete.
bool idx_promise(const std::string& bytes, size_t& limit) {
  if (bytes.size() < 4) return false;
  const size_t ndim = static_cast<unsigned char>(bytes[3]);
  const size_t header = 4 + 4 * ndim;
  if (bytes.size() < header) return false;
  uint64_t promised = 1;
  for (size_t d = 0; d < ndim; ++d)
    if (__builtin_mul_overflow(promised, static_cast<uint64_t>(big_endian_u32(bytes, 4 + 4 * d)), &promised))
      return true;  // parse() refuses it
  if (promised < limit - header) limit = header + static_cast<size_t>(promised);
  return true;
}

// The whole file, decompressed if its name ends in .gz.
std::string read_all(const std::string& path, const std::string& hint) {
  if (!ends_with(path, ".gz")) {
    std::ifstream f(path, std::ios::binary);
    check_user(static_cast<bool>(f), path + ": cannot open for reading.", hint);
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::unique_ptr<gzFile_s, int (*)(gzFile)> gz(gzopen(path.c_str(), "rb"), gzclose);
  check_user(gz != nullptr, path + ": cannot open for reading.", hint);
  gzbuffer(gz.get(), 1 << 17);
  // What a file may make this allocate is bounded by the file: no gzip
  // decompresses to more than deflate's largest ratio (1032:1) of its size,
  // and once the IDX header is in, reading stops a byte past what it
  // promises (parse() then names the excess). A small hostile file cannot
  // claim gigabytes.
  std::error_code ec;
  const auto compressed = fs::file_size(path, ec);
  const size_t by_ratio = (ec ? 0 : static_cast<size_t>(compressed)) * 1032 + (size_t{1} << 16);
  size_t limit = by_ratio;
  bool header_read = false;
  std::string bytes;
  std::vector<char> chunk(1 << 20);
  int n = 0;
  while (bytes.size() <= limit && (n = gzread(gz.get(), chunk.data(), static_cast<unsigned>(chunk.size()))) > 0) {
    bytes.append(chunk.data(), static_cast<size_t>(n));
    if (!header_read && (header_read = idx_promise(bytes, limit)))
      bytes.reserve(std::min(gzip_size_hint(path), limit + 1));  // the trailer's size, within the bounds
  }
  // Past the bound before the stream's end: stop here. (A stream that ended
  // too long is parse()'s to describe, to the byte.)
  if (bytes.size() > limit && !gzeof(gz.get())) {
    check_user(limit != by_ratio, path + ": decompresses to more than " + std::to_string(by_ratio) +
                                      " bytes, more than any gzip file of its size holds: it is damaged or not IDX data.",
               hint);
    throw UserError(path + ": decompresses to more than the " + std::to_string(limit) +
                        " bytes its IDX header promises: it is damaged or not IDX data.",
                    hint);
  }
  // A truncated stream ends with 0 like a complete one (or with -1); only
  // gzerror tells them apart.
  int code = Z_OK;
  const char* msg = gzerror(gz.get(), &code);
  check_user((n == 0 || gzeof(gz.get())) && (code == Z_OK || code == Z_STREAM_END),
             path + ": gzip data is truncated or corrupt (" + std::string(msg ? msg : "") + ").",
             hint);
  return bytes;
}

struct IdxContent {
  std::vector<int64_t> dims;
  const unsigned char* data;  // into the caller's byte string
};

// Checks the magic number and that the size matches the header exactly.
IdxContent parse(const std::string& bytes, const std::string& path, int32_t magic,
                 const char* kind, const std::string& hint) {
  const size_t ndim = static_cast<size_t>(magic & 0xff);  // low byte: rank
  const size_t header = 4 + 4 * ndim;
  check_user(bytes.size() >= 4, path + ": only " + std::to_string(bytes.size()) +
                                    " bytes, too short for an IDX header.", hint);
  const int64_t seen = big_endian_u32(bytes, 0);
  check_user(seen == magic, path + ": magic number " + std::to_string(seen) + ", expected " +
                                std::to_string(magic) + " (IDX " + kind + ").", hint);
  check_user(bytes.size() >= header, path + ": truncated, only " + std::to_string(bytes.size()) +
                                         " bytes, too short for the IDX header.", hint);
  IdxContent out;
  // Three 32-bit sizes can multiply past 64 bits (2^31 x 2^31 x 4 wraps to
  // 0, which a 16-byte file would then match): the product is checked.
  int64_t items = 1;
  bool overflow = false;
  std::string sizes;
  for (size_t d = 0; d < ndim; ++d) {
    out.dims.push_back(big_endian_u32(bytes, 4 + 4 * d));
    overflow = overflow || __builtin_mul_overflow(items, out.dims.back(), &items);
    sizes += (d ? " x " : "") + std::to_string(out.dims.back());
  }
  check_user(!overflow, path + ": the header's sizes " + sizes + " are too large for any file.", hint);
  const int64_t expected = static_cast<int64_t>(header) + items;
  const auto size = static_cast<int64_t>(bytes.size());
  check_user(size >= expected, path + ": truncated, " + std::to_string(size) +
                                   " bytes but the header promises " + std::to_string(expected) +
                                   ".", hint);
  check_user(size == expected, path + ": " + std::to_string(size - expected) +
                                   " bytes beyond the " + std::to_string(expected) +
                                   " the header promises.", hint);
  out.data = reinterpret_cast<const unsigned char*>(bytes.data()) + header;
  return out;
}

}  // namespace

std::string find_idx_file(const std::string& root, const std::string& stem,
                          const std::string& dataset) {
  check_user(fs::is_directory(root), "data root " + root + " is not a directory.",
             missing_hint(dataset));
  const std::string base = (fs::path(root) / stem).string();
  if (fs::exists(base + ".gz")) return base + ".gz";
  if (fs::exists(base)) return base;
  throw UserError(base + ".gz: not found (nor " + stem + " without .gz).", missing_hint(dataset));
}

torch::Tensor read_idx_images(const std::string& path, const std::string& dataset) {
  const std::string hint = corrupt_hint(dataset);
  const std::string bytes = read_all(path, hint);
  const IdxContent idx = parse(bytes, path, kIdxImagesMagic, "images", hint);
  const int64_t n = idx.dims[0], h = idx.dims[1], w = idx.dims[2];
  check_user(h > 0 && w > 0, path + ": images of " + std::to_string(h) + " x " +
                                 std::to_string(w) + " pixels.", hint);
  auto images = torch::empty({n, 1, h, w}, torch::kByte);
  std::memcpy(images.data_ptr<uint8_t>(), idx.data, static_cast<size_t>(images.numel()));
  return images;
}

torch::Tensor read_idx_labels(const std::string& path, int64_t num_classes,
                              const std::string& dataset) {
  const std::string hint = corrupt_hint(dataset);
  const std::string bytes = read_all(path, hint);
  const IdxContent idx = parse(bytes, path, kIdxLabelsMagic, "labels", hint);
  auto labels = torch::empty({idx.dims[0]}, torch::kLong);
  int64_t* out = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.dims[0]; ++i) {
    out[i] = idx.data[i];
    check_user(out[i] < num_classes, path + ": label " + std::to_string(out[i]) + " at item " +
                                         std::to_string(i) + " is outside [0, " +
                                         std::to_string(num_classes) + ").", hint);
  }
  return labels;
}

Splits load_mnist_like(const std::string& root, const std::string& name, int64_t max_train,
                       int64_t max_test) {
  check_user(name == "fashion-mnist" || name == "mnist",
             "dataset '" + name + "' is not an MNIST-like dataset.",
             "use fashion-mnist or mnist (or synthetic).");
  check_user(max_train >= 0 && max_test >= 0,
             "sample limits " + std::to_string(max_train) + " / " + std::to_string(max_test) +
                 " are negative.", "pass 0 to use every sample.");
  const double mean = name == "mnist" ? kMnistMean : kFashionMean;
  const double std = name == "mnist" ? kMnistStd : kFashionStd;
  constexpr int64_t kClasses = 10;

  auto load = [&](const std::string& prefix, int64_t max, const char* split) -> DatasetPtr {
    const std::string images_path = find_idx_file(root, prefix + "-images-idx3-ubyte", name);
    const std::string labels_path = find_idx_file(root, prefix + "-labels-idx1-ubyte", name);
    torch::Tensor images = read_idx_images(images_path, name);
    torch::Tensor labels = read_idx_labels(labels_path, kClasses, name);
    check_user(images.size(0) == labels.size(0),
               images_path + " holds " + std::to_string(images.size(0)) + " images but " +
                   labels_path + " holds " + std::to_string(labels.size(0)) + " labels.",
               corrupt_hint(name));
    // Of the files' contents, not their bytes on disk: the same data
    // compressed or not (or copied elsewhere) keeps its fingerprint.
    const std::string fingerprint = Fingerprint().add(images).add(labels).hex();
    return std::make_shared<ImageTensorDataset>(first_rows(images, max), first_rows(labels, max),
                                                std::vector<double>{mean},
                                                std::vector<double>{std}, kClasses,
                                                name + " (" + split + ")", fingerprint);
  };
  Splits splits;
  splits.train = load("train", max_train, "train");
  splits.test = load("t10k", max_test, "test");
  splits.mean = {mean};
  splits.std = {std};
  check_user(splits.train->input_shape() == splits.test->input_shape(),
             root + ": train and test images differ in size.", corrupt_hint(name));
  return splits;
}

}  // namespace ddp::data
