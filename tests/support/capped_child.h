// Runs a piece of a test in a forked child whose address space is capped, so
// that a reader which believes a hostile length field fails inside the child
// (std::bad_alloc, or a signal) instead of taking the test machine's memory.
// The tests of the file readers share it (torch_pickle_fuzz_test.cpp,
// csv_test.cpp, idx_test.cpp, image_codec_test.cpp). Header-only and inline: only those test files include it.
#pragma once

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <fstream>
#include <functional>
#include <string>

namespace ddp::testing {

/// This process's address space in bytes (/proc/self/statm).
inline size_t address_space() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0;
  f >> pages;
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

/// Runs `body` in a forked child that may grow its address space by at most
/// `cap` bytes: "" when body returned "", else what it returned (an escaped
/// exception's message included) or how the child died.
inline std::string in_capped_child(const std::function<std::string()>& body, size_t cap) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    ::close(fds[0]);
    const rlim_t limit = address_space() + cap;
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

}  // namespace ddp::testing
