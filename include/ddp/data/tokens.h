// Token data for language models: token files, a byte-level text corpus,
// and the windows that --task lm trains on.
//
// Token files are what nanoGPT's and llm.c's data preparation scripts write,
// read as they are: train.bin and val.bin under --data_root, either raw
// little-endian uint16 tokens (nanoGPT) or llm.c's layout, a header of 256
// int32 (magic 20240520, version 1, token count) before the uint16 tokens.
// The layout is told by the header. Files are memory-mapped, so a corpus of
// billions of tokens costs no load time and no private memory.
//
// A text corpus is tokenised at the byte level (vocabulary 256): the text
// files of a directory (Debian's fortunes package by default), each split
// into its first 90% for training and its last 10% for validation, so that
// both splits sample every file.
//
// Windows: one sample is context + 1 consecutive tokens; "input" is the
// first context tokens, "target" the same shifted by one. Training windows
// start at random offsets drawn from (seed, epoch, sample index) alone, not
// from the rank or the batch, so the samples of an epoch are the same for
// any number of ranks (2 ranks x B see what 1 rank x 2B sees) and a resumed
// epoch draws what the interrupted one would have. An epoch is `windows`
// samples (default: training tokens / context, one pass in expectation).
// Validation windows tile the validation tokens without overlap, in order.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ddp/data/dataset.h"

namespace ddp::data {

/// Tokens in memory or memory-mapped, read-only.
class TokenBuffer {
 public:
  /// Takes ownership of tokens held in memory.
  explicit TokenBuffer(std::vector<uint16_t> tokens, std::string source);
  /// Maps `count` tokens at byte `offset` of `path`.
  TokenBuffer(const std::string& path, int64_t offset, int64_t count);
  ~TokenBuffer();
  TokenBuffer(const TokenBuffer&) = delete;
  TokenBuffer& operator=(const TokenBuffer&) = delete;

  const uint16_t* data() const { return data_; }
  int64_t size() const { return size_; }
  /// Where the tokens come from, for messages.
  const std::string& source() const { return source_; }
  /// The largest token id: one pass over the tokens, on first use.
  uint16_t largest() const;

 private:
  mutable std::once_flag largest_once_;
  mutable uint16_t largest_ = 0;
  std::vector<uint16_t> owned_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* data_ = nullptr;
  int64_t size_ = 0;
  std::string source_;
};

using TokenBufferPtr = std::shared_ptr<const TokenBuffer>;

/// llm.c's token file header: 256 int32, of which these three are read.
constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

/// Reads a token file (nanoGPT's raw uint16 or llm.c's header layout).
/// UserError naming the path for a missing, empty or malformed file.
TokenBufferPtr read_token_file(const std::string& path);

/// Several token files read as one stream (llm.c's and nanoGPT's FineWeb
/// shards, fineweb_train_000001.bin ...): `pattern` is a glob
/// (dir/fineweb_train_*.bin), a brace pattern (train_{01..09}.bin) or a
/// comma-separated list, each item's matches sorted by name. UserError
/// naming the item that matches no file, or a malformed file.
std::vector<TokenBufferPtr> read_token_files(const std::string& pattern);

/// The byte-level tokens of a text corpus: `path` is one text file or a
/// directory of them (regular files, sorted by name; *.dat index files,
/// symbolic links and hidden files are skipped). Each file's first
/// (1 - val_fraction) goes to train, the rest to validation.
struct TextCorpus {
  TokenBufferPtr train, val;
  int64_t files = 0;
};
TextCorpus read_text_corpus(const std::string& path, double val_fraction = 0.1);

/// Where Debian's fortunes package keeps its text (apt-get install fortunes).
constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct TokenWindowsOptions {
  /// Tokens per input (the model's context).
  TORCH_ARG(int64_t, context) = 64;
  /// Token ids must be below this (the model's vocabulary).
  TORCH_ARG(int64_t, vocab_size) = 256;
  /// Random windows (training) or the validation tiling.
  TORCH_ARG(bool, random) = true;
  /// Samples in the dataset: training windows per epoch (0: tokens /
  /// context); validation windows at most (0: all that fit).
  TORCH_ARG(int64_t, windows) = 0;
  /// Shown in logs.
  TORCH_ARG(std::string, name) = "tokens";
};

/// Windows of a token buffer as {"input", "target"} int64 tensors of
/// `context` tokens each.
class TokenWindows : public Dataset {
 public:
  TokenWindows(TokenBufferPtr tokens, TokenWindowsOptions options);
  /// Several files as one stream: a window never spans two files. Training
  /// starts are drawn over every file's starts together (so a file weighs
  /// as much as it holds), validation tiles file after file; with one file
  /// both are exactly the single-file windows.
  TokenWindows(std::vector<TokenBufferPtr> files, TokenWindowsOptions options);

  int64_t size() const override { return size_; }
  /// Training windows: the draw of epoch 0 with seed 0 (the Loader calls
  /// get_keyed_batch, which uses the run's seed and epoch).
  Example get(int64_t index) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  Batch get_keyed_batch(const std::vector<int64_t>& indices, const DrawKey& key, int64_t first_position) const override;
  std::vector<int64_t> input_shape() const override { return {o_.context()}; }
  /// The vocabulary: next-token prediction has one class per token id.
  int64_t num_classes() const override { return o_.vocab_size(); }
  std::string name() const override { return o_.name(); }
  std::string fingerprint() const override;

  /// Where window `index` starts in the token buffer, for this seed and
  /// epoch (training), or at index * context (validation). With several
  /// files: the position in the files' tokens one after another.
  int64_t start_of(int64_t index, uint64_t seed, int64_t epoch) const;

 private:
  Batch gather(const std::vector<int64_t>& starts) const;

  std::vector<TokenBufferPtr> files_;
  std::vector<int64_t> first_token_;  // files_.size() + 1: file f's tokens start at first_token_[f]
  std::vector<int64_t> first_start_;  // files_.size() + 1: random starts (or tiles) before file f
  TokenWindowsOptions o_;
  int64_t size_ = 0;
};

}  // namespace ddp::data
