// Writing shards from an image folder, a CSV file or token files (shards.h).
#include "ddp/cmd/shards.h"

#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <sstream>

#include "ddp/cmd/subcommand.h"
#include "ddp/data/counter_rng.h"
#include "ddp/data/csv.h"
#include "ddp/data/image_codec.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/tar.h"
#include "ddp/data/tokens.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"  // write_file_atomic

namespace fs = std::filesystem;

namespace ddp {

namespace {

constexpr const char* kOverwriteHint = "remove the old shards or pass another OUT prefix.";

std::string shard_name(const std::string& out, size_t i, const char* ext) {
  char number[16];
  std::snprintf(number, sizeof number, "%06zu", i);
  return out + "-" + number + ext;
}

// The name of shard i, refused if that file exists: shards are never
// overwritten.
std::string new_shard_name(const std::string& out, size_t i, const char* ext) {
  const std::string name = shard_name(out, i, ext);
  check_user(!fs::exists(name), name + " already exists; shards are never overwritten.", kOverwriteHint);
  return name;
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// The key of sample i: its number, then its path below the root without
// the extension, '/' and '.' made '_'.
std::string sample_key(size_t i, const std::string& path, const std::string& root) {
  std::string rel = fs::path(path).lexically_relative(root).replace_extension().string();
  for (char& ch : rel)
    if (ch == '/' || ch == '.') ch = '_';
  char number[24];
  std::snprintf(number, sizeof number, "%07zu_", i);
  return number + rel;
}

std::string image_extension(const std::string& path) {
  std::string ext = lower(fs::path(path).extension().string());
  if (!ext.empty()) ext.erase(0, 1);
  return ext == "jpeg" ? "jpg" : ext;
}

// Checks shared by every source, before anything is read or written.
void check_out(const ShardWriteOptions& o, const char* ext) {
  check_user(o.shard_mb > 0, "--shard-mb must be positive.", "e.g. --shard-mb 256.");
  check_user(o.shard_samples >= 0, "--shard-samples must be 0 (no limit) or positive.");
  (void)new_shard_name(o.out, 0, ext);
  const fs::path parent = fs::path(o.out).parent_path();
  check_user(parent.empty() || fs::is_directory(parent), "the folder of " + o.out + " does not exist.",
             "create it first (mkdir -p " + parent.string() + ").");
}

// 0 .. n-1 permuted by (seed): every shard holds a mix of the source.
std::vector<size_t> write_order(size_t n, uint64_t seed) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  data::KeyedRandom rng(data::hash_words({seed, 0x7772697465ull}));
  for (size_t i = order.size(); i > 1; --i)
    std::swap(order[i - 1], order[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
  return order;
}

// Tar shards filled sample by sample, each closed before it would pass the
// size or sample limit.
class TarShards {
 public:
  explicit TarShards(const ShardWriteOptions& o)
      : o_(o), limit_(static_cast<int64_t>(o.shard_mb * 1024 * 1024)) {}

  void add(const std::string& key, const std::vector<std::pair<std::string, std::string>>& fields) {
    int64_t need = 0;
    for (const auto& f : fields) need += 512 + static_cast<int64_t>((f.second.size() + 511) / 512 * 512);
    if (shard_ && in_shard_ > 0 &&
        (shard_->bytes() + need > limit_ || (o_.shard_samples > 0 && in_shard_ >= o_.shard_samples))) {
      shard_->close();
      shard_.reset();
    }
    if (!shard_) {
      written_.push_back(new_shard_name(o_.out, written_.size(), ".tar"));
      shard_ = std::make_unique<data::TarWriter>(written_.back());
      in_shard_ = 0;
    }
    for (const auto& [ext, bytes] : fields) shard_->add(key + "." + ext, bytes.data(), bytes.size());
    ++in_shard_;
  }

  std::vector<std::string> close() {
    if (shard_) shard_->close();
    shard_.reset();
    return written_;
  }

 private:
  const ShardWriteOptions& o_;
  int64_t limit_;
  std::unique_ptr<data::TarWriter> shard_;
  int64_t in_shard_ = 0;
  std::vector<std::string> written_;
};

std::vector<std::string> write_image_shards(const ShardWriteOptions& o) {
  data::require_libarchive("ddptrain shards");
  check_out(o, ".tar");
  const data::ImageFolderIndex files = data::scan_image_folder(o.source);
  const auto order = write_order(files.paths.size(), o.seed);
  TarShards shards(o);
  for (size_t i = 0; i < order.size(); ++i) {
    const std::string& path = files.paths[order[i]];
    const std::vector<uint8_t> bytes = data::read_image_file(path);
    shards.add(sample_key(i, path, files.root), {{image_extension(path), std::string(bytes.begin(), bytes.end())},
                                                 {"cls", std::to_string(files.labels[order[i]])}});
  }
  auto written = shards.close();
  std::ofstream classes(o.out + "-classes.txt");
  for (const auto& c : files.classes) classes << c << "\n";
  check_user(static_cast<bool>(classes), "cannot write " + o.out + "-classes.txt.", "check the output folder.");
  return written;
}

// The header line and the records of a CSV file, as read_csv splits them
// into lines (a record never spans lines; blank lines are passed over).
std::vector<std::string> csv_lines(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (lines.empty() && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);
    if (line.find_first_not_of(" \t") != std::string::npos) lines.push_back(line);
  }
  return lines;
}

std::vector<std::string> write_csv_shards(const ShardWriteOptions& o) {
  data::require_libarchive("ddptrain shards");
  check_out(o, ".tar");
  std::ifstream f(o.source, std::ios::binary);
  check_user(static_cast<bool>(f), "cannot read the CSV file " + o.source + ".", "check the path and its permissions.");
  std::ostringstream text;
  text << f.rdbuf();
  // Refused here as training would refuse it (line, column and value named).
  const auto table = data::parse_csv(text.str(), o.source);
  check_user(table.rows > 0, o.source + " has a header and no record.", "give it at least one record.");
  const auto lines = csv_lines(text.str());
  TORCH_CHECK(static_cast<int64_t>(lines.size()) == table.rows + 1, "shards: ", o.source, " split into ",
              lines.size(), " lines for ", table.rows, " records");
  const auto order = write_order(static_cast<size_t>(table.rows), o.seed);
  TarShards shards(o);
  for (size_t row : order) {
    char key[24];
    std::snprintf(key, sizeof key, "%09zu", row);
    shards.add(key, {{"csv", lines[0] + "\n" + lines[row + 1] + "\n"}});
  }
  return shards.close();
}

std::vector<std::string> write_token_shards(const ShardWriteOptions& o) {
  check_out(o, ".bin");
  const auto files = data::read_token_files(o.source);
  const int64_t per_shard = o.shard_samples > 0
                                ? o.shard_samples
                                : (static_cast<int64_t>(o.shard_mb * 1024 * 1024) - data::kLlmcHeaderBytes) / 2;
  check_user(per_shard > 0,
             "--shard-mb " + std::to_string(o.shard_mb) + " leaves no room for a token after the 1 KiB header.",
             "pass a larger --shard-mb, or --shard-samples (tokens per shard).");
  check_user(per_shard <= INT32_MAX, "a token shard of " + std::to_string(per_shard) + " tokens is more than llm.c's "
                                     "header can count (2^31 - 1).", "pass a smaller --shard-mb or --shard-samples.");
  std::vector<std::string> written;
  std::string shard;
  auto flush = [&] {
    const auto count = static_cast<int32_t>((shard.size() - data::kLlmcHeaderBytes) / 2);
    std::memcpy(&shard[8], &count, 4);
    written.push_back(new_shard_name(o.out, written.size(), ".bin"));
    write_file_atomic(written.back(), shard);
    shard.clear();
  };
  for (const auto& file : files) {
    for (int64_t at = 0; at < file->size();) {
      if (shard.empty()) {
        const int32_t header[3] = {data::kLlmcMagic, data::kLlmcVersion, 0};
        shard.assign(static_cast<size_t>(data::kLlmcHeaderBytes), '\0');
        std::memcpy(&shard[0], header, sizeof header);
      }
      const int64_t have = static_cast<int64_t>(shard.size() - data::kLlmcHeaderBytes) / 2;
      const int64_t take = std::min(per_shard - have, file->size() - at);
      shard.append(reinterpret_cast<const char*>(file->data() + at), static_cast<size_t>(take) * 2);
      at += take;
      if (have + take == per_shard) flush();
    }
  }
  if (!shard.empty()) flush();
  return written;
}

}  // namespace

ShardSource shard_source(const std::string& source) {
  std::error_code ec;
  if (fs::is_directory(source, ec)) return ShardSource::kImageFolder;
  const std::string ext = lower(fs::path(source).extension().string());
  if (ext == ".csv") return ShardSource::kCsv;
  return ShardSource::kTokens;
}

std::vector<std::string> write_shards(const ShardWriteOptions& o) {
  switch (shard_source(o.source)) {
    case ShardSource::kImageFolder: return write_image_shards(o);
    case ShardSource::kCsv: return write_csv_shards(o);
    case ShardSource::kTokens: break;
  }
  std::error_code ec;
  check_user(o.source.find_first_of("*?[{,") != std::string::npos || fs::exists(o.source, ec),
             "ddptrain shards: " + o.source + " does not exist.",
             "give an image folder, a .csv file, or token files (a file, a glob, a brace pattern or a list).");
  return write_token_shards(o);
}

int shards_command(const std::vector<std::string>& args, const std::string& program) {
  const std::string usage = "usage: " + program +
                            " shards SOURCE OUT [--shard-mb MB] [--shard-samples N] [--seed S]   "
                            "(SOURCE: an image folder, a .csv file or token files)";
  CLI::App app{program + " shards: write an image folder (<class>/<image>) or a CSV file as tar shards for "
               "--dataset shards, or token files as numbered token files for --task lm."};
  ShardWriteOptions o;
  app.add_option("source", o.source,
                 "an image folder (one sub-folder per class), a CSV file (*.csv), or token files (a file, glob, brace "
                 "pattern or list; raw uint16 or llm.c's layout)")
      ->required();
  app.add_option("out", o.out, "the shards' path prefix: OUT-000000.tar (.bin for tokens), OUT-000001.tar, ...")
      ->required();
  app.add_option("--shard-mb", o.shard_mb, "largest shard, in MiB")->capture_default_str();
  app.add_option("--shard-samples", o.shard_samples,
                 "most samples in a shard: images, CSV records or tokens (0: no limit)")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the order images and records are written in")->capture_default_str();
  if (!parse_subcommand(app, args, usage)) return exit_code::kOk;
  const ShardSource kind = shard_source(o.source);
  const auto shards = write_shards(o);
  char last[16];
  std::snprintf(last, sizeof last, "%06zu", shards.empty() ? size_t{0} : shards.size() - 1);
  const char* ext = kind == ShardSource::kTokens ? ".bin" : ".tar";
  std::printf("wrote %zu shard(s): %s-{000000..%s}%s", shards.size(), o.out.c_str(), last, ext);
  if (kind == ShardSource::kImageFolder) std::printf(" (classes: %s-classes.txt)", o.out.c_str());
  std::printf("\n");
  return exit_code::kOk;
}

}  // namespace ddp
