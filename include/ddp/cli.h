// The command line: one table drives parsing, --help and the printed config.
//
// Every flag is one row of flag_table(): its names, help text, the Config
// field it writes and, where it has them, its allowed values. CLI11 parses
// from the table, --help is CLI11's rendering of it, and print/json walk the
// same rows, so the three cannot drift apart.
#pragma once

#include <iosfwd>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp {

/// A flag that a task adds (Task::add_flags): its row in the flag table, and
/// its value, which holds the default until the command line sets it.
struct TaskFlag {
  std::string names;   // e.g. "--aux-weight"
  std::string help;
  std::variant<int, double, std::string, bool> value;
  std::vector<std::string> choices;  // empty: any value of the type
  std::string key() const;           // "aux-weight"
};

/// Who parses the flags: ddptrain itself, or a program built from the
/// template (ddp::ProgramOptions, app.h, fills it in).
struct ProgramInfo {
  std::string name = "ddptrain";   // in messages: "Run 'train --help'"
  std::string description;         // --help's first line; "": ddptrain's own
  /// Built-in flags that this program's task does not read: --help leaves
  /// them out (Task::ignored_flags before set-up).
  std::vector<std::string> unread_flags;
};

struct Config {
  // The seed template's flags, same names and meanings.
  int port = 0;                     // 0: a free port on one node
  int size = 0;                     // ranks on this node; 0: every visible GPU, else 1 CPU rank
  std::string visible;              // GPUs, e.g. "0,1"; "": all
  std::string address = "127.0.0.1";
  int epochs = 3;
  int batch = 64;                   // per rank
  std::string pretrain;
  std::string pretrain_skip;        // glob of names to leave as initialised
  std::string save_path = "./checkpoint";
  int save_epoch = 10;
  std::string data_root = "/usr/share/datasets/fashion-mnist";
  // Data.
  std::string dataset = "auto";     // auto | fashion-mnist | mnist | synthetic | imagefolder | cifar10 | shards
  int train_samples = 0;            // 0: all
  int test_samples = 0;
  std::string val_root;             // imagefolder: separate validation folder; "": use val_split
  double val_split = 0;             // fraction of train held out for validation (imagefolder: per class; 0.1 there unless --val-root)
  bool test_every_epoch = false;    // with a validation split: evaluate test every epoch too
  int image_size = 0;               // imagefolder crops (0: 224); ddptrain bench inputs (0: 64)
  bool strict_data = false;         // a corrupt image stops the run instead of being skipped
  std::string image_decode = "auto";  // imagefolder: cpu | gpu (nvJPEG) | auto (gpu on a CUDA device with nvJPEG)
  double cpu_decode_share = 1;        // imagefolder with GPU decoding: share of each batch decoded on the loader's threads
  std::string augment = "auto";     // auto: standard for the built-in image data, none for a task's own
  int workers = 1;
  int shard_streams = 0;            // shards: sequential readers per epoch (0: the world size at the run's start)
  int shuffle_buffer = 1000;        // shards: samples in each stream's shuffle buffer
  bool skip_bad_samples = false;    // shards: skip (and count) a sample missing a field or whose image does not decode
  // The task, model and optimisation.
  std::string task = "classification";  // ddptrain's built-in tasks: classification | regression
  std::string model = "cnn";
  std::string stem = "auto";
  std::string optimizer = "adamw";
  double lr = 0;                    // 0 until resolved: per-optimizer default
  double weight_decay = -1;         // -1 until resolved
  double momentum = 0.9;
  std::string schedule = "onecycle";
  double warmup_epochs = 0;          // 0: none (onecycle rises over 30% of the run)
  std::string loss = "cross-entropy";
  double label_smoothing = 0.0;
  double clip_grad_norm = 0.0;      // 0: off
  double ema = 0;                   // decay of the weights' moving average (train/ema.h); 0: off
  int accum_steps = 1;
  int seed = 0;
  std::string sync_bn = "auto";     // auto | on | off
  // Distributed.
  std::string backend = "auto";
  int nnodes = 1;
  int node_rank = 0;
  double timeout = 300;             // seconds, for every collective
  double bucket_cap_mb = 25;
  // Output.
  std::string progress = "auto";    // auto | bar | plain | none
  int log_every = 50;
  int keep_last = 3;
  int save_top_k = 0;               // keep the best K checkpoints by the monitor (0: off)
  std::string resume;               // "" | auto | a checkpoint | a run directory
  bool reschedule = false;          // --resume with another --epochs: recompute a length-dependent schedule
  int max_restarts = 0;

  // speed (CUDA)
  std::string amp = "off";          // off | bf16 | fp16
  bool cuda_graph = false;
  std::string channels_last = "auto";  // auto: on for CUDA
  bool tf32 = true;
  std::string convert_layers = "on";   // on: torch::nn layers in Sequentials become ddp::nn's at start
  std::string bn_kernel = "auto";      // auto: ddptrain's NHWC bf16 kernels where they apply
  std::string ln_kernel = "auto";      // auto: ddptrain's fused residual add + LayerNorm (--task lm, CUDA, bf16)
  std::string linear_kernel = "auto";   // auto: bias gradients from ddptrain's column-sum kernels (--task lm, CUDA, bf16)
  std::string side_stream = "auto";    // auto: weight gradients on a second CUDA stream for ddptrain's GPT on one GPU
  std::string ce_kernel = "auto";      // auto: ddptrain's fused cross-entropy kernels (--task lm, CUDA)
  // memory
  std::string recompute = "none";      // none | mlp | blocks | blocks:N | stages: recompute activations in backward
  bool shard_optimizer = false;        // ZeRO-1: each rank keeps the optimizer state of its 1/world-size slice
  bool shard_gradients = false;        // ZeRO-2: also the gradients (implies shard_optimizer)
  double stop_at_acc = 0;           // stop after the first epoch at or above this test accuracy (0: off)
  std::string stop_at;              // METRIC=V, METRIC>=V or METRIC<=V ("": off; --stop-at-acc X sets test_acc>=X)
  std::string monitor;              // NAME:min or NAME:max: what picks best.pt ("": the task's monitor())
  int patience = 0;                 // stop after N validations without improvement of the monitor (0: off)
  double min_delta = 0;             // what counts as an improvement for --patience
  int sanity_val_steps = 2;         // validation batches per rank before training (0: off), as Lightning's
  int bench_steps = 100;            // `ddptrain bench`
  bool largest_batch = false;       // `ddptrain bench`: search the largest batch that fits in the GPU's memory
  std::string profile_trace;        // `ddptrain bench`: a Kineto Chrome trace of --bench-steps more steps
  std::string checkpoint;           // `predict`: the checkpoint whose weights predict (e.g. RUN/best.pt)
  std::string split = "test";       // `predict`: train, test, or data of the kind --data_root takes
  std::string out;                  // `predict`: the file written, .csv or .npy
  std::string inject_fault;         // testing: RANK:STEP[:segv|user|term], a failure in a job's first attempt

  /// Not a flag: the program these flags belong to (ddp::main() sets it),
  /// named in --help, errors and the commands a run prints.
  ProgramInfo program;

  /// Values the user set explicitly (by flag name without dashes).
  std::vector<std::string> given;
  bool was_given(const std::string& name) const;

  /// The task's own flags, in the order it added them.
  std::vector<TaskFlag> task_flags;
  /// Adds a task flag with its default, e.g. add_flag("--aux-weight",
  /// "weight of the auxiliary loss", 0.3). It joins --help, config files,
  /// the printed config and config.toml.
  template <typename T>
  void add_flag(const std::string& names, const std::string& help, T default_value,
                std::vector<std::string> choices = {}) {
    using V = std::conditional_t<std::is_same_v<T, const char*>, std::string,
                                 std::conditional_t<std::is_same_v<T, float>, double, T>>;
    task_flags.push_back({names, help, V(default_value), std::move(choices)});
  }
  /// The value of task flag `name` (without dashes); std::logic_error if
  /// there is no such flag of type T (a bug in the task, not user input).
  template <typename T>
  T flag(const std::string& name) const {
    for (const auto& f : task_flags)
      if (f.key() == name) {
        if (const T* v = std::get_if<T>(&f.value)) return *v;
        throw std::logic_error("task flag --" + name + " is not of the type asked for");
      }
    throw std::logic_error("no task flag --" + name + "; add it in Task::add_flags");
  }
};

using FlagTarget = std::variant<int*, double*, std::string*, bool*>;

/// What --resume does with a flag. kSame: it defines the job (data, model,
/// optimisation, seed), so the run's saved value is restored and a
/// different value is refused. kMayChange: it does not change what is
/// learnt (where and how fast the job runs, what it writes), so a value
/// given now replaces the saved one. --data_root and --val-root are
/// kMayChange: a run may find its data elsewhere, and the trainer checks
/// that it is the same data (data/identity.h). --batch and --epochs are kMayChange
/// here and checked by the trainer, which knows the world size and the
/// schedule: the global batch must stay, and a schedule that depends on the
/// run's length changes only with --reschedule. kNotRestored: where this
/// job runs and what it writes outside its run directory (placement:
/// --address --port --nnodes --node-rank --size --visible --backend
/// --timeout --max-restarts; output paths: --save_path --profile-trace)
/// come from this command line and the launcher's environment only. A
/// checkpoint's saved value is never taken: a header is data, and a file
/// from elsewhere must not make the job connect out, start ranks or write.
enum class OnResume { kSame, kMayChange, kNotRestored };

/// Whether every rank of a job must have the same value. kMustAgree: the
/// flag decides what is learnt, which collectives run and when, or how a
/// buffer is laid out, so ranks with different values would deadlock, abort
/// or sum unlike memory; the trainer stops the job naming the flag and the
/// ranks (check_flags_agree). kPerNode: where this node finds its files or
/// GPUs, how fast it loads, what it prints or writes; the job computes the
/// same with any value on any node. --help marks these "[per node]".
enum class AcrossRanks { kMustAgree, kPerNode };

struct Flag {
  std::string names;                 // CLI11 spelling, e.g. "--save_path,--save-path"
  std::string help;
  FlagTarget target;
  std::vector<std::string> choices;  // empty: any value of the type
  std::string group;
  OnResume on_resume = OnResume::kSame;
  AcrossRanks across_ranks = AcrossRanks::kMustAgree;
  /// The key used in the printed config and config.json (first long name).
  std::string key() const;
};

std::vector<Flag> flag_table(Config& config);

/// Parses argv into a Config. `--config FILE` reads TOML first; flags given
/// on the command line override it, and unknown keys are errors. Throws
/// UserError for bad flags, keys or values; prints --help and exits 0.
/// `defaults` holds the defaults (a task's flags and its defaults of the
/// built-in ones).
Config parse_cli(int argc, const char* const* argv, Config defaults = Config());

/// The configuration of a resumed run: the values the checkpoint's run
/// was started with (`saved`, its config as config_to_json wrote it), with
/// the kMayChange flags given now on top. A kSame flag given now with
/// another value is a UserError that lists every such flag, naming
/// `checkpoint`. Saved values that differ from `now`'s defaults count as
/// given, as they were in the run.
Config resumed_config(const Config& now, const nlohmann::json& saved, const std::string& checkpoint);

nlohmann::json config_to_json(const Config& config);
/// `config` with the flags that name files or folders (--data_root,
/// --val-root, --pretrain, --save_path, ...) absolute and normalised, as a
/// run saves them: resumed (or repeated with --config) from another working
/// directory, the run finds what it named.
Config with_absolute_paths(const Config& config);
/// The config as TOML that `--config FILE` reads back to the same values
/// (written to each run directory as config.toml).
std::string config_to_toml(const Config& config);
void print_config(const Config& config, std::ostream& out);

/// UserError if --profile-trace is given to a build without Kineto's GPU
/// profiler (compat::kHasGpuProfiler), before anything runs.
void check_profile_trace_flag(const Config& config);

}  // namespace ddp
