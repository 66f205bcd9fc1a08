// Writing tar shards from an image folder (shards.h).
#include "ddp/cmd/shards.h"

#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <memory>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>

#include "ddp/cmd/subcommand.h"
#include "ddp/data/counter_rng.h"
#include "ddp/data/image_codec.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/tar.h"
#include "ddp/error.h"

namespace fs = std::filesystem;

namespace ddp {

namespace {

std::string shard_name(const std::string& out, size_t i) {
  char number[16];
  std::snprintf(number, sizeof number, "%06zu", i);
  return out + "-" + number + ".tar";
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

std::string lower_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  if (!ext.empty()) ext.erase(0, 1);
  for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext == "jpeg" ? "jpg" : ext;
}

}  // namespace

std::vector<std::string> write_image_shards(const ShardWriteOptions& o) {
  data::require_libarchive("ddptrain shards");
  check_user(o.shard_mb > 0, "--shard-mb must be positive.", "e.g. --shard-mb 256.");
  check_user(o.shard_samples >= 0, "--shard-samples must be 0 (no limit) or positive.");
  check_user(!fs::exists(shard_name(o.out, 0)),
             shard_name(o.out, 0) + " already exists; shards are never overwritten.",
             "remove the old shards or pass another OUT prefix.");
  const fs::path parent = fs::path(o.out).parent_path();
  check_user(parent.empty() || fs::is_directory(parent), "the folder of " + o.out + " does not exist.",
             "create it first (mkdir -p " + parent.string() + ").");
  const data::ImageFolderIndex files = data::scan_image_folder(o.folder);
  // A permutation by (seed): every shard holds a mix of classes.
  std::vector<size_t> order(files.paths.size());
  std::iota(order.begin(), order.end(), 0);
  data::KeyedRandom rng(data::hash_words({o.seed, 0x7772697465ull}));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);

  const auto limit = static_cast<int64_t>(o.shard_mb * 1024 * 1024);
  std::vector<std::string> written;
  std::unique_ptr<data::TarWriter> shard;
  int64_t in_shard = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const std::string& path = files.paths[order[i]];
    const std::vector<uint8_t> bytes = data::read_image_file(path);
    const std::string label = std::to_string(files.labels[order[i]]);
    const int64_t need = 1024 + static_cast<int64_t>((bytes.size() + 511) / 512 * 512);
    if (shard && in_shard > 0 &&
        (shard->bytes() + need > limit || (o.shard_samples > 0 && in_shard >= o.shard_samples))) {
      shard->close();
      shard.reset();
    }
    if (!shard) {
      written.push_back(shard_name(o.out, written.size()));
      check_user(!fs::exists(written.back()), written.back() + " already exists; shards are never overwritten.",
                 "remove the old shards or pass another OUT prefix.");
      shard = std::make_unique<data::TarWriter>(written.back());
      in_shard = 0;
    }
    const std::string key = sample_key(i, path, files.root);
    shard->add(key + "." + lower_extension(path), bytes.data(), bytes.size());
    shard->add(key + ".cls", label.data(), label.size());
    ++in_shard;
  }
  if (shard) shard->close();
  std::ofstream classes(o.out + "-classes.txt");
  for (const auto& c : files.classes) classes << c << "\n";
  check_user(static_cast<bool>(classes), "cannot write " + o.out + "-classes.txt.", "check the output folder.");
  return written;
}

int shards_command(const std::vector<std::string>& args, const std::string& program) {
  const std::string usage = "usage: " + program +
                            " shards IMAGE_FOLDER OUT [--shard-mb MB] [--shard-samples N] [--seed S]   "
                            "(writes OUT-000000.tar, ...)";
  CLI::App app{program + " shards: write an image folder (<class>/<image>) as tar shards for --dataset shards."};
  ShardWriteOptions o;
  app.add_option("folder", o.folder, "the image folder: one sub-folder per class")->required();
  app.add_option("out", o.out, "the shards' path prefix: OUT-000000.tar, OUT-000001.tar, ...")->required();
  app.add_option("--shard-mb", o.shard_mb, "largest shard, in MiB")->capture_default_str();
  app.add_option("--shard-samples", o.shard_samples, "most samples in a shard (0: no limit)")->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the order the samples are written in")->capture_default_str();
  if (!parse_subcommand(app, args, usage)) return exit_code::kOk;
  const auto shards = write_image_shards(o);
  char last[16];
  std::snprintf(last, sizeof last, "%06zu", shards.empty() ? size_t{0} : shards.size() - 1);
  std::printf("wrote %zu shard(s): %s-{000000..%s}.tar (classes: %s-classes.txt)\n", shards.size(), o.out.c_str(), last,
              o.out.c_str());
  return exit_code::kOk;
}

}  // namespace ddp
