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

#include <cstdio>
#include <fstream>
#include <functional>
#include <random>

#include "ddp/error.h"
#include "ddp/io/torch_pickle.h"
#include "support/testing.h"

namespace {

const std::string kDataDir = DDP_TEST_DATA_DIR;
constexpr size_t kCap = 256u << 20;  // what one read of a few-KB file may add to the address space

size_t address_space() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0;
  f >> pages;
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// Runs `body` in a child under the cap; "" when it returned "", else what it
// returned or how the child died.
std::string in_capped_child(const std::function<std::string()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    ::close(fds[0]);
    const rlim_t limit = address_space() + kCap;
    rlimit lim{limit, limit};
    ::setrlimit(RLIMIT_AS, &lim);
    std::string out;
    try {
      out = body();
    } catch (const std::exception& e) {
      out = std::string("escaped: ") + e.what();
    }
    if (!out.empty() && ::write(fds[1], out.data(), std::min<size_t>(out.size(), 4000)) < 0) ::_exit(3);
    ::_exit(out.empty() ? 0 : 1);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return "crashed with signal " + std::to_string(WTERMSIG(status)) + " " + out;
  if (WEXITSTATUS(status) != 0 && out.empty()) return "exit status " + std::to_string(WEXITSTATUS(status));
  return out;
}

// Reads `path`: "" if it loaded (every tensor readable) or threw a UserError
// that is not an allocation failure in disguise; else what went wrong.
std::string read_outcome(const std::string& path) {
  try {
    for (const auto& [name, t] : ddp::read_state_dict(path)) t.clone();  // touches every element
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

}  // namespace

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
// truncation, splices, duplicated chunks and edits of length fields (the
// zip's sizes and offsets, the pickle's string lengths). Each either loads
// or throws a UserError, under the address-space cap. Fixed seed: the
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
        switch (below(7)) {
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
