// The state_dict reader on hostile input: damaged and crafted files either
// load or give a UserError, never a crash, another exception or an
// allocation beyond a stated cap.
//
// Each case runs in a forked child whose address space may grow by at most
// kCap (RLIMIT_AS), so that a reader which believes a length field fails
// there instead of taking the machine's memory; a crash is reported as the
// signal that ended the child.
#include <caffe2/serialize/inline_container.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <set>

#include "ddp/error.h"
#include "ddp/io/torch_pickle.h"
#include "support/capped_child.h"
#include "support/testing.h"

namespace {

const std::string kDataDir = DDP_TEST_DATA_DIR;
constexpr size_t kCap = 256u << 20;  // what one read of a few-KB file may add to the address space

// Runs `body` in a child under kCap (support/capped_child.h).
std::string in_capped_child(const std::function<std::string()>& body) {
  return ddp::testing::in_capped_child(body, kCap);
}

// Reads `path`: "" if it loaded (every tensor readable) or threw a UserError
// that is not an allocation failure in disguise; else what went wrong.
std::string read_outcome(const std::string& path) {
  try {
    std::set<const void*> seen;
    uint64_t storage_bytes = 0;
    for (const auto& [name, t] : ddp::read_state_dict(path)) {
      t.clone();  // touches every element
      if (seen.insert(t.storage().data()).second) storage_bytes += t.storage().nbytes();
    }
    const uint64_t file_bytes = std::filesystem::file_size(path);
    if (storage_bytes > file_bytes)
      return "storages of " + std::to_string(storage_bytes) + " bytes from a " + std::to_string(file_bytes) +
             "-byte file";
    return "";
  } catch (const ddp::UserError& e) {
    const std::string m = e.what();
    if (m.find("alloc") != std::string::npos) return "an allocation failed: " + m;
    return "";
  } catch (const std::exception& e) {
    return std::string("not a UserError: ") + e.what();
  }
}

// The UserError message for `path`, or what happened instead ("!..." ).
std::string user_error_of(const std::string& path) {
  try {
    ddp::read_state_dict(path);
    return "!loaded";
  } catch (const ddp::UserError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("!not a UserError: ") + e.what();
  }
}

// ------------------------------------------------ crafted files

void put_le(std::string& s, size_t at, uint64_t v, size_t n) {
  for (size_t k = 0; k < n; ++k) s[at + k] = static_cast<char>(v >> (8 * k) & 0xff);
}

std::string le(uint64_t v, size_t n) {
  std::string s(n, '\0');
  put_le(s, 0, v, n);
  return s;
}

// A torch.save-style zip holding `pkl` as data.pkl and `storage` as data/0.
std::string write_zip(const std::string& path, const std::string& pkl, const std::string& storage) {
  caffe2::serialize::PyTorchStreamWriter zip(path);
  zip.writeRecord("data.pkl", pkl.data(), pkl.size());
  zip.writeRecord("data/0", storage.data(), storage.size());
  zip.writeEndOfFile();
  return path;
}

std::string bin_unicode(const std::string& s) { return "X" + le(s.size(), 4) + s; }

// {'w': _rebuild_tensor_v2(<FloatStorage '0' of `numel`>, offset, size, stride, False, {})}
std::string tensor_pickle(int64_t numel, int64_t offset, const std::vector<int64_t>& size,
                          const std::vector<int64_t>& stride) {
  auto ints = [](const std::vector<int64_t>& v) {
    std::string s = "(";
    for (int64_t x : v) s += "\x8a\x08" + le(static_cast<uint64_t>(x), 8);  // LONG1, 8 bytes
    return s + "t";
  };
  std::string p = "\x80\x02}(" + bin_unicode("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" + bin_unicode("storage") +
                  "ctorch\nFloatStorage\n" + bin_unicode("0") + bin_unicode("cpu") + "\x8a\x08" +
                  le(static_cast<uint64_t>(numel), 8) + "tQ" + "\x8a\x08" + le(static_cast<uint64_t>(offset), 8) +
                  ints(size) + ints(stride) + "\x89}tRu.";
  return p;
}

// ------------------------------------------------ hand-made zip files

// A zip of stored (uncompressed) records, laid out by hand so that its
// directory may say what no zip writer would: several entries for one
// record, or a record inside another.
struct ZipEntry {
  std::string name;
  uint64_t local = 0;  // where its local header starts
  uint64_t size = 0;
  uint32_t crc = 0;
};

uint32_t crc_of(const std::string& data) {
  return static_cast<uint32_t>(::crc32_z(::crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(data.data()),
                                         data.size()));
}

// Appends a local header and `data` to `zip`; the entry that points at them.
ZipEntry add_local_record(std::string& zip, const std::string& name, const std::string& data) {
  ZipEntry e{name, zip.size(), data.size(), crc_of(data)};
  zip += "PK\x03\x04" + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 4) + le(e.crc, 4) + le(e.size, 4) + le(e.size, 4) +
         le(name.size(), 2) + le(0, 2) + name + data;
  return e;
}

// Appends the central directory of `entries` and the end record.
void add_directory(std::string& zip, const std::vector<ZipEntry>& entries) {
  const size_t dir_at = zip.size();
  for (const auto& e : entries)
    zip += "PK\x01\x02" + le(20, 2) + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 4) + le(e.crc, 4) + le(e.size, 4) +
           le(e.size, 4) + le(e.name.size(), 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 4) +
           le(e.local, 4) + e.name;
  zip += "PK\x05\x06" + le(0, 2) + le(0, 2) + le(entries.size(), 2) + le(entries.size(), 2) +
         le(zip.size() - dir_at, 4) + le(dir_at, 4) + le(0, 2);
}

// {'w0': <FloatStorage '0'>, 'w1': <FloatStorage '1'>, ...}: one tensor
// of numels[k] floats in a storage of its own key k.
std::string storages_pickle(const std::vector<int64_t>& numels) {
  std::string p = "\x80\x02}(";
  for (size_t k = 0; k < numels.size(); ++k) {
    const std::string numel = "\x8a\x08" + le(static_cast<uint64_t>(numels[k]), 8);  // LONG1, 8 bytes
    p += bin_unicode("w" + std::to_string(k)) + "ctorch._utils\n_rebuild_tensor_v2\n((" + bin_unicode("storage") +
         "ctorch\nFloatStorage\n" + bin_unicode(std::to_string(k)) + bin_unicode("cpu") + numel + "tQ" + "K" +
         le(0, 1) + "(" + numel + "t(K\x01t\x89}tR";
  }
  return p + "u.";
}

uint64_t status_kib(const char* field) {  // a "VmXXX:" line of /proc/self/status
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(field, 0) == 0) return std::stoull(line.substr(std::strlen(field)));
  return 0;
}

// Reads `path` in a capped child and measures how far the read raised the
// child's peak resident memory (VmHWM, reset first). "" when the read gave
// a UserError that names the file and says `expected`, and the peak grew by
// no more than the file's size and a little; else what happened.
std::string refused_within_file_size(const std::string& path, const std::string& expected) {
  const uint64_t file_bytes = std::filesystem::file_size(path);
  return in_capped_child([&]() -> std::string {
    std::ofstream("/proc/self/clear_refs") << "5";  // the peak starts again from what is resident now
    const uint64_t before = status_kib("VmRSS:");
    if (status_kib("VmHWM:") > before + 1024) return "cannot measure: VmHWM was not reset";
    const std::string m = user_error_of(path);
    const uint64_t grown = (status_kib("VmHWM:") - before) * 1024;
    std::string what;
    if (grown > file_bytes + (16u << 20))  // the first reads of a process (thread pools, arenas) cost a few MB
      what = "reading a " + std::to_string(file_bytes) + "-byte file raised peak memory by " + std::to_string(grown) +
             " bytes; ";
    if (m[0] == '!' || m.find(path) == std::string::npos || m.find(expected) == std::string::npos)
      what += "the read gave: " + m.substr(0, 300);
    return what;
  });
}

// Where a zip's directory and end records are, as the directory mutations
// of the fuzzer need them; nullopt if `b` is too damaged to tell.
struct ZipLayout {
  size_t eocd = 0, locator = std::string::npos, eocd64 = std::string::npos;
  uint64_t dir_at = 0, dir_size = 0;
  std::vector<size_t> entries;  // where each directory entry starts
  std::vector<size_t> lengths;
};

uint64_t get_le(const std::string& s, size_t at, size_t n) {
  uint64_t v = 0;
  for (size_t k = n; k-- > 0;) v = v << 8 | static_cast<uint8_t>(s[at + k]);
  return v;
}

std::optional<ZipLayout> layout_of(const std::string& b) {
  ZipLayout z;
  z.eocd = b.rfind("PK\x05\x06");
  if (z.eocd == std::string::npos || z.eocd + 22 > b.size()) return std::nullopt;
  uint64_t count = get_le(b, z.eocd + 10, 2);
  z.dir_size = get_le(b, z.eocd + 12, 4);
  z.dir_at = get_le(b, z.eocd + 16, 4);
  if (z.eocd >= 20 && b.compare(z.eocd - 20, 4, "PK\x06\x07") == 0) {
    z.locator = z.eocd - 20;
    z.eocd64 = get_le(b, z.locator + 8, 8);
    if (z.eocd64 > b.size() || b.size() - z.eocd64 < 56 || b.compare(z.eocd64, 4, "PK\x06\x06") != 0)
      return std::nullopt;
    count = get_le(b, z.eocd64 + 32, 8);
    z.dir_size = get_le(b, z.eocd64 + 40, 8);
    z.dir_at = get_le(b, z.eocd64 + 48, 8);
  }
  if (count > 64) return std::nullopt;
  for (uint64_t p = z.dir_at, k = 0; k < count; ++k) {
    if (p > b.size() || b.size() - p < 46 || b.compare(p, 4, "PK\x01\x02") != 0) return std::nullopt;
    const size_t n = 46 + get_le(b, p + 28, 2) + get_le(b, p + 30, 2) + get_le(b, p + 32, 2);
    if (n > b.size() - p) return std::nullopt;
    z.entries.push_back(p);
    z.lengths.push_back(n);
    p += n;
  }
  const size_t tail = z.locator != std::string::npos ? z.eocd64 : z.eocd;  // the directory ends before it
  if (z.entries.empty() || z.dir_at > tail || z.dir_size > tail - z.dir_at) return std::nullopt;
  return z;
}

// Appends a copy of a directory entry to the directory (renamed, some of
// the time, by its name's last character) and counts it in the end records.
void duplicate_entry(std::string& b, std::mt19937_64& rng) {
  const auto z = layout_of(b);
  if (!z) return;
  const size_t k = rng() % z->entries.size();
  std::string entry = b.substr(z->entries[k], z->lengths[k]);
  const size_t name_len = get_le(entry, 28, 2);
  if (name_len > 0 && rng() % 2) entry[46 + name_len - 1] = static_cast<char>('0' + rng() % 10);
  const size_t end = z->dir_at + z->dir_size, n = entry.size();
  b.insert(end, entry);
  const uint64_t count = z->entries.size() + 1;
  put_le(b, z->eocd + n + 8, count, 2);
  put_le(b, z->eocd + n + 10, count, 2);
  put_le(b, z->eocd + n + 12, z->dir_size + n, 4);
  if (z->locator != std::string::npos) {
    put_le(b, z->locator + n + 8, z->eocd64 + n, 8);
    put_le(b, z->eocd64 + n + 24, count, 8);
    put_le(b, z->eocd64 + n + 32, count, 8);
    put_le(b, z->eocd64 + n + 40, z->dir_size + n, 8);
  }
}

// Points a directory entry at another entry's local record (so that two
// names share its bytes), with the other's sizes some of the time.
void share_record(std::string& b, std::mt19937_64& rng) {
  const auto z = layout_of(b);
  if (!z || z->entries.size() < 2) return;
  const size_t from = z->entries[rng() % z->entries.size()], to = z->entries[rng() % z->entries.size()];
  b.replace(to + 42, 4, b.substr(from + 42, 4));  // the local header's offset
  if (rng() % 2) b.replace(to + 16, 12, b.substr(from + 16, 12));  // CRC, sizes
}

}  // namespace

// 96 directory entries, data/0 ... data/95, all pointing at one local
// record of 1 MB, and a pickle that names each as a storage: a file of
// about 1 MB that made the reader allocate and copy 96 MB (issue 44: a
// 1.2 MB file drove `export` to 3 GB). Records may not share bytes.
TEST(TorchPickleLimits, ManyEntriesForOneRecordAreRefusedWithinTheFilesSize) {
  const auto path = ddp::testing::temp_dir("limits") + "/shared_record.pt";
  constexpr int kEntries = 96;
  constexpr int64_t kFloats = 1 << 18;  // 1 MB
  std::string zip;
  std::vector<ZipEntry> entries{add_local_record(zip, "archive/data.pkl", storages_pickle(std::vector<int64_t>(kEntries, kFloats)))};
  const ZipEntry storage = add_local_record(zip, "archive/data/0", std::string(kFloats * 4, '\x01'));
  for (int k = 0; k < kEntries; ++k) {
    ZipEntry e = storage;
    e.name = "archive/data/" + std::to_string(k);
    entries.push_back(e);
  }
  add_directory(zip, entries);
  std::ofstream(path, std::ios::binary) << zip;
  EXPECT_EQ(refused_within_file_size(path, "records archive/data/0 and archive/data/1 overlap"), "");
}

// A record whose local header lies inside another record's bytes: the
// outer storage's bytes would be read twice, once as the inner one.
TEST(TorchPickleLimits, ARecordInsideAnotherIsRefused) {
  const auto path = ddp::testing::temp_dir("limits") + "/nested_record.pt";
  std::string zip;
  std::vector<ZipEntry> entries{add_local_record(zip, "archive/data.pkl", storages_pickle({128, 64}))};
  // data/1 (64 floats) is the tail of data/0 (128 floats' worth of bytes).
  std::string inner;
  const ZipEntry inner_entry = add_local_record(inner, "archive/data/1", std::string(256, '\x02'));
  const std::string outer_data = std::string(512 - inner.size(), '\x03') + inner;
  const size_t outer_at = zip.size();
  ZipEntry outer = add_local_record(zip, "archive/data/0", outer_data);
  ZipEntry nested = inner_entry;
  nested.local = outer_at + 30 + outer.name.size() + (512 - inner.size());
  entries.push_back(outer);
  entries.push_back(nested);
  add_directory(zip, entries);
  std::ofstream(path, std::ios::binary) << zip;
  EXPECT_EQ(refused_within_file_size(path, "records archive/data/0 and archive/data/1 overlap"), "");
}

// Two directory entries of one name: which one is the storage?
TEST(TorchPickleLimits, ARecordNamedTwiceIsRefused) {
  const auto path = ddp::testing::temp_dir("limits") + "/twice.pt";
  std::string zip;
  std::vector<ZipEntry> entries{add_local_record(zip, "archive/data.pkl", storages_pickle({4}))};
  entries.push_back(add_local_record(zip, "archive/data/0", std::string(16, '\x01')));
  entries.push_back(add_local_record(zip, "archive/data/0", std::string(16, '\x02')));
  add_directory(zip, entries);
  std::ofstream(path, std::ios::binary) << zip;
  EXPECT_EQ(refused_within_file_size(path, "archive/data/0 is in the directory twice"), "");
}

// Central directory entries that declare 4 GB records in a 3 KB file (the
// sizes are zip64's "see the extra field" marker, with no extra field).
TEST(TorchPickleLimits, DeclaredRecordSizeBeyondTheFileIsRefusedWithoutAllocating) {
  const auto path = ddp::testing::temp_dir("limits") + "/big_record.pt";
  auto bytes = ddp::testing::read_file(kDataDir + "/pickle_plain.pt");
  int edited = 0;
  for (size_t at = bytes.find("PK\x01\x02"); at != std::string::npos; at = bytes.find("PK\x01\x02", at + 4)) {
    put_le(bytes, at + 20, 0xffffffff, 4);  // compressed size
    put_le(bytes, at + 24, 0xffffffff, 4);  // uncompressed size
    ++edited;
  }
  ASSERT_GT(edited, 0);
  std::ofstream(path, std::ios::binary) << bytes;
  const auto out = in_capped_child([&] {
    const auto m = user_error_of(path);
    return m.find("alloc") != std::string::npos || m[0] == '!' || m.find(path) == std::string::npos ? m : "";
  });
  EXPECT_EQ(out, "");
}

// One 1 MB string, memoised and fetched back 3000 times: 3 GB if BINGET
// copied it.
TEST(TorchPickleLimits, MemoisedStringsAreSharedNotCopied) {
  const auto dir = ddp::testing::temp_dir("limits");
  const std::string binput0("q\0", 2), binget0("h\0", 2);
  std::string pkl = "\x80\x02" + bin_unicode(std::string(1 << 20, 'x')) + binput0;
  for (int k = 0; k < 3000; ++k) pkl += binget0;
  pkl += ".";
  const auto path = write_zip(dir + "/memo.pt", pkl, "");
  const auto out = in_capped_child([&] {
    const auto m = user_error_of(path);
    return m.find("holds a str, not a state_dict") != std::string::npos ? "" : m;
  });
  EXPECT_EQ(out, "");
}

// Sizes and strides whose extent overflows int64 must not pass the bounds
// check as a small (wrapped) number.
TEST(TorchPickleLimits, OverflowingSizeTimesStrideIsRefused) {
  const auto dir = ddp::testing::temp_dir("limits");
  const std::string storage(16, '\0');  // 4 floats
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases{
      {{3}, {int64_t(1) << 62}},                      // 2 * 2^62 = 2^63 wraps to INT64_MIN
      {{int64_t(1) << 62, 5}, {int64_t(1) << 2, 1}},  // the first product alone overflows
      {{2, 2}, {INT64_MAX, INT64_MAX}},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto path = write_zip(dir + "/overflow" + std::to_string(k) + ".pt",
                                tensor_pickle(4, 1, cases[k].first, cases[k].second), storage);
    const auto out = in_capped_child([&] {
      const auto m = user_error_of(path);
      return m.find("reaches past the end of storage") != std::string::npos ? "" : m;
    });
    EXPECT_EQ(out, "") << "case " << k;
  }
}

// A storage whose element count times its element size wraps to the
// record's size (here 0 bytes) must not allocate the element count.
TEST(TorchPickleLimits, StorageElementCountIsCheckedAgainstTheRecord) {
  const auto dir = ddp::testing::temp_dir("limits");
  const auto path = write_zip(dir + "/numel.pt", tensor_pickle(int64_t(1) << 62, 0, {1}, {1}), "");
  const auto out = in_capped_child([&] {
    const auto m = user_error_of(path);
    return m.find("storage data/0 has 0 bytes") != std::string::npos ? "" : m;
  });
  EXPECT_EQ(out, "");
}

// Seeded mutations of the committed .pt files: bit flips, random bytes,
// truncation, splices, duplicated chunks, edits of length fields (the zip's
// sizes and offsets, the pickle's string lengths), duplicated directory
// entries and entries pointed at another's record. Each either loads, with
// no more storage bytes than the file has, or throws a UserError, under the
// address-space cap. Fixed seed: the
// same 3000 inputs on every run; a failure names its iteration.
TEST(TorchPickleFuzz, MutatedFilesLoadOrThrowUserError) {
  std::vector<std::string> seeds;
  for (const char* name : {"pickle_bn.pt", "pickle_cuda.pt", "pickle_half.pt", "pickle_plain.pt", "pickle_proto4.pt",
                           "pickle_views.pt", "tiny_state_dict.pt", "pickle_nested.pt", "pickle_bad_global.pt"})
    seeds.push_back(ddp::testing::read_file(kDataDir + "/" + name));
  const auto path = ddp::testing::temp_dir("fuzz") + "/case.pt";
  const int kIterations = 3000;
  const auto out = in_capped_child([&]() -> std::string {
    std::mt19937_64 rng(20261203);
    auto below = [&](size_t n) { return n ? static_cast<size_t>(rng() % n) : 0; };
    const uint64_t interesting[] = {0, 1, 0x7f, 0xff, 0x7fff, 0xffff, 0x7fffffff, 0x80000000, 0xffffffff,
                                    0xfffffff0, 1u << 20, 3000000000u};
    for (int it = 0; it < kIterations; ++it) {
      std::string b = seeds[below(seeds.size())];
      const int edits = 1 + static_cast<int>(below(4));
      for (int e = 0; e < edits && !b.empty(); ++e) {
        switch (below(9)) {
          case 0: b[below(b.size())] ^= static_cast<char>(1 << below(8)); break;  // bit flip
          case 1: b[below(b.size())] = static_cast<char>(rng()); break;
          case 2: b.resize(below(b.size())); break;  // truncation
          case 3: {  // splice from another file
            const auto& o = seeds[below(seeds.size())];
            const size_t from = below(o.size()), n = below(std::min<size_t>(o.size() - from, 256));
            b.replace(below(b.size()), n, o.substr(from, n));
            break;
          }
          case 4: {  // a chunk of the file repeated
            const size_t from = below(b.size()), n = below(std::min<size_t>(b.size() - from, 128));
            b.insert(below(b.size()), b.substr(from, n));
            break;
          }
          case 7: duplicate_entry(b, rng); break;
          case 8: share_record(b, rng); break;
          default: {  // a length field: a zip size/offset, or any 4 bytes
            size_t at = below(b.size());
            const size_t cd = b.find("PK\x01\x02", below(b.size()));
            static const size_t fields[] = {20, 24, 28, 30, 32, 42};  // sizes, name/extra lengths, offset
            if (cd != std::string::npos && below(2)) at = cd + fields[below(6)];
            const uint64_t v = below(3) ? interesting[below(std::size(interesting))] : rng();
            for (size_t k = 0; k < 4 && at + k < b.size(); ++k) b[at + k] = static_cast<char>(v >> (8 * k));
          }
        }
      }
      std::ofstream(path, std::ios::binary | std::ios::trunc) << b;
      const auto what = read_outcome(path);
      if (!what.empty()) return "iteration " + std::to_string(it) + ": " + what;
    }
    return "";
  });
  EXPECT_EQ(out, "");
}
