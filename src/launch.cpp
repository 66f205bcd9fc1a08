// Local worker launcher: spawn, watch, propagate failure, forward signals.
#include "ddp/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "ddp/error.h"

namespace ddp {
namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal.store(sig); }

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  std::chrono::steady_clock::time_point exited_at;
};

pid_t spawn(const LaunchOptions& o, int local_rank, int port, int attempt) {
  const int world = o.nproc_per_node * o.nnodes;
  const int rank = o.node_rank * o.nproc_per_node + local_rank;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid > 0) return pid;
  // Child: its own process group, so a terminal's Ctrl-C reaches only the
  // launcher, which forwards it once; and die with the launcher.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(1);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
  setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("DDPTRAIN_LAUNCHER", "1", 1);
  setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(attempt).c_str(), 1);
  // Ranks on one machine share its cores: give each its slice for the BLAS
  // and OpenMP pools, which size themselves when the library loads, before
  // main() could change them. A value the user set wins.
  const std::string threads = std::to_string(std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(o.nproc_per_node)));
  setenv("OMP_NUM_THREADS", threads.c_str(), 0);
  setenv("OPENBLAS_NUM_THREADS", threads.c_str(), 0);
  if (!o.visible.empty()) {
    std::string v;
    for (const auto& d : o.visible) v += (v.empty() ? "" : ",") + d;
    setenv("CUDA_VISIBLE_DEVICES", v.c_str(), 1);
  }
  std::vector<char*> args;
  for (const auto& a : o.argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(o.argv[0].c_str(), args.data());
  std::fprintf(stderr, "ddptrain: cannot start worker '%s': %s\n", o.argv[0].c_str(), std::strerror(errno));
  _exit(127);
}

bool any_running(const std::vector<Worker>& ws) {
  for (const auto& w : ws)
    if (w.running) return true;
  return false;
}

void signal_all(std::vector<Worker>& ws, int sig) {
  for (auto& w : ws)
    if (w.running) kill(w.pid, sig);
}

// Reaps exited workers; returns the index of a newly failed one, or -1.
int reap(std::vector<Worker>& ws) {
  int failed = -1;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto& w = ws[i];
    if (!w.running) continue;
    int st = 0;
    pid_t r = waitpid(w.pid, &st, WNOHANG);
    if (r == w.pid) {
      w.running = false;
      w.status = st;
      w.exited_at = std::chrono::steady_clock::now();
      bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      if (!ok && failed < 0) failed = static_cast<int>(i);
    }
  }
  return failed;
}

// When one rank dies, its peers fail in their collectives a moment later
// (exit code kPeerFailed). Wait briefly for the dust to settle, then blame a
// rank that failed for its own reasons if there is one.
int root_cause(std::vector<Worker>& ws, int first) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (any_running(ws) && std::chrono::steady_clock::now() < until) {
    reap(ws);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto own_fault = [](const Worker& w) {
    return !w.running && !(WIFEXITED(w.status) && (WEXITSTATUS(w.status) == 0 || WEXITSTATUS(w.status) == exit_code::kPeerFailed));
  };
  int best = own_fault(ws[first]) ? first : -1;
  for (size_t i = 0; i < ws.size(); ++i)
    if (own_fault(ws[i]) && (best < 0 || ws[i].exited_at < ws[best].exited_at)) best = static_cast<int>(i);
  return best < 0 ? first : best;
}

void stop_survivors(std::vector<Worker>& ws, double grace_seconds) {
  signal_all(ws, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000));
  while (any_running(ws) && std::chrono::steady_clock::now() < deadline) {
    reap(ws);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (any_running(ws)) {
    signal_all(ws, SIGKILL);
    for (auto& w : ws)
      if (w.running) {
        waitpid(w.pid, &w.status, 0);
        w.running = false;
      }
  }
}

// One attempt: returns 0 on success, else the failing worker's exit code
// (128 + signal for a signal), and fills `why`.
int run_once(const LaunchOptions& o, int port, int attempt, std::string& why, bool& interrupted) {
  std::vector<Worker> ws(static_cast<size_t>(o.nproc_per_node));
  for (int i = 0; i < o.nproc_per_node; ++i) {
    ws[i].rank = o.node_rank * o.nproc_per_node + i;
    ws[i].pid = spawn(o, i, port, attempt);
    ws[i].running = true;
  }
  int forwarded = 0;
  while (any_running(ws)) {
    int sig = g_signal.exchange(0);
    if (sig) {
      interrupted = true;
      ++forwarded;
      // First signal: workers checkpoint and stop. Second: stop at once.
      signal_all(ws, forwarded == 1 ? sig : SIGKILL);
    }
    int failed = reap(ws);
    if (failed >= 0) {
      failed = root_cause(ws, failed);
      why = describe_exit(ws[failed].rank, ws[failed].status);
      if (any_running(ws)) {
        std::fprintf(stderr, "ddptrain: %s; stopping the other ranks.\n", why.c_str());
        stop_survivors(ws, o.grace_seconds);
      }
      const int st = ws[failed].status;
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

}  // namespace

std::string describe_exit(int rank, int st) {
  std::string who = "rank " + std::to_string(rank);
  if (WIFEXITED(st)) return who + " exited with code " + std::to_string(WEXITSTATUS(st));
  if (WIFSIGNALED(st)) {
    int s = WTERMSIG(st);
    const char* name = sigabbrev_np(s);
    return who + " was killed by signal " + std::to_string(s) + " (SIG" + (name ? name : "?") + ")";
  }
  return who + " ended with status " + std::to_string(st);
}

int find_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed while looking for a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  if (port == 0) throw std::runtime_error("could not find a free TCP port");
  return port;
}

std::string self_executable() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  buf[n] = 0;
  return buf;
}

int launch_workers(const LaunchOptions& o) {
  check_user(o.nproc_per_node >= 1, "--size must be at least 1, got " + std::to_string(o.nproc_per_node) + ".");
  check_user(o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes,
             "--node-rank " + std::to_string(o.node_rank) + " is outside [0, --nnodes " +
                 std::to_string(o.nnodes) + ").");
  check_user(!(o.nnodes > 1 && o.master_port == 0),
             "--port is required with --nnodes " + std::to_string(o.nnodes) + ".",
             "give every node the same --address (node 0's) and --port.");
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  for (int attempt = 0;; ++attempt) {
    const int port = o.master_port > 0 ? o.master_port : find_free_port();
    std::string why;
    bool interrupted = false;
    int code = run_once(o, port, attempt, why, interrupted);
    if (code == 0) return 0;
    if (interrupted) {
      std::fprintf(stderr, "ddptrain: stopped by signal (%s).\n", why.c_str());
      return code;
    }
    if (attempt >= o.max_restarts) {
      std::fprintf(stderr, "ddptrain: worker failed: %s.%s\n", why.c_str(),
                   o.max_restarts > 0 ? " No restarts left." : "");
      return code == 0 ? 1 : code;
    }
    std::fprintf(stderr, "ddptrain: worker failed: %s; restart %d of %d from the last checkpoint.\n",
                 why.c_str(), attempt + 1, o.max_restarts);
  }
}

}  // namespace ddp
