// Stop and crash signals of a worker (see signals.h).
#include "ddp/dist/signals.h"
#include "ddp/program.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <thread>

namespace ddp {
namespace {

// First SIGTERM/SIGINT: checkpoint at the next agreed step and stop.
// Second: stop at once. `pkill ddptrain`, `systemctl stop` and Slurm signal
// the launcher and every worker together, and the launcher forwards its copy,
// so one request can arrive twice within milliseconds. So a copy from our
// launcher never counts as a second request (it escalates with SIGKILL
// itself), nor does any signal within a second of the first.
std::atomic<int> g_stop{0};
std::atomic<bool> g_can_checkpoint{true};
std::atomic<int> g_signals{0};
std::atomic<int64_t> g_first_signal_ns{0};
pid_t g_launcher_pid = 0;
int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}
void on_stop_signal(int sig, siginfo_t* info, void*) {
  // Nothing to save yet (set-up, rendezvous): nothing would read the flag.
  if (!g_can_checkpoint.load()) _exit(128 + sig);
  const int64_t now = monotonic_ns();
  if (g_signals.fetch_add(1) == 0) {
    g_first_signal_ns.store(now);
    request_stop();
    return;
  }
  const bool from_launcher = g_launcher_pid > 0 && info && info->si_pid == g_launcher_pid;
  if (!from_launcher && now - g_first_signal_ns.load() >= 1000000000) _exit(128 + sig);
}

// A worker that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL) prints where, and
// its native stack, to stderr before dying with the same signal, so that the
// launcher's "rank N died" comes with a place to look. The faulting pc and,
// on x86-64, the return address on top of the stack are printed by library
// and offset as well: after a call through a bad pointer the unwinder stops
// at the bad pc, and the return address still names the caller.
// (dladdr and snprintf are not async-signal-safe; the process is dying.)
void print_address(const char* what, void* a) {
  Dl_info info{};
  char line[512];
  int n;
  if (a && dladdr(a, &info) && info.dli_fname)
    n = std::snprintf(line, sizeof(line), "  %s %p = %s+0x%lx (%s)\n", what, a, info.dli_fname,
                      static_cast<unsigned long>(static_cast<char*>(a) - static_cast<char*>(info.dli_fbase)),
                      info.dli_sname ? info.dli_sname : "?");
  else
    n = std::snprintf(line, sizeof(line), "  %s %p\n", what, a);
  if (n > 0 && write(STDERR_FILENO, line, static_cast<size_t>(std::min<int>(n, sizeof(line) - 1))) < 0) {}
}

void on_crash(int sig, siginfo_t* info, void* context) {
  static const char head[] = ": worker crashed; native stack:\n";
  const char* name = program_name();
  if (write(STDERR_FILENO, name, std::strlen(name)) < 0 || write(STDERR_FILENO, head, sizeof(head) - 1) < 0) {}
  print_address("fault address", info->si_addr);
#if defined(__x86_64__)
  const auto* uc = static_cast<ucontext_t*>(context);
  print_address("pc", reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]));
  print_address("return address", *reinterpret_cast<void**>(uc->uc_mcontext.gregs[REG_RSP]));
#else
  (void)context;
#endif
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void install_crash_handler() {
  void* prime[1];
  (void)backtrace(prime, 1);
  // Its own stack, so that a stack overflow is reported too.
  static char alt_stack[1 << 16];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_crash;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) sigaction(sig, &sa, nullptr);
}

void request_stop() { g_stop.store(1); }
void set_stop_can_checkpoint(bool can) {
  g_can_checkpoint.store(can);
  // A signal that came before (and found the flag true) still counts.
}
bool stop_requested() { return g_stop.load() != 0; }

void install_stop_handlers(int launcher_pid) {
  g_launcher_pid = launcher_pid;
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  // The threads started from here on (autograd's, CUDA's, cuDNN's, the
  // loader's) never take these signals: one that lands in a library's
  // thread interrupts whatever system call it is in, and under torchrun
  // 2.x a SIGTERM crashed a worker inside cuDNN's runtime compiler (nvrtc)
  // that way. A thread of ours waits for them instead; the handler above
  // stays for a thread that started earlier.
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop, nullptr);
    std::thread([stop] {
      for (;;) {
        siginfo_t info{};
        const int sig = sigwaitinfo(&stop, &info);
        if (sig <= 0) continue;
        // A caller that set the default disposition back (app.cpp's
        // defer_error: a rank waiting to print its error) wants the
        // signal's default: the process ends by it, as it would have.
        struct sigaction now {};
        if (sigaction(sig, nullptr, &now) == 0 && now.sa_handler == SIG_DFL) {
          sigset_t one;
          sigemptyset(&one);
          sigaddset(&one, sig);
          pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
          raise(sig);
          _exit(128 + sig);
        }
        on_stop_signal(sig, &info, nullptr);
      }
    }).detach();
  });
}

}  // namespace ddp
