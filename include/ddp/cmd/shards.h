// `ddptrain shards SOURCE OUT`: data written as shards in one command, from
// an image folder, a CSV file or token files, in the formats --dataset
// shards (data/shards.h) and --task lm's token files (data/tokens.h) read.
//
// What SOURCE is decides what is written:
//   - an image folder (a directory), scanned as --dataset imagefolder scans
//     it (class sub-folders, sorted: label k is the k-th): tar shards
//     OUT-000000.tar, ... of samples KEY.jpg (or .png; the file's bytes as
//     they are) and KEY.cls (the label as decimal text), and
//     OUT-classes.txt, the class names one a line in label order. KEY is the
//     sample's number and its path below the folder, '/' and '.' made '_'
//     (a dot would end the key).
//   - a CSV file (a name ending in .csv), read as ddp::data::read_csv reads
//     it (refused as it would be): tar shards of samples KEY.csv, each the
//     header line and one record, so that a sample parses on its own into
//     the same named values; KEY is the record's number from 0, nine digits.
//   - token files (any other name: one file, a glob, a brace pattern or a
//     list, as --task lm's --data_root): their tokens, one stream in order,
//     cut into OUT-000000.bin, ... in llm.c's layout (a 256-int32 header,
//     then uint16 tokens), which --data_root 'OUT-*.bin' reads back as one
//     stream.
// Tar samples are written in an order shuffled with --seed, so that every
// shard holds a mix (a stream's shuffle buffer only mixes what lies near in
// the stream); tokens keep their order. A shard is closed before it would
// pass --shard-mb MiB or --shard-samples samples (images, records, tokens).
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
  std::string source;   // an image folder, a .csv file, or token files
  std::string out;      // shards are OUT-000000.tar (or .bin), ...
  double shard_mb = 256;
  int64_t shard_samples = 0;  // 0: no limit
  uint64_t seed = 0;
};

enum class ShardSource { kImageFolder, kCsv, kTokens };

/// What `source` is: a directory, a name ending in .csv (any case), or
/// token files.
ShardSource shard_source(const std::string& source);

/// Writes the shards of `options.source`, as shard_source() tells; returns
/// their paths, in order.
std::vector<std::string> write_shards(const ShardWriteOptions& options);

/// The `shards` subcommand; `args` are the words after "shards". Returns the
/// exit code; UserError propagates to the caller.
int shards_command(const std::vector<std::string>& args, const std::string& program);

}  // namespace ddp
