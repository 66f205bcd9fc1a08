// Tar files, read and written one member after another through libarchive.
//
// Shards (shards.h) are plain POSIX tar files, as WebDataset writes them:
// each is read in one sequential pass, so a member's data is read (or
// skipped, which libarchive does by seeking) before the next header. This
// header keeps libarchive out of the public interface; a build without it
// (no libarchive-dev) still compiles, and every entry point stops with a
// UserError that says how to get it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ddp::data {

/// Whether this build reads and writes tar files (libarchive was found).
bool have_libarchive();

/// UserError naming `what` (e.g. "--dataset shards") if this build has no
/// libarchive.
void require_libarchive(const std::string& what);

/// One tar file, member by member. Only regular files are returned
/// (directories and links are passed over).
class TarReader {
 public:
  /// UserError if `path` cannot be opened as a tar file.
  explicit TarReader(const std::string& path);
  ~TarReader();
  TarReader(const TarReader&) = delete;
  TarReader& operator=(const TarReader&) = delete;

  /// Moves to the next regular file; false at the end of the archive.
  /// The current member's data, if not read, is skipped. UserError if the
  /// archive is damaged or cut short, naming the file and the last member.
  bool next(std::string* name, int64_t* size);
  /// The current member's data; call at most once per member.
  std::vector<uint8_t> read();
  const std::string& path() const { return path_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  std::string last_;  // the last member's name, for errors
  bool ended_ = false;
};

/// A new tar file, written to PATH.tmp and renamed to PATH by close(): a
/// writer that fails or is destroyed unclosed leaves no half-written shard.
class TarWriter {
 public:
  explicit TarWriter(const std::string& path);
  ~TarWriter();
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  /// Appends a regular file (mode 0644, time 0, so the same input makes the
  /// same bytes).
  void add(const std::string& name, const void* data, size_t size);
  /// Finishes the archive and renames it into place.
  void close();
  /// Bytes the archive takes so far: 512-byte headers and padded data.
  int64_t bytes() const { return bytes_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  int64_t bytes_ = 0;
  bool closed_ = false;
};

}  // namespace ddp::data
