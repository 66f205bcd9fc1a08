// libarchive behind TarReader and TarWriter (tar.h).
#include "ddp/data/tar.h"

#include <cstdio>
#include <filesystem>

#include "ddp/error.h"

#ifdef DDP_WITH_LIBARCHIVE
#include <archive.h>
#include <archive_entry.h>
#endif

namespace ddp::data {

bool have_libarchive() {
#ifdef DDP_WITH_LIBARCHIVE
  return true;
#else
  return false;
#endif
}

void require_libarchive(const std::string& what) {
  check_user(have_libarchive(), what + " reads and writes tar shards, but this build has no libarchive.",
             "install libarchive-dev (Debian/Ubuntu: apt-get install libarchive-dev) and rebuild (./setup.sh).");
}

#ifdef DDP_WITH_LIBARCHIVE

namespace {
// libarchive's message for the last failure ("" when it has none).
std::string archive_why(archive* a) {
  const char* why = archive_error_string(a);
  return why ? why : "unknown error";
}
}  // namespace

struct TarReader::Impl {
  archive* a = nullptr;
  ~Impl() {
    if (a) archive_read_free(a);
  }
};

TarReader::TarReader(const std::string& path) : impl_(std::make_unique<Impl>()), path_(path) {
  impl_->a = archive_read_new();
  TORCH_CHECK(impl_->a, "archive_read_new failed");
  archive_read_support_format_tar(impl_->a);
  archive_read_support_format_gnutar(impl_->a);
  if (archive_read_open_filename(impl_->a, path.c_str(), 1 << 16) != ARCHIVE_OK)
    throw UserError("shard " + path + " cannot be opened: " + archive_why(impl_->a) + ".",
                    "check that the file exists and is a tar file (ddptrain shards writes them).");
}

TarReader::~TarReader() = default;

bool TarReader::next(std::string* name, int64_t* size) {
  if (ended_) return false;  // libarchive refuses another call after the end
  for (;;) {
    archive_entry* e = nullptr;
    const int r = archive_read_next_header(impl_->a, &e);
    if (r == ARCHIVE_EOF) {
      ended_ = true;
      return false;
    }
    if (r < ARCHIVE_WARN) {
      throw UserError("shard " + path_ + " is damaged after " + (last_.empty() ? "its start" : "member " + last_) +
                          ": " + archive_why(impl_->a) + ".",
                      "write the shard again (ddptrain shards), or leave it out of the list.");
    }
    if (archive_entry_filetype(e) != AE_IFREG) continue;
    last_ = archive_entry_pathname(e) ? archive_entry_pathname(e) : "";
    *name = last_;
    *size = archive_entry_size(e);
    return true;
  }
}

std::vector<uint8_t> TarReader::read() {
  std::vector<uint8_t> out;
  const void* buf = nullptr;
  size_t len = 0;
  la_int64_t offset = 0;
  for (;;) {
    const int r = archive_read_data_block(impl_->a, &buf, &len, &offset);
    if (r == ARCHIVE_EOF) break;
    if (r < ARCHIVE_WARN) {
      throw UserError("shard " + path_ + " is damaged in member " + last_ + ": " + archive_why(impl_->a) + ".",
                      "write the shard again (ddptrain shards), or leave it out of the list.");
    }
    if (static_cast<size_t>(offset) > out.size()) out.resize(static_cast<size_t>(offset));  // a sparse hole
    out.insert(out.end(), static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + len);
  }
  return out;
}

struct TarWriter::Impl {
  archive* a = nullptr;
  archive_entry* e = nullptr;
  ~Impl() {
    if (e) archive_entry_free(e);
    if (a) archive_write_free(a);
  }
};

TarWriter::TarWriter(const std::string& path) : impl_(std::make_unique<Impl>()), path_(path) {
  impl_->a = archive_write_new();
  impl_->e = archive_entry_new();
  TORCH_CHECK(impl_->a && impl_->e, "archive_write_new failed");
  archive_write_set_format_pax_restricted(impl_->a);  // ustar headers unless a name needs more
  archive_write_set_bytes_in_last_block(impl_->a, 1);  // no padding to 10 KiB after the end marker
  if (archive_write_open_filename(impl_->a, (path + ".tmp").c_str()) != ARCHIVE_OK)
    throw UserError("cannot write " + path + ".tmp: " + archive_why(impl_->a) + ".",
                    "check that the output folder exists and is writable.");
}

TarWriter::~TarWriter() {
  if (closed_) return;
  impl_.reset();
  std::error_code ec;
  std::filesystem::remove(path_ + ".tmp", ec);
}

void TarWriter::add(const std::string& name, const void* data, size_t size) {
  archive_entry_clear(impl_->e);
  archive_entry_set_pathname(impl_->e, name.c_str());
  archive_entry_set_filetype(impl_->e, AE_IFREG);
  archive_entry_set_perm(impl_->e, 0644);
  archive_entry_set_size(impl_->e, static_cast<la_int64_t>(size));
  archive_entry_set_mtime(impl_->e, 0, 0);
  const bool ok = archive_write_header(impl_->a, impl_->e) == ARCHIVE_OK &&
                  archive_write_data(impl_->a, data, size) == static_cast<la_ssize_t>(size);
  check_user(ok, "cannot write " + name + " into " + path_ + ".tmp: " + archive_why(impl_->a) + ".",
             "check the free space of the output folder.");
  bytes_ += 512 + static_cast<int64_t>((size + 511) / 512 * 512);
}

void TarWriter::close() {
  check_user(archive_write_close(impl_->a) == ARCHIVE_OK,
             "cannot finish " + path_ + ".tmp: " + archive_why(impl_->a) + ".",
             "check the free space of the output folder.");
  std::filesystem::rename(path_ + ".tmp", path_);
  closed_ = true;
}

#else  // no libarchive: every entry point refuses

struct TarReader::Impl {};
TarReader::TarReader(const std::string& path) : path_(path) { require_libarchive("reading " + path); }
TarReader::~TarReader() = default;
bool TarReader::next(std::string*, int64_t*) { return false; }
std::vector<uint8_t> TarReader::read() { return {}; }
struct TarWriter::Impl {};
TarWriter::TarWriter(const std::string& path) : path_(path) { require_libarchive("writing " + path); }
TarWriter::~TarWriter() = default;
void TarWriter::add(const std::string&, const void*, size_t) {}
void TarWriter::close() {}

#endif

}  // namespace ddp::data
