// Tar shards as a dataset: the scan, the epoch's stream order, and the
// sequential readers behind it (shards.h).
#include "ddp/data/shards.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "ddp/data/counter_rng.h"
#include "ddp/data/identity.h"
#include "ddp/data/image_folder.h"  // uses_cpu_decode
#include "ddp/data/subset.h"
#include "ddp/error.h"
#include "ddp/program.h"

namespace ddp::data {

namespace {

const char* const kShardPatternHint = "e.g. 'train-{0000..0127}.tar', or a comma-separated list of tar files.";

// Items of `s` separated by commas outside braces.
std::vector<std::string> split_top_level(const std::string& s, const std::string& pattern) {
  std::vector<std::string> out(1);
  int depth = 0;
  for (char ch : s) {
    if (ch == '{') ++depth;
    if (ch == '}') --depth;
    check_user(depth >= 0 && depth <= 1, "shard pattern '" + pattern + "' has unbalanced or nested braces.",
               kShardPatternHint);
    if (ch == ',' && depth == 0)
      out.emplace_back();
    else
      out.back() += ch;
  }
  check_user(depth == 0, "shard pattern '" + pattern + "' has an unclosed brace.", kShardPatternHint);
  return out;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> brace_alternatives(const std::string& inner, const std::string& pattern) {
  const size_t dots = inner.find("..");
  if (dots == std::string::npos) {
    std::vector<std::string> out;
    size_t from = 0;
    for (size_t comma; (comma = inner.find(',', from)) != std::string::npos; from = comma + 1)
      out.push_back(inner.substr(from, comma - from));
    out.push_back(inner.substr(from));
    return out;
  }
  const std::string lo = inner.substr(0, dots), hi = inner.substr(dots + 2);
  check_user(all_digits(lo) && all_digits(hi) && lo.size() <= 18 && hi.size() <= 18,
             "shard pattern '" + pattern + "': {" + inner + "} is not a range of numbers.", kShardPatternHint);
  const int64_t a = std::stoll(lo), b = std::stoll(hi);
  check_user(a <= b, "shard pattern '" + pattern + "': the range {" + inner + "} runs backwards.",
             "write the smaller number first.");
  const size_t width = lo.size() > 1 && lo[0] == '0' ? lo.size() : 0;
  std::vector<std::string> out;
  for (int64_t i = a; i <= b; ++i) {
    std::string n = std::to_string(i);
    if (n.size() < width) n.insert(0, width - n.size(), '0');
    out.push_back(n);
  }
  return out;
}

void expand_braces(const std::string& item, const std::string& pattern, std::vector<std::string>& out) {
  const size_t open = item.find('{');
  if (open == std::string::npos) {
    out.push_back(item);
    return;
  }
  const size_t close = item.find('}', open);
  for (const auto& alt : brace_alternatives(item.substr(open + 1, close - open - 1), pattern))
    expand_braces(item.substr(0, open) + alt + item.substr(close + 1), pattern, out);
}

bool is_image_extension(std::string ext) {
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == "jpg" || ext == "jpeg" || ext == "png";
}

int64_t parse_class(const std::vector<uint8_t>& bytes, const std::string& shard, const std::string& key) {
  std::string text(bytes.begin(), bytes.end());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  check_user(all_digits(text) && text.size() <= 12,
             "shard " + shard + ": sample " + key + " has a .cls that is not a class number: '" + text.substr(0, 20) +
                 "'.",
             "a .cls file holds the label as decimal text, e.g. 3.");
  return std::stoll(text);
}

// The order in which a buffer of `capacity` samples lets n samples out:
// filled with the first `capacity`, it hands out a random one and takes the
// next in its place. out[k] is the input index of the k-th sample out.
std::vector<int64_t> shuffle_through_buffer(int64_t n, int64_t capacity, KeyedRandom rng) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  if (capacity <= 1) {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  std::vector<int64_t> buffer;
  int64_t next = 0;
  while (next < n && static_cast<int64_t>(buffer.size()) < capacity) buffer.push_back(next++);
  while (!buffer.empty()) {
    const auto k = static_cast<size_t>(rng.below(static_cast<int64_t>(buffer.size())));
    out.push_back(buffer[k]);
    if (next < n) {
      buffer[k] = next++;
    } else {
      buffer[k] = buffer.back();
      buffer.pop_back();
    }
  }
  return out;
}

std::string fields_of(const ShardSample& sample) {
  std::string out;
  for (const auto& [ext, bytes] : sample.fields) out += (out.empty() ? "." : ", .") + ext;
  return out;
}

void check_streams_divide(int64_t streams, int64_t world) {
  check_user(world >= 1 && streams >= 1 && streams % world == 0,
             "--shard-streams " + std::to_string(streams) + " is not a multiple of the world size " +
                 std::to_string(world) + ".",
             "the stream count is fixed when a run starts (its world size unless given): resume on a number of "
             "ranks that divides it, or start the run with --shard-streams set to a multiple of every world size "
             "you will use (e.g. 8).");
}

constexpr uint64_t kShardShuffleTag = 0x7368617264730001ull, kBufferShuffleTag = 0x7368617264730002ull;

}  // namespace

std::vector<std::string> expand_shard_pattern(const std::string& pattern) {
  std::vector<std::string> out;
  for (const auto& item : split_top_level(pattern, pattern))
    if (!item.empty()) expand_braces(item, pattern, out);
  check_user(!out.empty(), "shard pattern '" + pattern + "' names no file.", kShardPatternHint);
  return out;
}

std::pair<std::string, std::string> split_member_name(const std::string& name) {
  const size_t slash = name.rfind('/');
  const size_t dot = name.find('.', slash == std::string::npos ? 0 : slash + 1);
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

ShardReader::ShardReader(const std::string& path) : tar_(path) {}

bool ShardReader::next(ShardSample* sample, ShardRead what) {
  sample->key.clear();
  sample->fields.clear();
  std::string name;
  int64_t size = 0;
  if (have_pending_) {
    name = pending_name_;
    have_pending_ = false;
  } else if (!tar_.next(&name, &size)) {
    return false;
  }
  auto [key, ext] = split_member_name(name);
  sample->key = key;
  for (;;) {
    check_user(!sample->fields.count(ext),
               "shard " + path() + ": sample " + key + " has two ." + ext + " files.",
               "give every file of a sample its own extension (key.jpg, key.cls, ...).");
    const bool read = what == ShardRead::kAll || (what == ShardRead::kLabel && ext == "cls");
    sample->fields[ext] = read ? tar_.read() : std::vector<uint8_t>{};
    if (!tar_.next(&name, &size)) return true;
    auto [next_key, next_ext] = split_member_name(name);
    if (next_key != key) {
      have_pending_ = true;
      pending_name_ = name;
      return true;
    }
    ext = next_ext;
  }
}

int64_t ShardIndex::shard_of(int64_t id) const {
  return static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), id) - first.begin()) - 1;
}

std::vector<int64_t> ShardIndex::shard_sizes() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i + 1 < first.size(); ++i) out.push_back(first[i + 1] - first[i]);
  return out;
}

const std::vector<uint8_t>* image_field(const ShardSample& sample) {
  for (const auto& [ext, bytes] : sample.fields)
    if (is_image_extension(ext)) return &bytes;
  return nullptr;
}

ShardIndex scan_shards(const std::vector<std::string>& paths, const ShardScanOptions& o) {
  ShardIndex index;
  index.paths = paths;
  index.first.push_back(0);
  for (const auto& path : paths) {
    ShardReader reader(path);
    ShardSample s;
    for (int64_t ordinal = 0; reader.next(&s, o.image() ? ShardRead::kLabel : ShardRead::kNothing); ++ordinal) {
      std::string lacks;
      if (o.image() && image_field(s) == nullptr) lacks = "image (.jpg, .jpeg or .png)";
      else if (o.image() && !s.fields.count("cls")) lacks = "class (.cls)";
      for (const auto& ext : o.fields())
        if (lacks.empty() && !s.fields.count(ext)) lacks = "." + ext;
      if (!lacks.empty()) {
        check_user(o.skip_incomplete(),
                   "shard " + path + ": sample " + s.key + " has no " + lacks + "; its files: " +
                       fields_of(s) + ".",
                   "write the shard again with ddptrain shards, leave the shard out, or pass --skip-bad-samples.");
        index.left_out.push_back(path + ": " + s.key + " (no " + lacks + ")");
        continue;
      }
      index.keys.push_back(s.key);
      index.ordinals.push_back(ordinal);
      if (o.image()) index.labels.push_back(parse_class(s.fields.at("cls"), path, s.key));
    }
    index.first.push_back(static_cast<int64_t>(index.keys.size()));
  }
  return index;
}

// ---- fields ----

FieldDecoder integer_field(const std::string& name) {
  return [name](const std::vector<uint8_t>& bytes, const std::string& where) {
    std::string text(bytes.begin(), bytes.end());
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    const bool negative = !text.empty() && text[0] == '-';
    check_user(all_digits(text.substr(negative ? 1 : 0)) && text.size() <= 18,
               where + " is not an integer: '" + text.substr(0, 20) + "'.", "write it as decimal text, e.g. 3.");
    return TensorDict{{name, torch::tensor(static_cast<int64_t>(std::stoll(text)), torch::kLong)}};
  };
}

FieldDecoder numbers_field(const std::string& name) {
  return [name](const std::vector<uint8_t>& bytes, const std::string& where) {
    std::string text(bytes.begin(), bytes.end());
    for (char& ch : text)
      if (ch == ',' || ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
    // The CSV reader's numbers: locale-independent, finite float32.
    std::string record;
    std::istringstream words(text);
    int64_t n = 0;
    for (std::string w; words >> w; ++n) record += (n ? "," : "") + w;
    check_user(n > 0, where + " holds no number.", "write its numbers as decimal text, e.g. 0.5 1.25 -3.");
    std::string header;
    for (int64_t i = 0; i < n; ++i) header += (i ? ",v" : "v") + std::to_string(i);
    const CsvTable t = parse_csv(header + "\n" + record + "\n", where);
    std::vector<std::string> names(t.names);
    return TensorDict{{name, t.floats(names)[0]}};
  };
}

FieldDecoder float32_field(const std::string& name) {
  return [name](const std::vector<uint8_t>& bytes, const std::string& where) {
    check_user(!bytes.empty() && bytes.size() % 4 == 0,
               where + " has " + std::to_string(bytes.size()) + " bytes, not a whole number of float32 values.",
               "write the values as raw little-endian float32 (numpy: a.astype('<f4').tobytes()).");
    auto t = torch::empty({static_cast<int64_t>(bytes.size() / 4)}, torch::kFloat);
    std::memcpy(t.data_ptr<float>(), bytes.data(), bytes.size());
    return TensorDict{{name, t}};
  };
}

FieldDecoder csv_field(const CsvOptions& options) {
  return [options](const std::vector<uint8_t>& bytes, const std::string& where) {
    const CsvTable t = parse_csv(std::string(bytes.begin(), bytes.end()), where, options);
    check_user(t.rows == 1, where + " holds " + std::to_string(t.rows) + " records; a sample's .csv holds one.",
               "write the shards with ddptrain shards FILE.csv OUT (a header line and one record per sample).");
    TensorDict out;
    for (const auto& name : t.names) out[name] = t.column(name)[0];
    return out;
  };
}

int64_t stream_epoch_samples(int64_t total, int64_t streams, int64_t world) {
  check_streams_divide(streams, world);
  if (total == 0) return 0;
  return streams * ((total + streams - 1) / streams) / world;
}

StreamPlan plan_stream_order(const std::vector<int64_t>& shard_sizes, const StreamOrderOptions& o) {
  const int64_t S = o.streams(), W = o.world(), r = o.rank();
  check_streams_divide(S, W);
  TORCH_CHECK(r >= 0 && r < W, "stream plan: rank ", r, " outside [0, ", W, ")");
  std::vector<int64_t> first(shard_sizes.size() + 1, 0);
  std::partial_sum(shard_sizes.begin(), shard_sizes.end(), first.begin() + 1);
  const int64_t N = first.back();
  std::vector<int64_t> order(shard_sizes.size());
  std::iota(order.begin(), order.end(), 0);
  if (o.shuffle()) {
    KeyedRandom rng(hash_words({o.seed(), static_cast<uint64_t>(o.epoch()), kShardShuffleTag}));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
  }
  StreamPlan plan;
  plan.sequence.reserve(static_cast<size_t>(N));
  for (int64_t shard : order)
    for (int64_t k = first[static_cast<size_t>(shard)]; k < first[static_cast<size_t>(shard) + 1]; ++k)
      plan.sequence.push_back(k);
  if (N == 0) return plan;
  const int64_t Q = (N + S - 1) / S;
  plan.per_stream = Q;
  std::map<int64_t, std::vector<int64_t>> out_order;  // this rank's streams: output k -> raw index
  for (int64_t s = r; s < S; s += W)
    out_order[s] = shuffle_through_buffer(
        Q, o.shuffle() ? o.shuffle_buffer() : 1,
        KeyedRandom(hash_words({o.seed(), static_cast<uint64_t>(o.epoch()), static_cast<uint64_t>(s), kBufferShuffleTag})));
  const int64_t M = stream_epoch_samples(N, S, W);
  plan.ids.resize(static_cast<size_t>(M));
  plan.stream.resize(static_cast<size_t>(M));
  plan.raw.resize(static_cast<size_t>(M));
  for (int64_t p = 0; p < M; ++p) {
    const int64_t g = p * W + r, s = g % S, j = out_order[s][static_cast<size_t>(g / S)];
    plan.ids[static_cast<size_t>(p)] = plan.sequence[static_cast<size_t>((s * Q + j) % N)];
    plan.stream[static_cast<size_t>(p)] = s;
    plan.raw[static_cast<size_t>(p)] = j;
  }
  return plan;
}

// ---- the dataset ----

// One stream of the armed epoch. Its samples are read by a thread of their
// own rather than by the loader workers: a worker that read them itself
// would hold the stream while reading a batch's worth of tar members (tens
// of MB), so every other worker of the rank waited on it, and all of them
// stalled whenever it was descheduled; an image folder's workers each read
// their own files. The reader reads the stream's raw samples in order
// (sequential I/O, one shard open at a time), keeping what this rank needs
// in `ready`; a worker only waits for its samples there and moves them out,
// under `mutex`, briefly.
//
// `ready` is bounded: the reader reads a needed sample only while `ready`
// holds fewer than `capacity` (the shuffle buffer, whose samples wait in it
// anyway, plus kReadAheadBatches of the largest share of a batch asked of
// this stream), or when a worker has asked for that sample or a later one,
// so a worker asking far ahead never waits on room that only it could
// free.
constexpr int64_t kReadAheadBatches = 4;

struct ShardDataset::Stream {
  int64_t number = 0;                    // in the plan
  std::vector<int64_t> position_of_raw;  // this rank's position of each raw sample, -1: another rank's
  int64_t end = 0;                       // raw samples from here on are not needed: the reader stops
  std::thread reader;
  std::atomic<bool> stop{false};

  std::mutex mutex;                    // guards what follows
  std::condition_variable readable;    // a sample was read, the reader failed, or stop
  std::condition_variable room;        // a sample was taken, asked for, or stop
  std::unordered_map<int64_t, Needed> ready;  // raw index -> what is needed, read but not yet taken
  int64_t read_through = 0;            // raw samples before it are read (or passed over)
  int64_t furthest_asked = -1;         // the furthest raw sample a worker has asked for
  int64_t capacity = 1;                // samples `ready` may hold beyond those asked for
  std::exception_ptr error;            // why the reader stopped at read_through, if it failed
  std::vector<int64_t> entered;        // raw samples at which the reader opened a shard
  size_t entries_checked = 0;          // `entered` items a worker has checked the shard of
  int64_t waiting = 0;                 // workers waiting on `readable`
};

struct ShardDataset::Streams {
  StreamOrderOptions options;
  StreamPlan plan;
  int64_t first_position = 0;
  std::map<int64_t, std::unique_ptr<Stream>> by_stream;
  // Whether epoch + 1 follows (set when the trainer asks for this epoch:
  // an epoch armed ahead does not yet know), the readers still reading,
  // and whether the next epoch was armed. Atomics: the last reader to
  // finish and the thread that adopts an epoch armed ahead may each be
  // the one that sees both conditions.
  std::atomic<bool> follows{false};
  std::atomic<int64_t> reading{0};
  std::atomic<bool> next_armed{false};

  // Stops and joins the readers (each stops before its next sample);
  // workers waiting on them read by index instead.
  void disarm() {
    for (auto& [s, c] : by_stream) {
      {
        std::lock_guard<std::mutex> lock(c->mutex);
        c->stop = true;
      }
      c->room.notify_all();
      c->readable.notify_all();
    }
    for (auto& [s, c] : by_stream)
      if (c->reader.joinable()) c->reader.join();
  }
  ~Streams() { disarm(); }
};

ShardDataset::ShardDataset(ShardIndex index, ShardDatasetOptions options, std::string name)
    : index_(std::move(index)), options_(std::move(options)), name_(std::move(name)) {
  // The GPU path decodes at full size: so do its samples decoded here.
  if (options_.scaled_jpeg_decode() && !options_.gpu_decode()) decode_.min_side(decode_min_side(options_.transform()));
  for (int64_t label : index_.labels) num_classes_ = std::max(num_classes_, label + 1);
  TORCH_CHECK(!options_.image() || index_.labels.size() == index_.keys.size(), name_,
              ": image shards scanned without their labels (ShardScanOptions::image)");
  if (index_.ordinals.empty())  // an index built by hand: every sample of every shard
    for (size_t i = 0; i + 1 < index_.first.size(); ++i)
      for (int64_t k = 0; k < index_.first[i + 1] - index_.first[i]; ++k) index_.ordinals.push_back(k);
}

ShardDataset::~ShardDataset() {
  // streams_' readers may arm next_: stopped first.
  if (streams_) streams_->disarm();
  if (next_) next_->disarm();
}

std::vector<int64_t> ShardDataset::input_shape() const {
  if (!options_.image()) return {};
  return {3, options_.transform().size(), options_.transform().size()};
}

int64_t ShardDataset::skipped(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(skipped_mutex_);
  auto it = skipped_.find(epoch);
  return it == skipped_.end() ? 0 : it->second;
}

std::string ShardDataset::fingerprint() const {
  Fingerprint f;
  for (size_t i = 0; i + 1 < index_.first.size(); ++i) {
    f.add(index_.first[i + 1] - index_.first[i]);
    for (int64_t id = index_.first[i]; id < index_.first[i + 1]; ++id) {
      f.add(index_.keys[static_cast<size_t>(id)]);
      if (options_.image()) f.add(index_.labels[static_cast<size_t>(id)]);
    }
  }
  return f.hex();
}

std::shared_ptr<ShardDataset::Streams> ShardDataset::arm(const StreamOrderOptions& options,
                                                         int64_t first_position) const {
  auto armed = std::make_shared<Streams>();
  armed->options = options;
  armed->plan = plan_stream_order(index_.shard_sizes(), options);
  armed->first_position = first_position;
  const StreamPlan& plan = armed->plan;
  for (size_t p = 0; p < plan.ids.size(); ++p) {
    auto& c = armed->by_stream[plan.stream[p]];
    if (!c) {
      c = std::make_unique<Stream>();
      c->number = plan.stream[p];
      c->position_of_raw.assign(static_cast<size_t>(plan.per_stream), -1);
      c->capacity = options.shuffle() ? std::max<int64_t>(1, options.shuffle_buffer()) : 1;
    }
    c->position_of_raw[static_cast<size_t>(plan.raw[p])] = static_cast<int64_t>(p);
    if (static_cast<int64_t>(p) >= first_position) c->end = std::max(c->end, plan.raw[p] + 1);
  }
  armed->reading = static_cast<int64_t>(armed->by_stream.size());
  for (auto& [s, c] : armed->by_stream) {
    Stream* stream = c.get();
    c->reader = std::thread([this, st = armed.get(), stream] { read_stream(*st, *stream); });
  }
  return armed;
}

namespace {
// The same epoch's order: every option but next_epoch_follows.
bool same_order(const StreamOrderOptions& a, const StreamOrderOptions& b) {
  return a.seed() == b.seed() && a.epoch() == b.epoch() && a.streams() == b.streams() &&
         a.shuffle_buffer() == b.shuffle_buffer() && a.shuffle() == b.shuffle() && a.rank() == b.rank() &&
         a.world() == b.world();
}
}  // namespace

std::vector<int64_t> ShardDataset::epoch_order(const StreamOrderOptions& options, int64_t first_position) const {
  std::shared_ptr<Streams> armed, old, unused;
  {
    // The epoch armed ahead, if it is this one: its readers have a head start.
    std::lock_guard<std::mutex> lock(mutex_);
    if (next_ && first_position == next_->first_position && same_order(next_->options, options))
      armed = std::move(next_);
    else
      unused = std::move(next_);
  }
  if (unused) unused->disarm();
  if (!armed) armed = arm(options, first_position);
  std::vector<int64_t> ids = armed->plan.ids;
  Streams& now = *armed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    old = std::move(streams_);
    streams_ = std::move(armed);
  }
  if (old) old->disarm();
  now.follows = options.next_epoch_follows();
  arm_next_when_read(now);  // its readers may all be done already
  return ids;
}

void ShardDataset::arm_next_when_read(Streams& st) const {
  if (!st.follows || st.reading > 0) return;
  {
    // Not (or no longer) the armed epoch: not yet adopted (epoch_order
    // asks again once it is), or re-armed meanwhile.
    std::lock_guard<std::mutex> lock(mutex_);
    if (streams_.get() != &st) return;
  }
  if (st.next_armed.exchange(true)) return;
  auto options = st.options;
  auto next = arm(options.epoch(options.epoch() + 1).next_epoch_follows(false), 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (streams_.get() == &st && !next_) next_ = std::move(next);
  }
  if (next) next->disarm();  // not installed: stopped here, outside the lock
}

bool ShardDataset::take(ShardSample& sample, Needed* out) const {
  if (options_.image()) {
    bool found = false;
    for (auto& [ext, bytes] : sample.fields)
      if (is_image_extension(ext)) {
        out->image = std::move(bytes);
        found = true;
        break;
      }
    if (!found) return false;
  }
  out->fields.clear();
  for (const auto& f : options_.fields()) {
    auto it = sample.fields.find(f.extension);
    if (it == sample.fields.end()) return false;
    out->fields.push_back(std::move(it->second));
  }
  return true;
}

namespace {

// Reads samples of `shard` up to its sample at `ordinal` (the one wanted,
// read whole), checking that the wanted sample is still `expected`.
void read_to(ShardReader& reader, int64_t& next_ordinal, int64_t ordinal, bool needed, const std::string& expected,
             ShardSample* sample) {
  for (; next_ordinal <= ordinal; ++next_ordinal) {
    const bool last = next_ordinal == ordinal;
    const bool more = reader.next(sample, last && needed ? ShardRead::kAll : ShardRead::kNothing);
    check_user(more && (!last || sample->key == expected),
               "shard " + reader.path() + " changed during the run: sample " + expected + " is " +
                   (more ? "now " + sample->key : "gone") + ".",
               "restore the shard as it was when the run started, or start a new run.");
  }
}

const char* const kChangedHint = "restore the shard as it was when the run started, or start a new run.";

void check_shard_present(const std::string& path, const std::string& key) {
  check_user(std::filesystem::exists(path), "shard " + path + " vanished during the epoch, before its sample " + key + ".",
             "put the shard back and resume the run (--resume auto).");
}

}  // namespace

void ShardDataset::read_stream(Streams& st, Stream& c) const {
  const StreamPlan& plan = st.plan;
  const int64_t N = index_.size(), Q = plan.per_stream;
  std::unique_ptr<ShardReader> reader;
  int64_t shard = -1, next_ordinal = 0;
  try {
    for (int64_t j = 0; j < c.end && !c.stop; ++j) {
      const bool needed = c.position_of_raw[static_cast<size_t>(j)] >= st.first_position;
      if (needed) {
        std::unique_lock<std::mutex> lock(c.mutex);
        c.room.wait(lock, [&] {
          return c.stop || j <= c.furthest_asked || static_cast<int64_t>(c.ready.size()) < c.capacity;
        });
        if (c.stop) break;
      }
      const int64_t id = plan.sequence[static_cast<size_t>((c.number * Q + j) % N)];
      const int64_t sh = index_.shard_of(id), ordinal = index_.ordinals[static_cast<size_t>(id)];
      const std::string& path = index_.paths[static_cast<size_t>(sh)];
      const std::string& key = index_.keys[static_cast<size_t>(id)];
      if (shard != sh || next_ordinal > ordinal) {
        reader.reset();
        check_shard_present(path, key);
        reader = std::make_unique<ShardReader>(path);
        shard = sh;
        next_ordinal = 0;
        std::lock_guard<std::mutex> lock(c.mutex);
        c.entered.push_back(j);
      }
      ShardSample sample;
      Needed got;
      read_to(*reader, next_ordinal, ordinal, needed, key, &sample);
      if (needed)
        check_user(take(sample, &got),
                   "shard " + path + " changed during the run: sample " + key + " lacks a field now.", kChangedHint);
      bool wake = false;
      {
        std::lock_guard<std::mutex> lock(c.mutex);
        if (needed) c.ready.emplace(j, std::move(got));
        c.read_through = j + 1;
        wake = c.waiting > 0;
      }
      if (wake) c.readable.notify_all();
    }
  } catch (...) {
    // Kept for the workers asking for this sample or a later one: each
    // gets the error, as it would have reading the stream itself.
    std::lock_guard<std::mutex> lock(c.mutex);
    c.error = std::current_exception();
  }
  c.readable.notify_all();
  bool read_all = false;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    read_all = !c.stop && !c.error && c.read_through >= c.end;
  }
  if (read_all && --st.reading == 0) arm_next_when_read(st);
}

bool ShardDataset::stream_samples(Streams& st, const std::vector<int64_t>& indices, int64_t first_position,
                                  std::vector<Needed>* out) const {
  const StreamPlan& plan = st.plan;
  const int64_t N = index_.size(), Q = plan.per_stream;
  std::map<int64_t, int64_t> share;  // stream -> samples of this batch it holds
  for (size_t j = 0; j < indices.size(); ++j) ++share[plan.stream[static_cast<size_t>(first_position) + j]];
  const int64_t window = st.options.shuffle() ? std::max<int64_t>(1, st.options.shuffle_buffer()) : 1;
  for (const auto& [s, n] : share) {
    Stream& c = *st.by_stream.at(s);
    {
      std::lock_guard<std::mutex> lock(c.mutex);
      c.capacity = std::max(c.capacity, window + kReadAheadBatches * n);
    }
    c.room.notify_all();
  }
  out->clear();
  for (size_t j = 0; j < indices.size(); ++j) {
    const auto p = static_cast<size_t>(first_position) + j;
    const int64_t s = plan.stream[p], want = plan.raw[p];
    Stream& c = *st.by_stream.at(s);
    std::unique_lock<std::mutex> lock(c.mutex);
    if (want > c.furthest_asked) {
      c.furthest_asked = want;
      c.room.notify_all();
    }
    ++c.waiting;
    c.readable.wait(lock, [&] { return c.read_through > want || c.error || c.stop; });
    --c.waiting;
    if (c.read_through <= want) {
      if (c.error) std::rethrow_exception(c.error);
      return false;  // disarmed
    }
    // A shard that vanished after the reader opened it stops the epoch
    // where it would without the read-ahead: at the first sample asked for
    // from that shard on, whatever the reader's timing.
    for (; c.entries_checked < c.entered.size() && c.entered[c.entries_checked] <= want; ++c.entries_checked) {
      const int64_t id = plan.sequence[static_cast<size_t>((s * Q + c.entered[c.entries_checked]) % N)];
      check_shard_present(index_.paths[static_cast<size_t>(index_.shard_of(id))],
                          index_.keys[static_cast<size_t>(id)]);
    }
    auto it = c.ready.find(want);
    TORCH_CHECK(it != c.ready.end(), name_, ": stream ", s, " sample ", want, " was not read or already taken");
    out->push_back(std::move(it->second));
    c.ready.erase(it);
    lock.unlock();
    c.room.notify_all();
  }
  return true;
}

std::vector<ShardDataset::Needed> ShardDataset::indexed_samples(const std::vector<int64_t>& indices) const {
  indexed_reads_ += static_cast<int64_t>(indices.size());
  std::vector<Needed> out(indices.size());
  std::vector<size_t> by_id(indices.size());
  std::iota(by_id.begin(), by_id.end(), 0);
  std::stable_sort(by_id.begin(), by_id.end(), [&](size_t a, size_t b) { return indices[a] < indices[b]; });
  std::unique_ptr<ShardReader> reader;
  int64_t shard = -1, next_ordinal = 0;
  ShardSample sample;
  for (size_t k = 0; k < by_id.size(); ++k) {
    const int64_t id = indices[by_id[k]];
    TORCH_CHECK(id >= 0 && id < size(), name_, ": index ", id, " outside [0, ", size(), ")");
    if (k > 0 && indices[by_id[k - 1]] == id) {
      out[by_id[k]] = out[by_id[k - 1]];
      continue;
    }
    const int64_t s = index_.shard_of(id);
    const std::string& path = index_.paths[static_cast<size_t>(s)];
    const std::string& key = index_.keys[static_cast<size_t>(id)];
    if (s != shard) {
      reader = std::make_unique<ShardReader>(path);
      shard = s;
      next_ordinal = 0;
    }
    read_to(*reader, next_ordinal, index_.ordinals[static_cast<size_t>(id)], true, key, &sample);
    check_user(take(sample, &out[by_id[k]]),
               "shard " + path + " changed during the run: sample " + key + " lacks a field now.", kChangedHint);
  }
  return out;
}

TensorDict ShardDataset::decode_fields(const Needed& needed, int64_t id) const {
  TensorDict out;
  const std::string where = "shard " + index_.paths[static_cast<size_t>(index_.shard_of(id))] + ": sample " +
                            index_.keys[static_cast<size_t>(id)] + "'s .";
  for (size_t f = 0; f < options_.fields().size(); ++f) {
    const ShardField& field = options_.fields()[f];
    for (auto& [name, t] : field.decode(needed.fields[f], where + field.extension)) {
      check_user(!out.contains(name) && (!options_.image() || (name != "input" && name != "target")),
                 where + field.extension + " gives '" + name + "', which the sample has already.",
                 "give each field's tensors names of their own.");
      out[name] = t;
    }
  }
  return out;
}

ShardDataset::Decoded ShardDataset::decode_sample(const Needed& needed, int64_t id, const DrawKey& key,
                                                  int64_t position) const {
  Decoded d;
  d.id = id;
  if (options_.image()) {
    const std::string& path = index_.paths[static_cast<size_t>(index_.shard_of(id))];
    const std::string& sample = index_.keys[static_cast<size_t>(id)];
    try {
      CropBox box;
      d.crop = decode_image_box(needed.image.data(), needed.image.size(), path + ":" + sample, decode_,
                                [&](int64_t h, int64_t w) {
                                  d.window = transform_window(h, w, options_.transform(), key, position);
                                  return d.window.source;
                                },
                                &box);
    } catch (const CorruptImage& e) {
      throw UserError("shard " + path + ": sample " + sample + "'s image does not decode: " + e.reason() + ".",
                      "write the shard again from a good copy of the image, leave the shard out, or pass "
                      "--skip-bad-samples.");
    }
    d.window.source = CropBox{0, 0, d.crop.size(0), d.crop.size(1)};
  }
  d.fields = decode_fields(needed, id);
  return d;
}

ShardDataset::Decoded ShardDataset::decode_or_replace(const Needed& needed, int64_t id, const DrawKey& key,
                                                      int64_t position) const {
  if (!options_.skip_bad()) return decode_sample(needed, id, key, position);
  const int64_t shard = index_.shard_of(id), first = index_.first[static_cast<size_t>(shard)];
  const int64_t count = index_.first[static_cast<size_t>(shard) + 1] - first;
  std::string reason;
  for (int64_t step = 0; step < count; ++step) {
    const int64_t r = first + (id - first + step) % count;
    try {
      Decoded d = step == 0 ? decode_sample(needed, r, key, position)
                            : decode_sample(indexed_samples({r})[0], r, key, position);
      if (step > 0) {
        std::lock_guard<std::mutex> lock(skipped_mutex_);
        ++skipped_[key.epoch];
        if (!warned_[id])
          std::fprintf(stderr, "%s rank %lld: warning: %s; replaced by sample %s of its shard (--skip-bad-samples).\n",
                       program_name(), static_cast<long long>(key.rank), reason.c_str(),
                       index_.keys[static_cast<size_t>(r)].c_str());
        warned_[id] = true;
      }
      return d;
    } catch (const UserError& e) {
      if (step == 0) {  // the message without its hint and final stop
        reason = std::string(e.what()).substr(0, std::string(e.what()).find(" Hint: "));
        if (!reason.empty() && reason.back() == '.') reason.pop_back();
      }
    }
  }
  throw UserError("shard " + index_.paths[static_cast<size_t>(shard)] + ": no sample decodes (the first: " + reason +
                      ").",
                  "write the shard again from good copies, or leave it out.");
}

namespace {

// The samples' fields, name by name, stacked; UserError if one sample's
// tensor has another shape than the first's.
void stack_fields(const std::vector<TensorDict>& fields, const std::vector<std::string>& keys, Batch& batch) {
  if (fields.empty()) return;
  for (const auto& [name, first] : fields[0]) {
    std::vector<torch::Tensor> parts;
    for (size_t j = 0; j < fields.size(); ++j) {
      check_user(fields[j].contains(name) && fields[j].at(name).sizes() == first.sizes(),
                 "sample " + keys[j] + "'s '" + name + "' is not shaped as sample " + keys[0] + "'s " +
                     c10::str(first.sizes()) + ".",
                 "give this field the same shape in every sample.");
      parts.push_back(fields[j].at(name));
    }
    batch[name] = torch::stack(parts);
  }
}

}  // namespace

Batch ShardDataset::decode_batch(const std::vector<Needed>& samples, const std::vector<int64_t>& indices,
                                 const DrawKey& key, int64_t first_position) const {
  const int64_t size = options_.transform().size(), b = static_cast<int64_t>(indices.size());
  Batch batch;
  if (options_.image()) batch = Batch{torch::empty({b, 3, size, size}), torch::empty({b}, torch::kLong)};
  std::vector<TensorDict> fields;
  std::vector<std::string> keys;
  for (int64_t j = 0; j < b; ++j) {
    const Decoded d = decode_or_replace(samples[static_cast<size_t>(j)], indices[static_cast<size_t>(j)], key,
                                        first_position + j);
    if (options_.image()) {
      batch.input()[j].copy_(apply_transform_window(d.crop, d.window, options_.transform()));
      batch.target()[j] = index_.labels[static_cast<size_t>(d.id)];
    }
    fields.push_back(d.fields);
    keys.push_back(index_.keys[static_cast<size_t>(d.id)]);
  }
  stack_fields(fields, keys, batch);
  return batch;
}

EncodedSample ShardDataset::crop_on_cpu(const Decoded& d) const {
  EncodedSample s;
  s.kind = kEncodedRgb;
  s.index = d.id;
  s.label = index_.labels[static_cast<size_t>(d.id)];
  s.window = d.window;
  const torch::Tensor crop = d.crop.contiguous();
  s.height = crop.size(0);
  s.width = crop.size(1);
  s.bytes.assign(crop.data_ptr<uint8_t>(), crop.data_ptr<uint8_t>() + crop.numel());
  return s;
}

Batch ShardDataset::encoded(std::vector<Needed>& samples, const std::vector<int64_t>& indices, const DrawKey& key,
                            int64_t first_position) const {
  std::vector<EncodedSample> encoded;
  std::vector<TensorDict> fields;
  std::vector<std::string> keys;
  encoded.reserve(indices.size());
  for (size_t j = 0; j < indices.size(); ++j) {
    const int64_t id = indices[j], position = first_position + static_cast<int64_t>(j);
    std::optional<EncodedSample> jpeg;
    std::optional<TensorDict> jpeg_fields;
    if (!uses_cpu_decode(position, options_.cpu_decode_share())) {
      try {
        jpeg_fields = decode_fields(samples[j], id);
      } catch (const UserError&) {
        if (!options_.skip_bad()) throw;  // else the CPU path below replaces the sample
      }
      if (jpeg_fields)
        jpeg = plain_jpeg_sample(samples[j].image, id, index_.labels[static_cast<size_t>(id)], options_.transform(),
                                 key, position);
    }
    if (jpeg) {
      encoded.push_back(std::move(*jpeg));
      fields.push_back(std::move(*jpeg_fields));
      keys.push_back(index_.keys[static_cast<size_t>(id)]);
    } else {
      const Decoded d = decode_or_replace(samples[j], id, key, position);
      encoded.push_back(crop_on_cpu(d));
      fields.push_back(d.fields);
      keys.push_back(index_.keys[static_cast<size_t>(d.id)]);
    }
  }
  Batch batch = encoded_batch(encoded, key, first_position);
  stack_fields(fields, keys, batch);
  return batch;
}

std::shared_ptr<DeviceStage> ShardDataset::device_stage() const {
  if (!options_.gpu_decode()) return nullptr;
  std::call_once(stage_once_, [this] {
    // A file nvJPEG rejects is decoded here, read again by its index.
    stage_ = make_gpu_jpeg_stage(options_.transform(), options_.gpu_decode_in_flight(),
                                 [this](int64_t id, const DrawKey& key, int64_t position) {
                                   return crop_on_cpu(decode_sample(indexed_samples({id})[0], id, key, position));
                                 });
  });
  return stage_;
}

Batch ShardDataset::get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key,
                                    int64_t first_position) const {
  std::shared_ptr<Streams> st;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    st = streams_;
  }
  const bool armed_for_it =
      st && st->options.seed() == key.seed && st->options.epoch() == key.epoch && st->options.rank() == key.rank &&
      first_position >= st->first_position &&
      first_position + static_cast<int64_t>(indices.size()) <= static_cast<int64_t>(st->plan.ids.size()) &&
      std::equal(indices.begin(), indices.end(), st->plan.ids.begin() + first_position);
  std::vector<Needed> samples;
  if (!armed_for_it || !stream_samples(*st, indices, first_position, &samples)) samples = indexed_samples(indices);
  if (options_.gpu_decode() && options_.image()) return encoded(samples, indices, key, first_position);
  return decode_batch(samples, indices, key, first_position);
}

Batch ShardDataset::get_batch(const std::vector<int64_t>& indices) const {
  return decode_batch(indexed_samples(indices), indices, DrawKey{}, 0);
}

Example ShardDataset::get(int64_t index) const {
  Batch b = get_batch({index});
  Example e;
  for (auto& [name, t] : b) e[name] = t[0];
  return e;
}

Splits load_image_shards(const ShardSplitOptions& options) {
  require_libarchive("--dataset shards");
  check_user(!options.val_pattern().empty(), "--dataset shards needs validation shards, and no --val-root is given.",
             "pass --val-root 'val-{0000..0003}.tar' (ddptrain shards writes them from an image folder).");
  const auto scan = ShardScanOptions().skip_incomplete(options.skip_bad());
  ShardIndex train = scan_shards(expand_shard_pattern(options.pattern()), scan);
  check_user(train.size() > 0, "the shards " + options.pattern() + " hold no sample.",
             "check --data_root; ddptrain shards writes shards from an image folder.");
  ShardIndex val = scan_shards(expand_shard_pattern(options.val_pattern()), scan);
  for (const auto* split : {&train, &val})
    if (!split->left_out.empty())
      std::fprintf(stderr, "%s: warning: %zu incomplete sample(s) left out (--skip-bad-samples), the first: %s.\n",
                   program_name(), split->left_out.size(), split->left_out[0].c_str());
  int64_t classes = 0;
  for (int64_t label : train.labels) classes = std::max(classes, label + 1);
  for (size_t i = 0; i < val.labels.size(); ++i)
    check_user(val.labels[i] < classes,
               "validation sample " + val.keys[i] + " has class " + std::to_string(val.labels[i]) +
                   ", but the training shards have classes 0 to " + std::to_string(classes - 1) + ".",
               "write both from folders with the same class sub-folders.");
  auto transform = ImageTransformOptions().size(options.image_size());
  Splits splits;
  splits.mean = kImageNetMean;
  splits.std = kImageNetStd;
  splits.train_augmented = true;
  const auto decode = ShardDatasetOptions()
                          .gpu_decode(options.gpu_decode())
                          .cpu_decode_share(options.cpu_decode_share())
                          .skip_bad(options.skip_bad());
  splits.train = std::make_shared<ShardDataset>(
      std::move(train), ShardDatasetOptions(decode).transform(ImageTransformOptions(transform).train(options.augment())),
      "shards " + options.pattern() + " (train)");
  splits.val = std::make_shared<ShardDataset>(
      std::move(val), ShardDatasetOptions(decode).transform(ImageTransformOptions(transform).train(false)),
      "shards " + options.val_pattern() + " (val)");
  splits.test = empty_like(splits.val, "shards (no test split)");
  return splits;
}

}  // namespace ddp::data
