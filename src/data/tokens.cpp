// Token files, the byte-level text corpus and the LM windows (tokens.h).
#include "ddp/data/tokens.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "ddp/data/counter_rng.h"
#include "ddp/data/identity.h"
#include "ddp/data/shards.h"  // expand_shard_pattern
#include "ddp/error.h"

namespace fs = std::filesystem;

namespace ddp::data {

// ---- TokenBuffer -------------------------------------------------------------

TokenBuffer::TokenBuffer(std::vector<uint16_t> tokens, std::string source)
    : owned_(std::move(tokens)), source_(std::move(source)) {
  data_ = owned_.data();
  size_ = static_cast<int64_t>(owned_.size());
}

TokenBuffer::TokenBuffer(const std::string& path, int64_t offset, int64_t count) : source_(path) {
  size_ = count;
  if (count == 0) return;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  check_user(fd >= 0, "cannot open " + path + ": " + std::strerror(errno) + ".", "check the path and its permissions.");
  map_bytes_ = static_cast<size_t>(offset + 2 * count);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file open
  check_user(map_ != MAP_FAILED, "cannot map " + path + ": " + std::strerror(err) + ".", "check the file.");
  data_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map_) + offset);
}

TokenBuffer::~TokenBuffer() {
  if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
}

uint16_t TokenBuffer::largest() const {
  std::call_once(largest_once_, [this] {
    uint16_t m = 0;
    for (int64_t i = 0; i < size_; ++i) m = std::max(m, data_[i]);  // vectorised; page-cache speed
    largest_ = m;
  });
  return largest_;
}

// ---- token files ---------------------------------------------------------------

TokenBufferPtr read_token_file(const std::string& path) {
  const std::string fix =
      "--data_root needs train.bin and val.bin as nanoGPT's prepare.py or llm.c's data scripts write them "
      "(uint16 tokens, optionally after llm.c's 1024-byte header).";
  std::error_code ec;
  check_user(!fs::is_directory(path, ec), path + " is a directory, not a token file.", fix);
  check_user(fs::is_regular_file(path, ec), "token file " + path + " does not exist.", fix);
  const auto bytes = static_cast<int64_t>(fs::file_size(path, ec));
  check_user(!ec, "cannot read the size of " + path + ".", "check its permissions.");
  int32_t header[3] = {0, 0, 0};
  if (bytes >= kLlmcHeaderBytes) {
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(header), sizeof(header));
    check_user(static_cast<bool>(in), "cannot read " + path + ".", "check its permissions.");
  }
  // llm.c's layout (version, and a count that the size agrees with) with
  // another magic: a damaged header, or a format not ddptrain's, whose 512
  // header tokens must not be trained on.
  check_user(header[0] == kLlmcMagic || !(header[1] == kLlmcVersion && header[2] > 0 &&
                                          kLlmcHeaderBytes + 2 * static_cast<int64_t>(header[2]) == bytes),
             path + " is laid out as llm.c's token files are, but its magic " + std::to_string(header[0]) +
                 " is not llm.c's " + std::to_string(kLlmcMagic) + ".",
             "the header is damaged or the file is in another format: write it again with llm.c's GPT-2 data "
             "scripts, or as raw uint16 tokens.");
  if (header[0] == kLlmcMagic) {
    // A raw uint16 file cannot start like this: the low half of the magic is
    // token 54632, beyond GPT-2's vocabulary.
    check_user(header[1] == kLlmcVersion,
               path + " has llm.c's header but version " + std::to_string(header[1]) + "; ddptrain reads version " +
                   std::to_string(kLlmcVersion) + " (uint16 GPT-2 tokens).",
               "write it with llm.c's GPT-2 data scripts, or as raw uint16 tokens.");
    const int64_t count = header[2];
    check_user(count > 0 && kLlmcHeaderBytes + 2 * count == bytes,
               path + " has llm.c's header for " + std::to_string(count) + " tokens, but " +
                   std::to_string(bytes - kLlmcHeaderBytes) + " bytes of tokens follow it (expected " +
                   std::to_string(2 * std::max<int64_t>(count, 0)) + ").",
               "the file is truncated or damaged: write it again.");
    return std::make_shared<TokenBuffer>(path, kLlmcHeaderBytes, count);
  }
  check_user(bytes > 0 && bytes % 2 == 0,
             path + " has " + std::to_string(bytes) + " bytes, " +
                 (bytes == 0 ? std::string("no tokens") : std::string("not a whole number of uint16 tokens")) + ".",
             fix);
  return std::make_shared<TokenBuffer>(path, 0, bytes / 2);
}

std::vector<TokenBufferPtr> read_token_files(const std::string& pattern) {
  std::vector<TokenBufferPtr> out;
  for (const auto& item : expand_shard_pattern(pattern)) {
    glob_t found{};
    const int r = ::glob(item.c_str(), 0, nullptr, &found);
    std::vector<std::string> paths(found.gl_pathv, found.gl_pathv + (r == 0 ? found.gl_pathc : 0));
    globfree(&found);
    check_user(!paths.empty(), "no token file matches " + item + " (of --data_root " + pattern + ").",
               "name token files by a glob (dir/fineweb_train_*.bin), a brace pattern or a comma-separated list.");
    std::sort(paths.begin(), paths.end());
    for (const auto& path : paths) out.push_back(read_token_file(path));
  }
  return out;
}

// ---- the text corpus -------------------------------------------------------------

TextCorpus read_text_corpus(const std::string& path, double val_fraction) {
  std::error_code ec;
  check_user(fs::exists(path, ec),
             "no text corpus at " + path + (path == kFortunesDir ? " (the fortunes package is not installed)." : "."),
             "apt-get install fortunes (./setup.sh does), or pass --data_root DIR with train.bin and val.bin, or a "
             "directory of text files.");
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const auto name = e.path().filename().string();
      if (e.is_symlink() || !e.is_regular_file() || name.empty() || name[0] == '.' || e.path().extension() == ".dat")
        continue;
      files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  TextCorpus out;
  std::vector<uint16_t> train, val;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    check_user(!in.bad(), "cannot read " + f.string() + ".", "check its permissions.");
    // Text has no NUL bytes; a binary file would be trained on as bytes.
    check_user(text.find('\0') == std::string::npos, f.string() + " is not text (it holds NUL bytes).",
               "give --data_root a folder of text files only, or one with train.bin and val.bin (uint16 tokens, "
               "nanoGPT's layout).");
    const auto n = static_cast<int64_t>(text.size());
    const int64_t cut = n - static_cast<int64_t>(static_cast<double>(n) * val_fraction);
    for (int64_t i = 0; i < n; ++i) (i < cut ? train : val).push_back(static_cast<unsigned char>(text[static_cast<size_t>(i)]));
    ++out.files;
  }
  const size_t bytes = train.size() + val.size();
  check_user(bytes > 0, "the text corpus " + path + " is empty.",
             "pass --data_root with text files, or train.bin and val.bin.");
  check_user(!val.empty(),
             "the text corpus " + path + " holds only " + std::to_string(bytes) +
                 " bytes, too few to hold back a part for validation.",
             "give it more text (training needs a few kilobytes at least), or train.bin and val.bin.");
  out.train = std::make_shared<TokenBuffer>(std::move(train), path + " (train)");
  out.val = std::make_shared<TokenBuffer>(std::move(val), path + " (val)");
  return out;
}

// ---- windows -------------------------------------------------------------------------

TokenWindows::TokenWindows(TokenBufferPtr tokens, TokenWindowsOptions options)
    : TokenWindows(std::vector<TokenBufferPtr>{std::move(tokens)}, std::move(options)) {}

TokenWindows::TokenWindows(std::vector<TokenBufferPtr> files, TokenWindowsOptions options)
    : files_(std::move(files)), o_(std::move(options)) {
  TORCH_CHECK(!files_.empty(), "TokenWindows needs tokens");
  check_user(o_.context() > 0, "the context must be positive, got " + std::to_string(o_.context()) + ".");
  first_token_.push_back(0);
  first_start_.push_back(0);
  for (const auto& tokens : files_) {
    TORCH_CHECK(tokens != nullptr, "TokenWindows needs tokens");
    const int64_t n = tokens->size();
    check_user(n > o_.context(), tokens->source() + " holds " + std::to_string(n) + " tokens, too few for one window of " +
                                     std::to_string(o_.context() + 1) + ".",
               "use more data or a smaller --context.");
    // Every token, once, before training: a bad id deep in the file would
    // otherwise stop the run whenever a batch first drew it.
    const uint16_t largest = tokens->largest();
    check_user(largest < o_.vocab_size(), tokens->source() + " holds token id " + std::to_string(largest) +
                                              ", beyond the model's vocabulary of " + std::to_string(o_.vocab_size()) + ".",
               "pass --vocab-size " + std::to_string(largest + 1) + " or more (GPT-2 tokens need 50257).");
    first_token_.push_back(first_token_.back() + n);
    // A window is context + 1 tokens: n - context random starts in a file,
    // or (n - 1) / context tiles.
    first_start_.push_back(first_start_.back() + (o_.random() ? n - o_.context() : (n - 1) / o_.context()));
  }
  const int64_t n = first_token_.back();
  if (o_.random()) {
    size_ = o_.windows() > 0 ? o_.windows() : std::max<int64_t>(1, n / o_.context());
  } else {
    const int64_t fit = first_start_.back();
    size_ = o_.windows() > 0 ? std::min(o_.windows(), fit) : fit;
  }
}

int64_t TokenWindows::start_of(int64_t index, uint64_t seed, int64_t epoch) const {
  // The k-th start over all files (drawn, or the k-th tile), then its file.
  const int64_t k =
      o_.random()
          ? KeyedRandom(hash_words({seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(index), 0x6c6dull}))
                .below(first_start_.back())
          : index;
  const auto f =
      static_cast<size_t>(std::upper_bound(first_start_.begin(), first_start_.end(), k) - first_start_.begin()) - 1;
  const int64_t within = k - first_start_[f];
  return first_token_[f] + (o_.random() ? within : within * o_.context());
}

Batch TokenWindows::gather(const std::vector<int64_t>& starts) const {
  const int64_t b = static_cast<int64_t>(starts.size()), t = o_.context();
  auto input = torch::empty({b, t}, torch::kLong), target = torch::empty({b, t}, torch::kLong);
  int64_t* x = input.data_ptr<int64_t>();
  int64_t* y = target.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t start = starts[static_cast<size_t>(i)];
    const auto f =
        static_cast<size_t>(std::upper_bound(first_token_.begin(), first_token_.end(), start) - first_token_.begin()) - 1;
    const uint16_t* w = files_[f]->data() + (start - first_token_[f]);
    for (int64_t j = 0; j < t; ++j) {
      x[i * t + j] = w[j];
      y[i * t + j] = w[j + 1];
    }
  }
  return Batch(input, target);  // every id is below the vocabulary (the constructor checked)
}

std::string TokenWindows::fingerprint() const {
  // The count and evenly spread runs of the tokens, mapped or in memory:
  // a few pages of a token file of any size.
  constexpr int64_t kRun = 16;
  Fingerprint f;
  for (const auto& tokens : files_) {
    const int64_t n = tokens->size();
    f.add(n).add_rows(tokens->data(), n / kRun, kRun * sizeof(uint16_t));
  }
  return f.hex();
}

Example TokenWindows::get(int64_t index) const {
  auto b = gather({start_of(index, 0, 0)});
  return Batch(b.input()[0], b.target()[0]);
}

Batch TokenWindows::get_batch(const std::vector<int64_t>& indices) const {
  return get_keyed_batch(indices, DrawKey{}, 0);
}

Batch TokenWindows::get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key, int64_t) const {
  std::vector<int64_t> starts;
  starts.reserve(indices.size());
  for (int64_t i : indices) starts.push_back(start_of(i, key.seed, key.epoch));
  return gather(starts);
}

}  // namespace ddp::data
