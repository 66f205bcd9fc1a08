// `ddptrain shards FOLDER OUT`: an image folder written as tar shards, the
// format --dataset shards streams (data/shards.h), in one command.
//
// The folder is scanned as --dataset imagefolder scans it (class
// sub-folders, sorted: label k is the k-th). Samples are written in an
// order shuffled with --seed, so that every shard holds a mix of classes
// (a stream's shuffle buffer only mixes what lies near in the stream), as
// OUT-000000.tar, OUT-000001.tar, ...; a shard is closed before it would
// pass --shard-mb MiB or --shard-samples samples. Each sample is the image
// file's bytes as they are (KEY.jpg or KEY.png) and its class (KEY.cls, the
// label as decimal text); KEY is the sample's number and its path below
// the folder, with '/' and '.' made '_' (a dot would end the key).
// OUT-classes.txt lists the class names, one a line, label order.
//
// Every shard is written to a temporary name and renamed when complete,
// and existing shards of OUT are never overwritten: a failed or repeated
// command loses nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp {

struct ShardWriteOptions {
  std::string folder;   // the image folder
  std::string out;      // shards are OUT-000000.tar, ...
  double shard_mb = 256;
  int64_t shard_samples = 0;  // 0: no limit
  uint64_t seed = 0;
};

/// Writes the shards; returns their paths, in order.
std::vector<std::string> write_image_shards(const ShardWriteOptions& options);

/// The `shards` subcommand; `args` are the words after "shards". Returns the
/// exit code; UserError propagates to the caller.
int shards_command(const std::vector<std::string>& args, const std::string& program);

}  // namespace ddp
