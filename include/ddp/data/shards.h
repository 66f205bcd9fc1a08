// Datasets that stream from tar shards, WebDataset's format: each sample is
// the consecutive members of a tar file that share a key (the member's path
// up to the first dot of its file name; the rest is the field's extension),
// e.g. n01440764_10026.jpg + n01440764_10026.cls. Image samples need an
// image (.jpg, .jpeg or .png) and a class (.cls: the label as decimal text);
// a task may ask for other fields (ShardField: .csv, .json, .cls2, raw
// float32, ...), each decoded into named tensors of the batch, with or
// without an image.
//
// The order of an epoch is a function of (seed, epoch, streams) only,
// where `streams` (--shard-streams, the world size of the run's first start
// unless given) is a number of sequential readers fixed for the whole run:
//
//   1. The shards are shuffled with (seed, epoch); their samples, in file
//      order, make one sequence of N samples.
//   2. The sequence is cut into `streams` runs of Q = ceil(N / streams)
//      samples each; the last run wraps around to the sequence's start, so
//      at most streams - 1 samples are seen twice (as PyTorch's
//      DistributedSampler pads). Every stream reads its shards in order,
//      once, starting inside its first shard and stopping inside its last.
//   3. Each stream passes its samples through a shuffle buffer of
//      --shuffle-buffer samples, seeded by (seed, epoch, stream).
//   4. The epoch's global order takes one sample from each stream in turn.
//      Rank r of W takes every W-th sample from r: with W dividing
//      `streams`, its samples come from streams r, r + W, ... alone, so it
//      reads only those shards. Every rank gets streams x Q / W samples, so
//      no rank waits on another at the end of an epoch.
//
// The global batch at step s is therefore the same samples for any world
// size that divides `streams` (with the same global batch), and resuming
// in the middle of an epoch, on the same or another such world size, starts
// at exactly the next sample: the streams are replayed from their first
// shard, skipping (not reading) the samples already trained on.
//
// Loader workers share the rank's streams: each stream of the rank has a
// reader thread that reads its samples in stream order (sequential I/O) a
// bounded distance ahead of the workers; a worker takes its batch's
// samples from the readers and decodes them, so the batches do not depend
// on --workers, and no worker waits while another reads a tar.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ddp/data/csv.h"
#include "ddp/data/dataset.h"
#include "ddp/data/gpu_images.h"
#include "ddp/data/image_codec.h"
#include "ddp/data/image_transforms.h"
#include "ddp/data/tar.h"

namespace ddp::data {

/// Shard names from a pattern: comma-separated items, each with brace
/// ranges ({0000..0127}: zero-padded to the width of the first bound) and
/// brace lists ({a,b,c}), expanded left to right, as WebDataset's
/// braceexpand. UserError for an unbalanced brace or a backward range.
std::vector<std::string> expand_shard_pattern(const std::string& pattern);

/// {key, extension} of a member: "a/b.c.jpg" -> {"a/b", "c.jpg"}; a name
/// without a dot in its file name has extension "".
std::pair<std::string, std::string> split_member_name(const std::string& name);

/// One sample: its key and its fields by extension (empty bytes when the
/// reader was asked not to read them).
struct ShardSample {
  std::string key;
  std::map<std::string, std::vector<uint8_t>> fields;
};

/// Which fields' data ShardReader::next reads; the rest is skipped
/// (seeked over), leaving their bytes empty.
enum class ShardRead { kNothing, kLabel, kAll };

/// The samples of one shard, in order.
class ShardReader {
 public:
  explicit ShardReader(const std::string& path);
  /// The next sample, false at the end. UserError for a damaged shard or a
  /// field given twice in one sample.
  bool next(ShardSample* sample, ShardRead what);
  const std::string& path() const { return tar_.path(); }

 private:
  TarReader tar_;
  bool have_pending_ = false;  // a member whose header is read, its data not yet
  std::string pending_name_;
};

/// What a scan of the shards found: sample ids are 0 .. size()-1, shard by
/// shard in the pattern's order.
struct ShardIndex {
  std::vector<std::string> paths;
  std::vector<int64_t> first;      // paths.size() + 1 entries: shard i holds ids [first[i], first[i+1])
  std::vector<std::string> keys;   // per id
  std::vector<int64_t> labels;     // per id, from .cls (empty when samples have no image)
  std::vector<int64_t> ordinals;   // per id: its place among all its shard's samples, left-out ones included
  std::vector<std::string> left_out;  // "shard: key (what it lacks)" of each incomplete sample left out
  int64_t size() const { return first.empty() ? 0 : first.back(); }
  int64_t shard_of(int64_t id) const;
  std::vector<int64_t> shard_sizes() const;
};

/// How one field's bytes become named tensors of one sample. `where`
/// ("shard PATH: sample KEY's .EXT") begins the UserError of bytes that do
/// not decode.
using FieldDecoder = std::function<TensorDict(const std::vector<uint8_t>& bytes, const std::string& where)>;

/// A field every sample has (by extension, e.g. "json", "cls2", "f32") and
/// what it gives the batch: each name of the decoder's tensors, stacked.
struct ShardField {
  std::string extension;
  FieldDecoder decode;
};

/// Decimal text (as a .cls): `name`, an int64 scalar.
FieldDecoder integer_field(const std::string& name);
/// Numbers as decimal text separated by spaces, commas or line breaks:
/// `name`, a float32 vector of them (every sample must hold as many).
FieldDecoder numbers_field(const std::string& name);
/// Raw little-endian float32 values: `name`, a float32 vector.
FieldDecoder float32_field(const std::string& name);
/// A CSV header line and one record, as `ddptrain shards FILE.csv` writes
/// them: every column under its own name, a scalar read as read_csv reads
/// it (float32; int64 for options.categories()).
FieldDecoder csv_field(const CsvOptions& options = {});

struct ShardScanOptions {
  /// Samples need an image and a .cls.
  TORCH_ARG(bool, image) = true;
  /// Extensions every sample needs besides.
  TORCH_ARG(std::vector<std::string>, fields);
  /// Leave out a sample missing one (listed in ShardIndex::left_out)
  /// instead of stopping.
  TORCH_ARG(bool, skip_incomplete) = false;
};

/// Reads every shard once (headers, and each sample's .cls), so that a
/// damaged shard or an incomplete sample stops the run before it trains.
/// UserError naming the shard and the sample key.
ShardIndex scan_shards(const std::vector<std::string>& paths, const ShardScanOptions& options);
inline ShardIndex scan_image_shards(const std::vector<std::string>& paths) { return scan_shards(paths, {}); }

struct StreamOrderOptions {
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(int64_t, epoch) = 0;
  /// Sequential readers the epoch is cut into (a multiple of world).
  TORCH_ARG(int64_t, streams) = 1;
  /// Samples each stream's shuffle buffer holds; 1 or less: none.
  TORCH_ARG(int64_t, shuffle_buffer) = 1000;
  /// Shuffle shards and samples; off: the shards' order, unbuffered.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(int64_t, rank) = 0;
  TORCH_ARG(int64_t, world) = 1;
  /// Epoch + 1 follows with these options (the trainer's every epoch but
  /// the last): once this epoch's samples are all read, the streams of the
  /// next start reading its shuffle buffers, so that its first batches do
  /// not wait for them to fill. It changes no order, only when bytes are read.
  TORCH_ARG(bool, next_epoch_follows) = false;
};

/// One rank's order for one epoch (see the top of this file).
struct StreamPlan {
  std::vector<int64_t> ids;       // per position in the rank's order: the sample id
  std::vector<int64_t> stream;    // per position: the stream that holds it
  std::vector<int64_t> raw;       // per position: its place in the stream before the shuffle buffer
  std::vector<int64_t> sequence;  // the epoch's shuffled sequence of ids; raw j of stream s is
                                  // sequence[(s * per_stream + j) % N]
  int64_t per_stream = 0;
};

/// Samples per rank per epoch: streams x ceil(total / streams) / world.
int64_t stream_epoch_samples(int64_t total, int64_t streams, int64_t world);

/// The plan for shards of `shard_sizes` samples. UserError if streams is
/// not a positive multiple of world.
StreamPlan plan_stream_order(const std::vector<int64_t>& shard_sizes, const StreamOrderOptions& options);

/// A dataset read in streams rather than by index. The trainer asks it for
/// each epoch's order instead of using DistributedSampler.
class StreamDataset : public Dataset {
 public:
  /// This rank's order for the epoch, as sample ids; get_keyed_batch then
  /// reads the samples from `first_position` on as streams.
  virtual std::vector<int64_t> epoch_order(const StreamOrderOptions& options, int64_t first_position) const = 0;
  virtual int64_t epoch_samples(int64_t streams, int64_t world) const {
    return stream_epoch_samples(size(), streams, world);
  }
  /// Samples this process replaced in epoch `epoch` (from 0) because they
  /// did not decode (ShardDatasetOptions::skip_bad).
  virtual int64_t skipped(int64_t epoch) const { return 0 * epoch; }
  /// Samples left out at the scan because they lack a field
  /// (ShardScanOptions::skip_incomplete): the same on every rank, each epoch.
  virtual int64_t left_out() const { return 0; }
};

struct ShardDatasetOptions {
  /// How each image becomes a 3 x size x size tensor.
  TORCH_ARG(ImageTransformOptions, transform) = ImageTransformOptions();
  /// Decode large JPEGs at a reduced scale when the transform allows
  /// (ImageFolderOptions::scaled_jpeg_decode; never with gpu_decode).
  TORCH_ARG(bool, scaled_jpeg_decode) = true;
  /// Leave decoding and the transform to the GPU, as image folders do
  /// (ImageFolderOptions::gpu_decode, gpu_images.h): training batches carry
  /// the JPEGs' bytes and device_stage() finishes them on the device.
  TORCH_ARG(bool, gpu_decode) = false;
  /// With gpu_decode: ImageFolderOptions::cpu_decode_share.
  TORCH_ARG(double, cpu_decode_share) = 1;
  /// With gpu_decode: ImageFolderOptions::gpu_decode_in_flight.
  TORCH_ARG(int64_t, gpu_decode_in_flight) = 2;
  /// The image as "input" and the .cls as "target" (scanned with
  /// ShardScanOptions::image); off: only `fields`.
  TORCH_ARG(bool, image) = true;
  /// Other fields of every sample, as named tensors of the batch (in the
  /// CPU and GPU paths alike).
  TORCH_ARG(std::vector<ShardField>, fields);
  /// A sample whose image or field does not decode is replaced by the next
  /// sample of its shard that does (wrapping to the shard's first; the same
  /// on every run, rank count and worker count), with a warning, and
  /// counted in skipped(); off: UserError. With gpu_decode, a JPEG that only
  /// nvJPEG refuses is replaced by its CPU decode as before.
  TORCH_ARG(bool, skip_bad) = false;
};

/// Image shards: "input" 3 x size x size, "target" the .cls label, and the
/// named tensors of `fields`; or, without an image, those alone.
/// Indexed access (get, get_batch; evaluation, predict) reads each asked
/// sample's shard from its start, skipping the members before it. A
/// corrupt image stops the run naming its shard and key.
class ShardDataset : public StreamDataset {
 public:
  ShardDataset(ShardIndex index, ShardDatasetOptions options, std::string name);
  ~ShardDataset() override;

  int64_t size() const override { return index_.size(); }
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  Batch get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                        int64_t first_position) const override;
  std::vector<int64_t> input_shape() const override;
  int64_t skipped(int64_t epoch) const override;
  int64_t left_out() const override { return static_cast<int64_t>(index_.left_out.size()); }
  int64_t num_classes() const override { return num_classes_; }
  std::string name() const override { return name_; }
  /// A hash of each shard's sample keys and labels, in order (no paths).
  std::string fingerprint() const override;
  std::vector<int64_t> epoch_order(const StreamOrderOptions& options, int64_t first_position) const override;
  /// With gpu_decode, the stage that decodes and transforms on the device.
  /// Made on first use; UserError if this build has no nvJPEG.
  std::shared_ptr<DeviceStage> device_stage() const override;

  const ShardIndex& index() const { return index_; }
  /// Samples read by index (evaluation, predict, or a batch of no armed
  /// epoch) rather than from the streams; for tests and diagnostics.
  int64_t samples_read_by_index() const { return indexed_reads_; }

 private:
  struct Stream;   // one stream of the armed epoch and its reader thread
  struct Streams;  // the armed epoch's streams
  // What a batch needs of a sample: its image's bytes (if the dataset has
  // images) and each field's, in options_.fields() order.
  struct Needed {
    std::vector<uint8_t> image;
    std::vector<std::vector<uint8_t>> fields;
  };
  // One sample decoded: its crop and window (images), label and fields.
  struct Decoded {
    int64_t id = 0;
    torch::Tensor crop;
    TransformWindow window;
    TensorDict fields;
  };
  // What each of `indices` needs (positions first_position + j of `st`'s
  // plan), taken from the streams' readers into `out`; false if `st` was
  // disarmed meanwhile (the caller then reads by index).
  bool stream_samples(Streams& st, const std::vector<int64_t>& indices, int64_t first_position,
                      std::vector<Needed>* out) const;
  // The streams of an epoch from `first_position` on, their readers started.
  std::shared_ptr<Streams> arm(const StreamOrderOptions& options, int64_t first_position) const;
  // Once `st`'s samples are all read and another epoch follows it: arms
  // that epoch as next_ (once), if `st` is still the armed epoch.
  void arm_next_when_read(Streams& st) const;
  // The body of `stream`'s reader thread.
  void read_stream(Streams& st, Stream& stream) const;
  std::vector<Needed> indexed_samples(const std::vector<int64_t>& indices) const;
  // Moves what is needed out of `sample`; false if it lacks some of it.
  bool take(ShardSample& sample, Needed* out) const;
  TensorDict decode_fields(const Needed& needed, int64_t id) const;
  // Sample `id` decoded for (key, position): its crop (a window rebased
  // onto the crop) and fields. UserError if it does not decode.
  Decoded decode_sample(const Needed& needed, int64_t id, const DrawKey& key, int64_t position) const;
  // decode_sample; with skip_bad, a sample that does not decode is replaced
  // by the next sample of its shard that does, and counted.
  Decoded decode_or_replace(const Needed& needed, int64_t id, const DrawKey& key, int64_t position) const;
  Batch decode_batch(const std::vector<Needed>& samples, const std::vector<int64_t>& indices, const DrawKey& key,
                     int64_t first_position) const;
  // gpu_decode: the batch as it travels to the device (gpu_images.h).
  Batch encoded(std::vector<Needed>& samples, const std::vector<int64_t>& indices, const DrawKey& key,
                int64_t first_position) const;
  EncodedSample crop_on_cpu(const Decoded& decoded) const;

  ShardIndex index_;
  ShardDatasetOptions options_;
  DecodeOptions decode_;
  std::string name_;
  int64_t num_classes_ = 0;
  mutable std::mutex mutex_;                  // guards streams_ and next_ (not the reading)
  mutable std::shared_ptr<Streams> streams_;  // null: no epoch armed; workers hold it while taking
  mutable std::shared_ptr<Streams> next_;     // the epoch after streams_', reading ahead (or null)
  mutable std::atomic<int64_t> indexed_reads_{0};
  mutable std::once_flag stage_once_;
  mutable std::shared_ptr<DeviceStage> stage_;
  mutable std::mutex skipped_mutex_;             // guards skipped_, warned_
  mutable std::map<int64_t, int64_t> skipped_;   // epoch -> samples replaced
  mutable std::map<int64_t, bool> warned_;       // ids already reported
};

/// The image field of a sample: its first .jpg, .jpeg or .png (any case).
const std::vector<uint8_t>* image_field(const ShardSample& sample);

struct ShardSplitOptions {
  /// Training shards (--data_root): a pattern for expand_shard_pattern.
  TORCH_ARG(std::string, pattern);
  /// Validation shards (--val-root); required.
  TORCH_ARG(std::string, val_pattern);
  TORCH_ARG(int64_t, image_size) = 224;
  /// Random-resized crop and flip on training images (--augment standard).
  TORCH_ARG(bool, augment) = true;
  /// Decode on the GPU (--image-decode gpu) and its CPU share (--cpu-decode-share).
  TORCH_ARG(bool, gpu_decode) = false;
  TORCH_ARG(double, cpu_decode_share) = 1;
  /// --skip-bad-samples: leave out incomplete samples, replace those that
  /// do not decode (ShardDatasetOptions::skip_bad).
  TORCH_ARG(bool, skip_bad) = false;
};

/// Train and validation splits of image shards, normalised with ImageNet's
/// statistics (as load_image_folder).
Splits load_image_shards(const ShardSplitOptions& options);

}  // namespace ddp::data
