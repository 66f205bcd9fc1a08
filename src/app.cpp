// Entry point shared by ddptrain and the template.
#include "ddp/app.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <malloc.h>
#include <ucontext.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>
#include <atomic>
#include <chrono>
#include <unistd.h>

#include "ddp/data/cifar10.h"
#include "ddp/data/data_root.h"
#include "ddp/data/idx.h"
#include "ddp/cmd/bench.h"
#include "ddp/io/checkpoint.h"
#include "ddp/data/image_folder.h"
#include "ddp/cmd/doctor.h"
#include "ddp/data/synthetic.h"
#include "ddp/error.h"
#include "ddp/dist/launch.h"
#include "ddp/models/registry.h"
#include "ddp/cmd/report.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

int gpu_count() {
#ifdef DDP_WITH_CUDA
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
#else
  return 0;
#endif
}

// GPUs this node may use: the --visible list, else every visible GPU (0 on CPU).
int usable_gpus(const Config& c) {
  const auto visible = split_commas(c.visible);
  if (!visible.empty()) return static_cast<int>(visible.size());
  return c.backend == "gloo" ? 0 : gpu_count();
}

// Ranks to run on this node: --size, else one per usable GPU, else 2 CPU ranks.
int local_ranks(const Config& c) {
  const int usable = usable_gpus(c);
  return c.size > 0 ? c.size : (usable > 0 ? usable : 2);
}

// --visible on a machine where LibTorch sees no GPU: running CPU ranks
// instead would ignore what the user asked for.
void refuse_visible_without_gpus(const std::string& visible) {
  if (visible.empty() || gpu_count() > 0) return;
#ifdef DDP_WITH_CUDA
  const std::string why = "this machine has no GPU that CUDA can use.";
#else
  const std::string why = "this ddptrain is built with a CPU-only LibTorch.";
#endif
  throw UserError("--visible " + visible + " names GPUs, but " + why,
                  "drop --visible to train on CPU ranks (--size N sets how many).");
}

// The parent side: check the GPU request, then start the local ranks.
int launch(const Config& c, int argc, char** argv) {
  const int gpus = c.backend == "gloo" ? 0 : gpu_count();
  auto visible = split_commas(c.visible);
  refuse_visible_without_gpus(c.visible);
  for (const auto& v : visible) {
    bool ok = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos && std::stoi(v) < gpus;
    check_user(gpus == 0 || ok, "--visible names GPU '" + v + "', but this machine has " + std::to_string(gpus) + " GPU(s) (0.." +
                                    std::to_string(gpus - 1) + ").",
               "list existing GPU indices, e.g. --visible 0,1 (see nvidia-smi).");
  }
  const int usable = usable_gpus(c);
  LaunchOptions lo;
  lo.nproc_per_node = local_ranks(c);
  check_user(usable == 0 || lo.nproc_per_node <= usable,
             "--size " + std::to_string(lo.nproc_per_node) + " asks for more ranks than the " + std::to_string(usable) +
                 " GPU(s) available.",
             "use --size " + std::to_string(usable) + " or fewer (one rank per GPU), or --backend gloo for CPU ranks.");
  lo.nnodes = c.nnodes;
  lo.node_rank = c.node_rank;
  lo.master_addr = c.address == "localhost" ? "127.0.0.1" : c.address;
  lo.master_port = c.port;
  lo.visible = visible;
  lo.max_restarts = c.max_restarts;
  lo.rendezvous_timeout = c.timeout;
  lo.argv.push_back(self_executable());
  for (int i = 1; i < argc; ++i) lo.argv.push_back(argv[i]);
  return launch_workers(lo);
}

// First SIGTERM/SIGINT: checkpoint at the next agreed step and stop.
// Second: stop at once.
std::atomic<int> g_signals{0};
void on_stop_signal(int sig) {
  if (g_signals.fetch_add(1) >= 1) _exit(128 + sig);
  request_stop();
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
  static const char head[] = "ddptrain: worker crashed; native stack:\n";
  if (write(STDERR_FILENO, head, sizeof(head) - 1) < 0) {}
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

int run_worker(Config c, Placement where, const PartsFactory& make_parts, const std::string& command) {
  // Lines reach the launcher's terminal (or log file) as they are written.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  install_crash_handler();
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  // After a failure the launcher restarts the group (--max-restarts): pick
  // up from the newest checkpoint, as torchrun's elastic agent would.
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (attempt && std::atoi(attempt) > 0 && c.resume.empty()) c.resume = "auto";

  if (!where.launched()) {
    where.master_addr = c.address == "localhost" ? "127.0.0.1" : c.address;
    where.master_port = c.port;
  }
  WorldOptions wo;
  wo.backend = c.backend;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout * 1000));
  World world(where, wo);
  if (!world.device().is_cuda()) {
    // Ranks that share a CPU split its cores instead of oversubscribing them.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    torch::set_num_threads(std::max(1, cores / std::max(1, where.local_world_size)));
  }
  if (command == "doctor") return run_doctor(world);
  if (command == "bench") return run_bench(c, world);
  DDP_PRINT0(world, "ddptrain: rank %d of %d (%s launcher), backend %s\n", world.rank(), world.size(),
             where.source.c_str(), world.backend_name().c_str());
  torch::manual_seed(c.seed);
  Parts parts = make_parts(c, world);
  Trainer trainer(c, world, std::move(parts));
  trainer.fit();
  return exit_code::kOk;
}

// --dataset fashion-mnist|mnist on a folder that holds another kind of
// data: say which, instead of the generic "file not found".
void refuse_other_data(const std::string& root) {
  const auto r = data::inspect_data_root(root);
  if (r.kind == data::DataRootKind::kImageFolder || r.kind == data::DataRootKind::kLooseImages ||
      r.kind == data::DataRootKind::kCifar10)
    throw UserError(r.found, r.fix);
}

// Loud on purpose: a run on synthetic data must not pass for a real one.
void print_synthetic_banner(const std::string& root) {
  std::fprintf(stderr,
               "ddptrain: ==== SYNTHETIC DATA ====\n"
               "ddptrain: no Fashion-MNIST at the default --data_root '%s', so this run trains on the built-in\n"
               "ddptrain: SYNTHETIC dataset; its accuracy says nothing about real data. For Fashion-MNIST: apt-get\n"
               "ddptrain: install dataset-fashion-mnist, or pass --data_root DIR (--dataset synthetic silences this).\n",
               root.c_str());
}

}  // namespace

data::Splits load_data(const Config& c, bool verbose) {
  // ---- files of your own: image folders and CIFAR-10 (src/data/image_folder.cpp, cifar10.cpp) ----
  check_user(c.dataset == "imagefolder" || (c.image_size == 0 && c.val_root.empty()),
             "--image-size and --val-root apply to --dataset imagefolder only.",
             "drop them, or pass --dataset imagefolder.");
  if (c.dataset == "imagefolder")
    return data::load_image_folder(data::ImageFolderSplitOptions()
                                       .root(c.data_root)
                                       .val_root(c.val_root)
                                       .val_fraction(c.val_split)
                                       .image_size(c.image_size > 0 ? c.image_size : 224)
                                       .augment(c.augment == "standard")
                                       .strict(c.strict_data));
  if (c.dataset == "cifar10") return data::load_cifar10(c.data_root, c.train_samples, c.test_samples);
  // ---- built-in data ----
  const bool want_files = c.dataset != "synthetic";
  const bool have_files = fs::exists(fs::path(c.data_root) / "train-images-idx3-ubyte.gz") ||
                          fs::exists(fs::path(c.data_root) / "train-images-idx3-ubyte");
  if (want_files && (have_files || c.dataset != "auto")) {
    const std::string name = c.dataset == "mnist" ? "mnist" : "fashion-mnist";
    if (!have_files) refuse_other_data(c.data_root);
    return data::load_mnist_like(c.data_root, name, c.train_samples, c.test_samples);
  }
  // Only the bare run (no --data_root, no --dataset) may fall back to
  // synthetic data: data the user named is used, or the run stops.
  if (c.dataset == "auto" && (c.was_given("data_root") || c.was_given("dataset")))
    data::throw_not_mnist_like(c.data_root, "Fashion-MNIST");
  if (c.dataset == "auto" && verbose) print_synthetic_banner(c.data_root);
  const int64_t n_train = c.train_samples > 0 ? c.train_samples : 60000;
  const int64_t n_test = c.test_samples > 0 ? c.test_samples : 10000;
  return data::make_synthetic(n_train, n_test, static_cast<uint64_t>(c.seed));
}

Parts default_parts(const Config& c, World& world) {
  Parts p;
  p.data = load_data(c, world.is_main());
  models::ModelSpec spec;
  spec.name = c.model;
  spec.stem = c.stem;
  const auto shape = p.data.train->input_shape();
  check_user(shape.size() == 3, "the built-in models need C x H x W images; the dataset gives " +
                                    c10::str(c10::IntArrayRef(shape)) + ".");
  spec.in_channels = shape[0];
  spec.input_hw = {shape[1], shape[2]};
  spec.num_classes = p.data.train->num_classes();
  p.model = models::make_model(spec);
  p.arch = c.model + "/" + c.stem + "/" + std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + "x" +
           std::to_string(shape[2]) + "/" + std::to_string(spec.num_classes);
  return p;
}

// LibTorch's CPU allocator uses malloc. glibc serves blocks above 128 KiB
// with mmap and unmaps them on free, so every training step faults in and
// zeroes its activations afresh: measured 4x slower (610 vs 2474 samples/s
// for the CNN on one core, most of it system time). Keeping freed memory in
// the heap makes the steady state allocation-free, as a caching allocator
// would. This must happen before the first large allocation.
void keep_freed_memory_in_heap() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
}

namespace {

// Bad flags or data fail every rank of a job alike; the user should read the
// error once, not once per rank. Under ddptrain's launcher, ranks other than
// 0 wait before printing: when rank 0 fails too, the launcher stops them in
// that time (SIGTERM, which now ends them quietly) and rank 0's line is the
// only one. An error that only this rank meets is still printed, 2 s later.
void defer_to_rank_0(const char* rank) {
  if (!rank || std::string(rank) == "0" || !std::getenv("DDPTRAIN_LAUNCHER")) return;
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGINT, SIG_DFL);
  std::this_thread::sleep_for(std::chrono::seconds(2));
}

}  // namespace

int main(int argc, char** argv, const PartsFactory& make_parts) {
  keep_freed_memory_in_heap();
  const char* rank = std::getenv("RANK");
  const std::string who = std::string("ddptrain") + (rank ? std::string(" rank ") + rank : "");
  try {
    // Subcommands: `ddptrain doctor|bench [flags]` run instead of training;
    // `ddptrain report RUN_DIR` and `ddptrain export CHECKPOINT OUT.pt` need
    // no ranks at all.
    if (argc > 1 && std::string(argv[1]) == "report") return report_command({argv + 2, argv + argc});
    std::vector<char*> args(argv, argv + argc);
    std::string command;
    if (argc > 1 && (std::string(argv[1]) == "doctor" || std::string(argv[1]) == "bench")) {
      command = argv[1];
      args.erase(args.begin() + 1);
    }
    if (argc > 1 && std::string(argv[1]) == "export") {
      check_user(argc == 4, "usage: ddptrain export CHECKPOINT OUT.pt",
                 "e.g. ddptrain export checkpoint/train_<time>/best.pt resnet18.pt");
      export_weights(argv[2], argv[3]);
      std::printf("wrote %s (a PyTorch state_dict: torch.load it and call load_state_dict)\n", argv[3]);
      return exit_code::kOk;
    }
    Config c = parse_cli(static_cast<int>(args.size()), args.data());
    Placement where = placement_from_env();
    if (!where.launched() && (local_ranks(c) > 1 || c.nnodes > 1 || !c.visible.empty()))
      return launch(c, argc, argv);
    return run_worker(c, where, make_parts, command);
  } catch (const UserError& e) {
    defer_to_rank_0(rank);
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return exit_code::kUsage;
  } catch (const Preempted& e) {
    if (!rank || std::string(rank) == "0") std::fprintf(stderr, "ddptrain: %s\n", e.what());
    return exit_code::kPreempted;
  } catch (const NonFiniteLoss& e) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return exit_code::kNonFinite;
  } catch (const CollectiveError& e) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return exit_code::kPeerFailed;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", who.c_str(), e.what_without_backtrace());
    return exit_code::kFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", who.c_str(), e.what());
    return exit_code::kFailure;
  }
}

}  // namespace ddp
