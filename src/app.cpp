// Entry point shared by ddptrain and the template.
#include "ddp/app.h"
#include "ddp/program.h"
#include "ddp/data/gpu_images.h"

#include <malloc.h>

#include <algorithm>
#include <csignal>
#include <ctime>
#include <cstdio>
#include <filesystem>
#include <optional>
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
#include "ddp/train/resume.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/shards.h"
#include "ddp/cmd/doctor.h"
#include "ddp/cmd/generate.h"
#include "ddp/cmd/shards.h"
#include "ddp/cmd/subcommand.h"
#include "ddp/cmd/predict.h"
#include "ddp/data/synthetic.h"
#include "ddp/error.h"
#include "ddp/dist/launch.h"
#include "ddp/models/registry.h"
#include "ddp/cmd/report.h"
#include "ddp/dist/signals.h"

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

// Ranks to run on this node: --size, else one per usable GPU, else one CPU
// rank with every core (as torchrun's and Lightning's CPU defaults). Two
// single-threaded ranks on a 2-core machine train at 1,100 samples/s where
// one rank with both cores does 1,800 (bench/RESULTS.md, "The first hour");
// --size N still runs N CPU ranks over Gloo.
int local_ranks(const Config& c) {
  const int usable = usable_gpus(c);
  return c.size > 0 ? c.size : (usable > 0 ? usable : 1);
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

// The ranks' command line: this one, with --resume naming the file this
// process chose (choose_resume_checkpoint), so that every rank and every
// restart reads its flags from that file and not from a newer one that
// appeared under --save_path since. None chosen (--resume auto on an empty
// --save_path): the ranks start fresh, without --resume or --reschedule.
std::vector<std::string> with_resume_file(const std::vector<std::string>& argv, const std::string& file,
                                          bool reschedule) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--resume") {
      ++i;  // and its value
    } else if (a.rfind("--resume=", 0) != 0 && a != "--reschedule") {
      out.push_back(a);
    }
  }
  if (!file.empty()) out.insert(out.end(), {"--resume", file});
  if (!file.empty() && reschedule) out.push_back("--reschedule");
  return out;
}

// The parent side: check the GPU request, then start the local ranks.
// `resolved_resume`: c.resume is the file this process chose to resume.
int launch(const Config& c, int argc, char** argv, bool resolved_resume) {
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
  lo.program = c.program.name;
  lo.argv.push_back(self_executable());
  for (int i = 1; i < argc; ++i) lo.argv.push_back(argv[i]);
  if (resolved_resume) lo.argv = with_resume_file(lo.argv, c.resume, c.reschedule);
  return launch_workers(lo);
}

// --inject-fault RANK:STEP[:how], for tests of restarts, crash reports and
// preemption: throws on that rank after that optimizer step (first attempt
// only); segv crashes there with SIGSEGV, user throws a bad-input error (as
// a corrupt sample would), term sends SIGTERM to the job's launcher (to the
// rank itself when it has none), as a preemption would, at a step a test
// can rely on however fast the steps are. It hooks the trainer from
// outside; the loop knows nothing of it. (validate() checked the form.)
void install_fault_injection(const std::string& fault) {
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  int rank = -1;
  long step = -1;
  char how[8] = "";
  if (fault.empty() || (attempt && std::atoi(attempt) > 0) ||
      std::sscanf(fault.c_str(), "%d:%ld:%7s", &rank, &step, how) < 2)
    return;
  const bool segv = std::string(how) == "segv", user = std::string(how) == "user", term = std::string(how) == "term";
  Trainer::after_step_hook() = [rank, step, segv, user, term](const World& world, int64_t done) {
    if (world.rank() != rank || done != step) return;
    if (segv) std::raise(SIGSEGV);
    if (term) {
      ::kill(std::getenv("DDPTRAIN_LAUNCHER") ? ::getppid() : ::getpid(), SIGTERM);
      return;
    }
    if (user)
      throw UserError("injected bad input (--inject-fault) on rank " + std::to_string(rank) + " at step " +
                      std::to_string(step) + ".");
    throw std::runtime_error("injected failure (--inject-fault) at step " + std::to_string(step));
  };
}

int run_worker(Config c, Placement where, Task& task, const std::string& command) {
  // Lines reach the launcher's terminal (or log file) as they are written.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  install_crash_handler();
  // A peer that dies closes its sockets. Writing to one must fail with an
  // error that the collective names (a lost peer), not kill this rank with
  // SIGPIPE, which the launcher would blame on it. Python ignores it too.
  std::signal(SIGPIPE, SIG_IGN);
  install_stop_handlers(where.launched() ? getppid() : 0);
  set_stop_can_checkpoint(false);  // until the training loop runs (Trainer::fit)
  // After a failure the launcher restarts the group (--max-restarts); the
  // trainer picks up from this job's newest checkpoint, as torchrun's
  // elastic agent would (Trainer::find_resume_checkpoint).

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
  if (command == "bench") return run_bench(c, world, c.program.description.empty() ? nullptr : &task);
  if (command == "predict") return run_predict(c, world, task);
  check_user(!c.largest_batch, "--largest-batch searches the batch size for `" + c.program.name + " bench`; training takes --batch as given.",
             "run `" + c.program.name + " bench --largest-batch ...` first, then train with --batch N.");
  const std::string launcher = where.source == "none" ? "no launcher" : where.source + " launcher";
  DDP_PRINT0(world, "%s: rank %d of %d (%s), backend %s\n", c.program.name.c_str(), world.rank(), world.size(),
             launcher.c_str(), world.backend_name().c_str());
  torch::manual_seed(c.seed);
  install_fault_injection(c.inject_fault);
  Trainer trainer(c, world, task);
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

// --resume continues a run as it was started: the flags saved in `path`
// (choose_resume_checkpoint's file), with only those that leave the job the
// same taken from the command line (resumed_config() refuses the others).
Config with_saved_flags(const Config& c, const std::string& path) {
  if (path.empty()) return c;
  const auto saved = read_checkpoint_meta(path).config;
  return saved.empty() ? c : resumed_config(c, saved, path);
}

// Whether this process prints the notes of the resume choice: rank 0, or a
// process that is no rank (ddptrain's launcher, or a single process).
bool speaks() {
  const char* rank = std::getenv("RANK");
  return !rank || std::string(rank) == "0";
}

}  // namespace

data::Splits load_data(const Config& c, bool verbose, torch::Device device) {
  // ---- files of your own: image folders and CIFAR-10 (src/data/image_folder.cpp, cifar10.cpp) ----
  check_user(c.dataset == "imagefolder" || c.dataset == "shards" || (c.image_decode != "gpu" && !c.was_given("cpu-decode-share")),
             "--image-decode gpu and --cpu-decode-share apply to --dataset imagefolder and shards only.",
             "drop them, or pass --dataset imagefolder or shards.");
  check_user(c.dataset == "imagefolder" || !c.was_given("strict-data"),
             "--strict-data applies to --dataset imagefolder only (shards stop at a corrupt image unless --skip-bad-samples).",
             "drop it, or pass --dataset imagefolder.");
  check_user(c.dataset == "imagefolder" || c.dataset == "shards" || (c.image_size == 0 && c.val_root.empty()),
             "--image-size and --val-root apply to --dataset imagefolder and shards only.",
             "drop them, or pass --dataset imagefolder or shards.");
  check_user(c.dataset == "shards" || (!c.was_given("shard-streams") && !c.was_given("shuffle-buffer") &&
                                       !c.was_given("skip-bad-samples")),
             "--shard-streams, --shuffle-buffer and --skip-bad-samples apply to --dataset shards only.",
             "drop them, or pass --dataset shards.");
  const bool gpu_decode = data::gpu_decode_chosen(c.image_decode, device);
  check_user(gpu_decode || !c.was_given("cpu-decode-share"),
             "--cpu-decode-share splits the decoding between the CPU and nvJPEG, but this run decodes every image "
             "on the CPU (--image-decode " + c.image_decode + (device.is_cuda() ? "" : " on a CPU device") + ").",
             "drop --cpu-decode-share, or decode on the GPU with --image-decode gpu.");
  check_user((c.dataset != "imagefolder" && c.dataset != "shards") || (!c.was_given("train-samples") && !c.was_given("test-samples")),
             "--train-samples and --test-samples do not apply to --dataset " + c.dataset + ": it trains on every "
             "sample of --data_root.",
             "for a quick trial, point --data_root at a smaller folder, or lower --image-size.");
  check_user(c.dataset != "synthetic" || !c.was_given("data_root"),
             "--dataset synthetic makes its own data, so --data_root " + c.data_root + " would not be read.",
             "drop one of them: --dataset auto reads Fashion-MNIST from --data_root.");
  // The default --data_root is Fashion-MNIST's folder: MNIST must be named.
  check_user(c.dataset != "mnist" || c.was_given("data_root"),
             "--dataset mnist needs --data_root: the default, " + c.data_root + ", holds Fashion-MNIST.",
             "pass --data_root DIR with MNIST's train-images-idx3-ubyte(.gz) and the other three IDX files, or "
             "--dataset fashion-mnist.");
  if (c.image_decode == "gpu") {
    check_user(device.is_cuda(), "--image-decode gpu needs training on a GPU, but this run trains on the CPU.",
               "use --image-decode cpu (or auto), or train on a GPU.");
    check_user(data::gpu_jpeg_available(),
               "--image-decode gpu needs a CUDA build of ddptrain with nvJPEG, and this build has none.",
               "use --image-decode cpu (or auto), or rebuild where the CUDA toolkit provides nvjpeg.h and libnvjpeg.");
  }
  if ((c.dataset == "imagefolder" || c.dataset == "shards") && gpu_decode && verbose)
    std::fprintf(stderr,
                 "%s: images are resized on the GPU; the loader's threads decode %.0f%% of each batch's crops, "
                 "nvJPEG the rest (--cpu-decode-share)\n",
                 c.program.name.c_str(), 100 * c.cpu_decode_share);
  if (c.dataset == "imagefolder")
    return data::load_image_folder(data::ImageFolderSplitOptions()
                                       .root(c.data_root)
                                       .val_root(c.val_root)
                                       .val_fraction(c.val_split)
                                       .image_size(c.image_size > 0 ? c.image_size : 224)
                                       .augment(c.augment != "none")  // auto: the built-in image data is augmented
                                       .strict(c.strict_data)
                                       .gpu_decode(gpu_decode)
                                       .cpu_decode_share(c.cpu_decode_share));
  if (c.dataset == "shards")
    return data::load_image_shards(data::ShardSplitOptions()
                                       .pattern(c.data_root)
                                       .val_pattern(c.val_root)
                                       .image_size(c.image_size > 0 ? c.image_size : 224)
                                       .augment(c.augment != "none")
                                       .gpu_decode(gpu_decode)
                                       .cpu_decode_share(c.cpu_decode_share)
                                       .skip_bad(c.skip_bad_samples));
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

// How long a rank holds back its error line, so that a peer's report of the
// same cause comes first and alone (0: print at once). Under ddptrain's
// launcher, kRankErrorDeferSeconds (launch.h). Under torchrun's agent, which
// polls its workers every --monitor-interval (5 s in torch 1.13, 0.1 s in
// 2.x) and then stops the rest of the group: 8 s, so that ranks meeting the
// same error up to 3 s apart still print it once.
constexpr double kTorchrunErrorDeferSeconds = 8.0;
constexpr double kTorchrunMonitorSeconds = 5.0;
double error_defer_seconds() {
  if (std::getenv("DDPTRAIN_LAUNCHER")) return kRankErrorDeferSeconds;
  if (std::getenv("TORCHELASTIC_RESTART_COUNT")) return kTorchrunErrorDeferSeconds;  // set by torchrun's agent only
  return 0;
}

// Waits `seconds` before the line is printed; a stop signal in that time
// (the launcher's or the agent's, once the cause is known) ends the process
// quietly.
void defer_error(double seconds) {
  if (seconds <= 0) return;
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGINT, SIG_DFL);
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

// Bad flags or data fail every rank of a job alike; the user should read the
// error once, not once per rank. Under ddptrain's launcher or torchrun, ranks
// other than 0 wait before printing: when rank 0 fails too, the launcher
// stops them in that time and rank 0's line is the only one. An error that
// only this rank meets is still printed, a few seconds later.
void defer_to_rank_0(const char* rank) {
  if (rank && std::string(rank) != "0") defer_error(error_defer_seconds());
}

// A collective that failed is nearly always the consequence of another
// rank's failure, which that rank reports itself (or the launcher does, for
// a crash). Under a launcher a rank holds such a line back longer than the
// cause holds back its own: the launcher stops it in that time once the
// cause is known, and it is printed only when no rank failed for its own
// reasons (one stalled, say). torchrun learns of the cause's exit only at its
// next poll, so there the wait covers that poll too: else rank 0's follow-on
// line came second and torchrun named rank 0 the root cause.
void defer_to_the_cause() {
  if (std::getenv("DDPTRAIN_LAUNCHER")) defer_error(kRankErrorDeferSeconds + 1);
  else if (std::getenv("TORCHELASTIC_RESTART_COUNT")) defer_error(kTorchrunErrorDeferSeconds + kTorchrunMonitorSeconds + 3);
}

// Under torchrun, Slurm or mpirun the ranks exist already: ddptrain's own
// launcher flags would be ignored, then saved with the run and obeyed by a
// later plain `ddptrain --resume` (which waited for a second node that
// never came). Refused on the command line, before anything is saved.
void refuse_launcher_flags_under(const Placement& where, const Config& c) {
  if (!where.launched() || where.source == "ddptrain") return;
  const std::string by = where.source + " (rank " + std::to_string(where.rank) + " of " +
                         std::to_string(where.world_size) + ", " + std::to_string(where.local_world_size) + " here)";
  check_user(!c.was_given("size") || c.size == 0 || c.size == where.local_world_size,
             "--size " + std::to_string(c.size) + " asks ddptrain to start its own ranks, but this process was started by " +
                 by + ".",
             "drop --size (the launcher sets the ranks: torchrun's --nproc-per-node), or run ddptrain without it.");
  check_user(!c.was_given("nnodes") || c.nnodes == where.world_size / std::max(1, where.local_world_size),
             "--nnodes " + std::to_string(c.nnodes) + " does not apply: this process was started by " + by + ".",
             "drop --nnodes (the launcher sets the nodes: torchrun's --nnodes).");
  check_user(!c.was_given("max-restarts") || c.max_restarts == 0,
             "--max-restarts restarts ddptrain's own ranks, but this process was started by " + by + ".",
             "drop it and ask the launcher to restart (torchrun's --max-restarts, or a Slurm requeue).");
  check_user(c.visible.empty(),
             "--visible picks the GPUs of ddptrain's own ranks, but this process was started by " + by + ".",
             "drop it and set CUDA_VISIBLE_DEVICES for the launcher instead.");
}

// Who the program is: ddptrain's own binary, or a program with a task of its
// own, named as its author asked (else as its file is) and with only the
// flags its task reads in --help.
ProgramInfo program_info(const ProgramOptions& options, bool own_task, const char* argv0) {
  ProgramInfo info;
  if (!own_task) return info;
  info.name = !options.name().empty() ? options.name() : argv0 ? fs::path(argv0).filename().string() : "train";
  info.description = options.description().empty() ? "trains a task of its own" : options.description();
  return info;
}

// The --task that picks the built-in task, from the command line or a
// config file. Every built-in task's flags join this first parse, so that
// theirs are not unknown yet (the second parse knows only the chosen
// task's); --help is left to the second parse, which lists them.
std::string builtin_task_of(std::vector<char*>& args, std::optional<std::string>& resume_from) {
  std::string named;
  bool help = false;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string a = args[i];
    if (a == "-h" || a == "--help") help = true;
    if (a == "--task" && i + 1 < args.size()) named = args[i + 1];
    if (a.rfind("--task=", 0) == 0) named = a.substr(7);
  }
  if (help) return named.empty() ? "classification" : named;
  const Config c = parse_cli(static_cast<int>(args.size()), args.data(), builtin_task_flags());
  if (named.empty() && !c.checkpoint.empty() && fs::is_regular_file(c.checkpoint)) {
    // predict --checkpoint without --task: the run's own task.
    const auto saved = read_checkpoint_meta(c.checkpoint).config;
    if (saved.contains("task") && saved["task"].is_string()) return saved["task"].get<std::string>();
  }
  if (named.empty() && (!c.resume.empty() || restart_attempt() > 0)) {
    // --resume without --task: the run's own task, from its checkpoint, as
    // with_saved_flags restores the rest of its flags (from the same file).
    const std::string path = choose_resume_checkpoint(c, speaks());
    resume_from = path;
    if (!path.empty()) {
      const auto saved = read_checkpoint_meta(path).config;
      if (saved.contains("task") && saved["task"].is_string()) return saved["task"].get<std::string>();
    }
  }
  return c.task;
}

}  // namespace

int main(int argc, char** argv, std::shared_ptr<Task> task, ProgramOptions program) {
  keep_freed_memory_in_heap();
  const char* rank = std::getenv("RANK");
  const bool own_task = task != nullptr;
  const ProgramInfo info = program_info(program, own_task, argc > 0 ? argv[0] : nullptr);
  set_program_name(info.name);
  const std::string who = info.name + (rank ? std::string(" rank ") + rank : "");
  try {
    // Subcommands: `PROGRAM doctor|bench [flags]` run instead of training;
    // `PROGRAM report RUN_DIR` and `PROGRAM export CHECKPOINT OUT.pt` need
    // no ranks at all.
    if (argc > 1 && std::string(argv[1]) == "report") return report_command({argv + 2, argv + argc}, info.name);
    if (argc > 1 && std::string(argv[1]) == "generate" && !own_task) return generate_command({argv + 2, argv + argc});
    if (argc > 1 && std::string(argv[1]) == "shards") return shards_command({argv + 2, argv + argc}, info.name);
    std::vector<char*> args(argv, argv + argc);
    std::string command;
    if (argc > 1 && (std::string(argv[1]) == "doctor" || std::string(argv[1]) == "bench" ||
                     std::string(argv[1]) == "predict")) {
      command = argv[1];
      args.erase(args.begin() + 1);
    }
    if (argc > 1 && std::string(argv[1]) == "export") {
      const std::string usage = "usage: " + info.name + " export CHECKPOINT OUT.pt";
      if (argc == 3 && (std::string(argv[2]) == "--help" || std::string(argv[2]) == "-h")) {
        std::printf("%s\nwrites CHECKPOINT's weights (the moving average's with --ema) as a PyTorch state_dict\n",
                    usage.c_str());
        return exit_code::kOk;
      }
      check_user(argc == 4, usage, "e.g. " + info.name + " export checkpoint/train_<time>/best.pt weights.pt");
      export_weights(argv[2], argv[3]);
      std::printf("wrote %s (a PyTorch state_dict: torch.load it and call load_state_dict)\n", argv[3]);
      return exit_code::kOk;
    }
    // Training takes flags only: a first word that is no command (`train
    // exprot a b`) is said to be one, not left to the flag parser.
    if (argc > 1 && command.empty() && argv[1][0] != '-') {
      std::vector<std::string> commands{"predict", "export", "report", "doctor", "bench", "shards"};
      if (!own_task) commands.push_back("generate");
      std::string list;
      for (const auto& name : commands) list += (list.empty() ? "" : ", ") + name;
      throw UserError("unknown command '" + std::string(argv[1]) + "'.",
                      nearest_word(argv[1], commands) + "The commands are " + list + "; training takes flags only ('" +
                          info.name + " --help').");
    }
    // The task's flags and defaults join the table before parsing; the
    // built-in task is the one --task names (so it is parsed twice).
    Config defaults;
    defaults.program = info;
    // A program of the user's reads its own data: ./data unless its task's
    // add_flags() says otherwise (ddptrain's own default is Fashion-MNIST's
    // Debian folder).
    if (own_task) defaults.data_root = "data";
    std::optional<std::string> resume_from;  // --resume's file, chosen once
    if (!task) task = make_builtin_task(builtin_task_of(args, resume_from));
    task->add_flags(defaults);
    if (own_task) defaults.program.unread_flags = task->ignored_flags();
    Config c = parse_cli(static_cast<int>(args.size()), args.data(), defaults);
    Placement where = placement_from_env();
    refuse_launcher_flags_under(where, c);
    const bool resumes = command.empty() && (!c.resume.empty() || restart_attempt() > 0);
    if (resumes) {
      if (!resume_from) resume_from = choose_resume_checkpoint(c, speaks());
      check_save_path_fits_resume(c, *resume_from);
      c = with_saved_flags(c, *resume_from);
      c.resume = *resume_from;  // the file itself from here on: the ranks and the trainer load it
    }
    if (command == "predict") c = predict_config(c);  // the flags of the run that wrote --checkpoint
    // Restarts live in the launcher, so --max-restarts starts one even for
    // a single process.
    if (!where.launched() && (local_ranks(c) > 1 || c.nnodes > 1 || !c.visible.empty() || c.max_restarts > 0))
      return launch(c, argc, argv, resumes);
    return run_worker(c, where, *task, command);
  } catch (const UserError& e) {
    defer_to_rank_0(rank);
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return exit_code::kUsage;
  } catch (const Preempted& e) {
    if (!rank || std::string(rank) == "0") std::fprintf(stderr, "%s: %s\n", info.name.c_str(), e.what());
    return exit_code::kPreempted;
  } catch (const NonFiniteLoss& e) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return exit_code::kNonFinite;
  } catch (const CollectiveError& e) {
    defer_to_the_cause();
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
