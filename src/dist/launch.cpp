// Local worker launcher: spawn, watch, propagate failure, forward signals.
// Across nodes the launchers also share one TCPStore (see NodeLink).
#include "ddp/dist/launch.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/dist/world.h"  // Placement

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
  // The launcher (node 0's, across nodes) hosts the store and every rank is
  // a client of it (torchrun's static rendezvous uses the same variable).
  // DDPTRAIN_JOB_TOKEN, the job's secret key prefix, comes from the launcher.
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
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
  // The worker starts with no signal blocked (signals.h: a process that
  // took stop signals on a thread of its own blocks them elsewhere).
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  std::vector<char*> args;
  for (const auto& a : o.argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(o.argv[0].c_str(), args.data());
  std::fprintf(stderr, "%s: cannot start worker '%s': %s\n", o.program.c_str(), o.argv[0].c_str(), std::strerror(errno));
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
      // A preempted rank (exit 75) saved what it had to and stops; its peers
      // are finishing their part of the same stop, so that is no failure.
      bool ok = WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == exit_code::kPreempted);
      if (!ok && failed < 0) failed = static_cast<int>(i);
    }
  }
  return failed;
}

// A rank that failed for its own reasons, not because a peer went away.
bool own_fault(const Worker& w) {
  return !w.running && !(WIFEXITED(w.status) && (WEXITSTATUS(w.status) == 0 || WEXITSTATUS(w.status) == exit_code::kPeerFailed));
}

// When one rank dies, its peers fail in their collectives a moment later
// (exit code kPeerFailed). Wait briefly for the dust to settle, then blame a
// rank that failed for its own reasons if there is one. While only peers
// have failed, the cause may be a rank still holding back its bad-input
// error (kRankErrorDeferSeconds): wait for it that long, and a second more.
// (Workers hold back a failed collective's line longer still, so that the
// cause's exit usually comes first.)
int root_cause(std::vector<Worker>& ws, int first) {
  auto any_own_fault = [&] { return std::any_of(ws.begin(), ws.end(), own_fault); };
  const auto start = std::chrono::steady_clock::now();
  const auto settle = start + std::chrono::milliseconds(500);
  const auto deferred = start + std::chrono::milliseconds(static_cast<int64_t>((kRankErrorDeferSeconds + 1) * 1000));
  while (any_running(ws)) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deferred || (now >= settle && any_own_fault())) break;
    reap(ws);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int best = own_fault(ws[first]) ? first : -1;
  for (size_t i = 0; i < ws.size(); ++i)
    if (own_fault(ws[i]) && (best < 0 || ws[i].exited_at < ws[best].exited_at)) best = static_cast<int>(i);
  return best < 0 ? first : best;
}

// When the first failure is a peer's collective that timed out (exit
// kPeerFailed) and, after root_cause's wait, a rank is still running, that
// rank was not in the collective: it is the one that stalled (in its data
// loading, the task's code, a deadlock). Names it, or says nothing.
std::string stalled_ranks(const std::vector<Worker>& ws, int failed) {
  if (own_fault(ws[failed])) return "";
  std::string ranks;
  int n = 0;
  for (const auto& w : ws)
    if (w.running) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(w.rank);
      ++n;
    }
  if (n == 0) return "";
  return std::string(n > 1 ? "; ranks " : "; rank ") + ranks + (n > 1 ? " were" : " was") +
         " still running outside that collective: probably stalled (in data loading or the task's code?)";
}

bool bad_input(int wait_status) { return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == exit_code::kUsage; }

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

// The job's secret: every key the ranks trust lives under it, so a process
// that connects to the store without it (another job on the same port, a
// stray client) can neither feed the ranks nor be mistaken for one. 128 bits
// from the kernel, or the user's DDPTRAIN_JOB_TOKEN (the same on every node).
std::string job_token() {
  if (const char* given = std::getenv("DDPTRAIN_JOB_TOKEN")) {
    const std::string t = given;
    check_user(t.size() >= 16 && t.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
               "DDPTRAIN_JOB_TOKEN has " + std::to_string(t.size()) + " characters or non-hex ones.",
               "give at least 16 hex digits, e.g. export DDPTRAIN_JOB_TOKEN=$(openssl rand -hex 16), on every node.");
    return t;
  }
  unsigned char bytes[16];
  std::FILE* f = std::fopen("/dev/urandom", "rb");
  const bool ok = f && std::fread(bytes, 1, sizeof(bytes), f) == sizeof(bytes);
  if (f) std::fclose(f);
  if (!ok) throw std::runtime_error("cannot read /dev/urandom for the job token");
  std::string t;
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", b);
    t += hex;
  }
  return t;
}


// One node: the launcher hosts the job's store, so that the port is taken
// before any rank starts (a busy port is one error here, not a rank joining
// another job's store) and a chosen port is never given up and taken again.
c10::intrusive_ptr<c10d::TCPStore> host_store(const LaunchOptions& o) {
  // A busy port is the usual failure; say so in one line before c10d, which
  // logs its own attempts to stderr, tries.
  check_user(o.master_port == 0 || !port_in_use(o.master_port),
             "port " + std::to_string(o.master_port) + " is already in use on this machine (another job or program "
                 "listens there).",
             "pass another --port, or omit --port to let ddptrain pick a free one.");
  try {
    return compat::listen_store(o.master_addr, o.master_port,
                                std::chrono::milliseconds(static_cast<int64_t>(o.rendezvous_timeout * 1000)));
  } catch (const std::exception& e) {
    throw UserError("port " + std::to_string(o.master_port) + " on " + o.master_addr +
                        " is not available for the job's rendezvous (" + first_line(e) + ").",
                    "another job or program may listen there: pass another --port, or omit --port.");
  }
}

// The launchers of a multi-node job, talking through one TCPStore that node
// 0's launcher hosts on --port; the workers use the same store (as clients)
// for their rendezvous, so it outlives any worker, like torchrun's agent
// store. Each launcher posts how its node's attempt ended, under
// "ddptrain/launch/<attempt>/<node>": "done", or "fail:" and the failed rank.
// The others poll for it, so a rank that dies on one node stops every node,
// and every launcher names that rank; a launcher that loses the store (node
// 0's launcher died) stops its ranks too.
class NodeLink {
 public:
  explicit NodeLink(const LaunchOptions& o) : o_(o) {
    const std::string where = o.master_addr + ":" + std::to_string(o.master_port);
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(o.master_port);
    so.isServer = o.node_rank == 0;
    so.waitWorkers = false;
    so.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.rendezvous_timeout * 1000));
    if (o.node_rank > 0)
      std::fprintf(stderr, "%s: node %d of %d: joining the job at %s (waiting up to %.0f s for node 0)\n",
                   o.program.c_str(), o.node_rank, o.nnodes, where.c_str(), o.rendezvous_timeout);
    c10::intrusive_ptr<c10d::Store> tcp;
    try {
      tcp = o.node_rank == 0 ? compat::listen_store(o.master_addr, o.master_port, so.timeout)
                             : c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
    } catch (const std::exception& e) {
      if (o.node_rank == 0)
        throw UserError("node 0 could not open the job's rendezvous store on port " + std::to_string(o.master_port) +
                            " (" + first_line(e) + ").",
                        "the port may be in use: give every node another free --port.");
      throw UserError("node " + std::to_string(o.node_rank) + " could not reach node 0 at --address " + where +
                          " within " + std::to_string(static_cast<int>(o.rendezvous_timeout)) + " s (" +
                          first_line(e) + ").",
                      "start node 0 first (or within --timeout), give every node node 0's --address and the same "
                      "--port, and open that TCP port in node 0's firewall.");
    }
    // Node 0 hands out its token unless the user gave every node one.
    const bool given = std::getenv("DDPTRAIN_JOB_TOKEN") != nullptr;
    if (o.node_rank == 0) {
      token_ = job_token();
      if (!given) tcp->set("ddptrain/launch/token", std::vector<uint8_t>(token_.begin(), token_.end()));
    } else if (given) {
      token_ = job_token();
    } else {
      try {
        const auto v = tcp->get("ddptrain/launch/token");
        token_.assign(v.begin(), v.end());
      } catch (const std::exception& e) {
        throw UserError("node " + std::to_string(o.node_rank) + " reached " + where +
                            ", but no ddptrain node 0 answered there (" + first_line(e) + ").",
                        "check that --address and --port are node 0's, and that DDPTRAIN_JOB_TOKEN is set on every "
                        "node or on none.");
      }
    }
    store_ = c10::make_intrusive<c10d::PrefixStore>("ddptrain/job/" + token_, tcp);
    // Every node must run as many ranks as node 0, or ranks would collide.
    const std::string key = "ddptrain/launch/ranks_per_node";
    if (o.node_rank == 0) {
      set(key, std::to_string(o.nproc_per_node));
    } else {
      std::vector<uint8_t> v;
      try {
        v = store_->get(key);
      } catch (const std::exception& e) {
        throw UserError("node " + std::to_string(o.node_rank) + " reached " + where +
                            ", but no ddptrain node 0 answered there (" + first_line(e) + ").",
                        "check that --address and --port are node 0's, that no other program or job uses "
                        "that port, and that every node has the same DDPTRAIN_JOB_TOKEN (or none has).");
      }
      const int theirs = std::atoi(std::string(v.begin(), v.end()).c_str());
      if (theirs != o.nproc_per_node) {
        const std::string why = "node " + std::to_string(o.node_rank) + " has --size " +
                                std::to_string(o.nproc_per_node) + " but node 0 has --size " + std::to_string(theirs);
        post(0, "fail:" + why);
        throw UserError(why + ".", "give every node the same --size (ranks per node).");
      }
    }
  }

  /// Posts this node's end of `attempt`; a lost store is not an error here.
  void post(int attempt, const std::string& value) {
    try {
      set(key(attempt, o_.node_rank), value);
    } catch (const std::exception&) {
    }
  }

  /// Another node's failure in this attempt ("rank 3 ... on node 1"), or "".
  /// Throws when the store is gone.
  std::string remote_failure(int attempt) {
    for (int n = 0; n < o_.nnodes; ++n) {
      if (n == o_.node_rank || !store_->check({key(attempt, n)})) continue;
      const auto v = store_->get(key(attempt, n));
      const std::string s(v.begin(), v.end());
      if (s.rfind("fail:", 0) == 0) return s.substr(5);
    }
    return "";
  }

  /// Polls remote_failure for up to `seconds`.
  std::string wait_remote_failure(int attempt, double seconds) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    do {
      try {
        auto r = remote_failure(attempt);
        if (!r.empty()) return r;
      } catch (const std::exception&) {
        return "";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } while (std::chrono::steady_clock::now() < until);
    return "";
  }

  /// On node 0 (the store's host): waits up to `seconds` until every node
  /// has posted its end. Returns another node's failure, or "".
  std::string wait_for_all(int attempt, double seconds) {
    if (o_.node_rank != 0) return "";
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    try {
      for (int n = 1; n < o_.nnodes; ++n) {
        while (!store_->check({key(attempt, n)})) {
          if (std::chrono::steady_clock::now() > until) {
            std::fprintf(stderr, "%s: node %d did not report its end within %.0f s; exiting anyway.\n", o_.program.c_str(), n,
                         seconds);
            return "";
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
      return remote_failure(attempt);
    } catch (const std::exception&) {
      return "";
    }
  }

  std::string address() const { return o_.master_addr + ":" + std::to_string(o_.master_port); }
  const std::string& token() const { return token_; }

 private:
  static std::string key(int attempt, int node) {
    return "ddptrain/launch/" + std::to_string(attempt) + "/" + std::to_string(node);
  }
  void set(const std::string& k, const std::string& v) { store_->set(k, std::vector<uint8_t>(v.begin(), v.end())); }

  const LaunchOptions& o_;
  std::string token_;
  c10::intrusive_ptr<c10d::Store> store_;  // under the job's token
};

// Runs one attempt's workers until they end; sets `cause_here` false when
// they were stopped because of another node.
int watch_workers(const LaunchOptions& o, NodeLink* link, int port, int attempt, std::string& why,
                  bool& interrupted, bool& cause_here) {
  std::vector<Worker> ws(static_cast<size_t>(o.nproc_per_node));
  for (int i = 0; i < o.nproc_per_node; ++i) {
    ws[i].rank = o.node_rank * o.nproc_per_node + i;
    ws[i].pid = spawn(o, i, port, attempt);
    ws[i].running = true;
  }
  const std::string on_node = o.nnodes > 1 ? " on node " + std::to_string(o.node_rank) : "";
  auto next_poll = std::chrono::steady_clock::now();
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
      const std::string stalled = stalled_ranks(ws, failed);
      why = describe_exit(ws[failed].rank, ws[failed].status) + on_node + stalled;
      if (link) {
        // Ranks here only lost a peer: the rank that caused it is probably
        // on another node, whose launcher is about to say so (unless the
        // stalled rank is here).
        std::string remote = own_fault(ws[failed]) || !stalled.empty() ? "" : link->wait_remote_failure(attempt, 3.0);
        cause_here = remote.empty();
        if (!cause_here) why = remote;
        else link->post(attempt, "fail:" + why);  // early, so the other nodes stop now
      }
      if (any_running(ws)) {
        if (!bad_input(ws[failed].status))
          std::fprintf(stderr, "%s: %s; stopping the other ranks.\n", o.program.c_str(), why.c_str());
        stop_survivors(ws, o.grace_seconds);
      }
      const int st = ws[failed].status;
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    if (link && std::chrono::steady_clock::now() >= next_poll) {
      next_poll += std::chrono::milliseconds(200);
      try {
        why = link->remote_failure(attempt);
      } catch (const std::exception& e) {
        why = "lost node 0's rendezvous store at " + link->address() + " (" + first_line(e) + ")";
      }
      if (!why.empty()) {
        cause_here = false;
        std::fprintf(stderr, "%s: %s; stopping the ranks%s.\n", o.program.c_str(), why.c_str(), on_node.c_str());
        stop_survivors(ws, o.grace_seconds);
        return exit_code::kPeerFailed;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (const auto& w : ws)
    if (WIFEXITED(w.status) && WEXITSTATUS(w.status) == exit_code::kPreempted) return exit_code::kPreempted;
  return 0;
}

// One attempt: returns 0 on success, else the failing worker's exit code
// (128 + signal for a signal), and fills `why`.
int run_once(const LaunchOptions& o, NodeLink* link, int port, int attempt, std::string& why, bool& interrupted) {
  bool cause_here = true;
  const int code = watch_workers(o, link, port, attempt, why, interrupted, cause_here);
  if (!link) return code;
  // Every node posts how it ended; node 0 keeps the store up until all have
  // (no node may take a finished job for a lost node 0), briefly after a failure.
  link->post(attempt, code == 0                       ? std::string("done")
                      : code == exit_code::kPreempted ? std::string("preempted")
                                                      : (cause_here ? "fail:" : "stopped:") + why);
  const std::string remote = link->wait_for_all(attempt, code == 0 ? o.rendezvous_timeout : 15.0);
  if (code == 0 && !remote.empty()) {
    why = remote;
    return exit_code::kPeerFailed;
  }
  return code;
}

// --address must resolve; on node 0, which hosts the store, it must also be
// one of this machine's addresses, or the other nodes would look elsewhere.
void check_address(const LaunchOptions& o) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(o.master_addr.c_str(), nullptr, &hints, &found);
  check_user(rc == 0 && found, "--address '" + o.master_addr + "' does not resolve (" + gai_strerror(rc) + ").",
             "give node 0's IP address or a host name that every node can resolve.");
  sockaddr_in a = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  freeaddrinfo(found);
  if (o.node_rank != 0) return;
  a.sin_port = 0;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const bool local = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (fd >= 0) ::close(fd);
  check_user(local, "--address " + o.master_addr + " is not an address of this machine, but --node-rank 0 hosts the job.",
             "on node 0 give its own address (the one the other nodes use), or check --node-rank.");
}

}  // namespace

// Whether something listens on `port` (on any address, as c10d binds).
bool port_in_use(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool busy = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return busy;
}

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

// torchrun's agent sets TORCHELASTIC_RUN_ID in its workers; ddptrain's
// launcher, Slurm and mpirun do not. Debian's torchrun 1.13 on Python 3.11
// fails at start with its default --redirects 0 ('NoneType' object has no
// attribute 'get'), so the command carries --redirects 2 --tee 2, which 2.x
// takes too, as it takes these underscore spellings.
std::string relaunch_command(const std::string& program, const std::string& args, const Placement& where) {
  if (where.source != "torchrun" || !std::getenv("TORCHELASTIC_RUN_ID")) return program + " " + args;
  const int per_node = std::max(1, where.local_world_size), nodes = std::max(1, where.world_size / per_node);
  std::string cmd = "torchrun";
  if (nodes > 1) cmd += " --nnodes " + std::to_string(nodes) + " <the job's rendezvous flags, on every node>";
  return cmd + " --nproc_per_node " + std::to_string(per_node) + " --redirects 2 --tee 2 --no_python " + program + " " +
         args;
}

int launch_workers(const LaunchOptions& o) {
  check_user(o.nproc_per_node >= 1, "--size must be at least 1, got " + std::to_string(o.nproc_per_node) + ".");
  check_user(o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes,
             "--node-rank " + std::to_string(o.node_rank) + " is outside [0, --nnodes " +
                 std::to_string(o.nnodes) + ").");
  check_user(!(o.nnodes > 1 && o.master_port == 0),
             "--port is required with --nnodes " + std::to_string(o.nnodes) + ".",
             "give every node the same --address (node 0's) and --port.");
  std::unique_ptr<NodeLink> link;
  c10::intrusive_ptr<c10d::TCPStore> store;  // one node: the job's store, hosted here
  int port = o.master_port;
  if (o.nnodes > 1) {
    check_address(o);
    link = std::make_unique<NodeLink>(o);
    setenv("DDPTRAIN_JOB_TOKEN", link->token().c_str(), 1);
  } else {
    store = host_store(o);
    port = store->getPort();
    setenv("DDPTRAIN_JOB_TOKEN", job_token().c_str(), 1);
  }
  // The job's id, the same for every attempt: a restart resumes only the
  // run directory that this job made (trainer.cpp), never another run's
  // under the same --save_path. Not a secret, unlike the token.
  if (!std::getenv("DDPTRAIN_JOB_ID")) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string id = std::string(host) + "-" + std::to_string(getpid()) + "-" + std::to_string(ms);
    setenv("DDPTRAIN_JOB_ID", id.c_str(), 1);
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  for (int attempt = 0;; ++attempt) {
    std::string why;
    bool interrupted = false;
    int code = run_once(o, link.get(), port, attempt, why, interrupted);
    if (code == 0) return 0;
    if (code == exit_code::kPreempted) return code;  // rank 0 said where it saved
    if (code == exit_code::kUsage) return code;      // the rank said what was wrong; a restart fails alike
    if (interrupted) {
      std::fprintf(stderr, "%s: stopped by signal (%s).\n", o.program.c_str(), why.c_str());
      return code;
    }
    if (attempt >= o.max_restarts) {
      std::fprintf(stderr, "%s: worker failed: %s.%s\n", o.program.c_str(), why.c_str(),
                   o.max_restarts > 0 ? " No restarts left." : "");
      return code == 0 ? 1 : code;
    }
    std::fprintf(stderr, "%s: worker failed: %s; restart %d of %d from the last checkpoint.\n",
                 o.program.c_str(), why.c_str(), attempt + 1, o.max_restarts);
  }
}

}  // namespace ddp
