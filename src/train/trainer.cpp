// Trainer: set-up in a fixed order, then the epoch loop.
#include "ddp/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <errno.h>  // program_invocation_name
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "ddp/compat.h"
#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/side_stream.h"
#endif
#include "ddp/data/device_feeder.h"
#include "ddp/data/gpu_images.h"  // gpu_decode_chosen
#include "ddp/data/identity.h"
#include "ddp/data/loader.h"
#include "ddp/data/sampler.h"
#include "ddp/data/shards.h"
#include "ddp/data/transforms.h"
#include "ddp/cmd/report.h"  // write_run_card
#include "ddp/dist/launch.h"  // relaunch_command
#include "ddp/dist/signals.h"
#include "ddp/dist/sync_batchnorm.h"
#include "ddp/error.h"
#include "ddp/nn/convert.h"
#include "ddp/io/progress.h"
#include "ddp/train/early_stopping.h"
#include "ddp/train/flag_agreement.h"
#include "ddp/train/fused_cross_entropy.h"
#include "ddp/train/resume.h"
#include "ddp/train/validation.h"
#include "ddp/models/fused_layer_norm.h"
#include "ddp/models/fused_linear.h"
#include "ddp/models/max_pool.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string timestamp() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d_%H-%M-%S", std::localtime(&t));
  return buf;
}


// "91.23%" for accuracies, "0.312" otherwise.
std::string format_value(const std::string& name, double v) {
  if (std::isnan(v)) return "nan";  // printf may give "-nan"
  char buf[48];
  if (is_fraction_metric(name))
    std::snprintf(buf, sizeof(buf), "%.2f%%", 100 * v);
  else
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

std::string format_metric(const std::string& name, double v) { return name + " " + format_value(name, v); }

// Validation sums, added over ranks in one all-reduce. Every rank must
// return the same names and shapes; a first, fixed-size all-reduce of
// (element count, name signature) checks that, so a mismatch is an error
// instead of a collective of different sizes.
Totals reduce_totals(World& world, const Totals& local, const torch::Device& dev) {
  std::vector<torch::Tensor> flat;
  double signature = 0;
  int64_t numel = 0;
  for (const auto& [name, t] : local) {
    flat.push_back(t.reshape(-1));
    numel += t.numel();
    signature += static_cast<double>(std::hash<std::string>{}(name) % 1000003) * static_cast<double>(t.numel() + 1);
  }
  auto header = torch::tensor({static_cast<double>(numel), signature}, torch::TensorOptions().dtype(torch::kDouble).device(dev));
  auto expected = header.clone() * world.size();
  world.all_reduce(header, "validation totals (shapes)");
  check_user(torch::equal(header, expected),
             "validation_step() returned different names or shapes on different ranks (rank " +
                 std::to_string(world.rank()) + " has " + std::to_string(local.size()) + " totals).",
             "return the same names, each of a fixed shape, for every batch on every rank.");
  if (flat.empty()) return {};
  auto all = torch::cat(flat);
  world.all_reduce(all, "validation totals");
  all = all.cpu();
  Totals out;
  int64_t at = 0;
  for (const auto& [name, t] : local) {
    out[name] = all.slice(0, at, at + t.numel()).reshape(t.sizes()).clone();
    at += t.numel();
  }
  return out;
}

// How often the ranks agree on a stop (SIGTERM, SIGINT) at the latest, in
// seconds of steps or validation batches: well inside Slurm's KillWait of
// 30 s, and rare enough that the all-reduce costs nothing.
constexpr double kStopCheckSeconds = 2.0;

// One all-reduce of [a stop was asked on this rank, `seconds` of this
// rank]: whether any rank asked, and the ranks' mean seconds, the same on
// every rank (so every rank plans its next check alike).
std::pair<bool, double> stop_agreed_by_ranks(World& world, double seconds, const char* what) {
  auto t = torch::tensor({stop_requested() ? 1.0 : 0.0, seconds}, torch::kDouble).to(world.device());
  world.all_reduce(t, what);
  t = t.cpu();
  return {t[0].item<double>() > 0, t[1].item<double>() / world.size()};
}

// The random generators as they were before a validation (the CPU's, and
// the device's on CUDA), to put back: a validation_step that draws random
// numbers must not change training, nor a validation cut short by a stop
// what the resumed run's draws.
struct GeneratorsBeforeValidation {
  explicit GeneratorsBeforeValidation(const torch::Device& device)
      : cpu(at::detail::getDefaultCPUGenerator()), cpu_state(cpu.get_state()) {
    if (device.is_cuda()) {
      gpu = at::globalContext().defaultGenerator(device);
      gpu_state = gpu->get_state();
    }
  }
  void restore() {
    cpu.set_state(cpu_state);
    if (gpu) gpu->set_state(gpu_state);
  }
  at::Generator cpu;
  torch::Tensor cpu_state;
  std::optional<at::Generator> gpu;
  torch::Tensor gpu_state;
};

}  // namespace

TrainStepOptions train_step_options(const Config& c, const torch::Device& device) {
  const bool cuda = device.is_cuda();
  if (cuda) compat::set_cuda_math(c.tf32);
  use_nhwc_batchnorm_kernels(c.bn_kernel != "native");
  use_fused_batchnorm_relu(c.bn_kernel == "auto");
  use_fused_cross_entropy(c.ce_kernel != "native");
  use_one_pass_cross_entropy(c.ce_kernel == "auto");
  models::use_fused_layer_norm(c.ln_kernel == "auto");
  models::use_fused_linear(c.linear_kernel == "auto");
#ifdef DDP_WITH_CUDA_KERNELS
  cuda::set_side_stream(c.side_stream == "on"    ? cuda::SideStreamMode::kOn
                        : c.side_stream == "off" ? cuda::SideStreamMode::kOff
                                                 : cuda::SideStreamMode::kAuto);
#endif
  models::use_nhwc_max_pool_kernels(c.bn_kernel != "native");  // native: all ATen, for A/B timing
  return TrainStepOptions()
      .amp(c.amp)
      .cuda_graph(c.cuda_graph)
      .channels_last(c.channels_last == "on" || (c.channels_last == "auto" && cuda))
      .accum_steps(c.accum_steps)
      .clip_grad_norm(c.clip_grad_norm)
      .ema(c.ema)
      .bucket_cap_mb(c.bucket_cap_mb)
      .shard_optimizer(c.shard_optimizer)
      .shard_gradients(c.shard_gradients)
      .optimizer(FlatOptimizerOptions().name(c.optimizer).lr(c.lr).weight_decay(c.weight_decay).momentum(c.momentum))
      .loss(LossOptions().kind(c.loss).label_smoothing(c.label_smoothing));
}


std::function<void(const World&, int64_t)>& Trainer::after_step_hook() {
  static std::function<void(const World&, int64_t)> hook;
  return hook;
}

namespace {

// A run resumed with nothing left to train: all its epochs, or --patience
// ran out.
bool nothing_left_to_train(const Config& c, const TrainState& s) {
  return s.epoch >= c.epochs || (c.patience > 0 && s.patience_wait >= c.patience);
}

// The program that trained the run of `checkpoint`, from its run.json; ""
// when there is none (a bare checkpoint file).
std::string program_of_run(const std::string& checkpoint) {
  try {
    return nlohmann::json::parse(std::ifstream(run_dir_of(checkpoint) + "/run.json")).value("program", "");
  } catch (const std::exception&) {
    return "";
  }
}

// A run of another program is said first, as such: the checks after it
// (the data's first, or reading the data at all) would only say so
// obliquely, with hints that do not apply. Before the data is made, the
// kind of program: ddptrain's built-in tasks, or a program of the user's
// (whose name alone may change with its binary's); once the model is
// built, the model.
void check_resumed_program(const Config& c) {
  if (c.resume.empty() || !std::filesystem::is_regular_file(c.resume)) return;
  const std::string program = program_of_run(c.resume), builtin = ProgramInfo().name;
  if (program.empty() || (program == builtin) == (c.program.name == builtin)) return;
  throw UserError("checkpoint " + c.resume + " is of a run trained by " + program + " (model '" +
                      read_checkpoint_meta(c.resume).arch + "'), but this program is " + c.program.name + ".",
                  "resume it with " + program + ", or start a new run without --resume.");
}

void check_resumed_model(const CheckpointMeta& saved, const std::string& checkpoint, const std::string& arch) {
  if (saved.arch.empty() || saved.arch == arch) return;
  const std::string program = program_of_run(checkpoint);
  throw UserError("checkpoint " + checkpoint + " is for model '" + saved.arch + "', but this program builds '" + arch +
                      "'" + (program.empty() ? "" : "; the run was trained by " + program) + ".",
                  "resume it with the program (and --task) that trained it, or start a new run without --resume.");
}

}  // namespace

// The set-up order of every run, in one place.
Trainer::Trainer(Config config, World& world, Task& task)
    : config_(std::move(config)), world_(world), task_(task), monitor_(parse_monitor(config_.monitor, task.monitor())) {
  // 0. Every rank has rank 0's flags; then flags that only the task or the
  //    run's length can judge.
  check_flags_agree(config_, world_);
  if (config_.warmup_epochs > config_.epochs) {
    std::ostringstream w;
    w << config_.warmup_epochs;
    throw UserError("--warmup-epochs " + w.str() + " is longer than the run (--epochs " +
                        std::to_string(config_.epochs) + ").",
                    "warm up over part of the run, e.g. --warmup-epochs 1, or train for more --epochs.");
  }
  // 1. The task's data and model, on this rank's device.
  //    Validation (the task's, or --val-split's) chooses when there is one.
  check_resumed_program(config_);  // ddp::main put the file chosen to resume in --resume
  data_ = task_.make_data(config_, world_);
  check_user(data_.train && (data_.test || data_.val), "make_data() returned no train, or no test and no validation dataset.",
             "return both splits (a test split may be empty: data::Splits{train, empty}).");
  data_identity_ = data::data_identity(data_, {config_.data_root, config_.val_root});
  note_fewer_samples_than_asked();  // of the data as it came: --train-samples counts before the carve
  add_validation_split(data_, config_);
  choosing_ = data_.val ? kValPrefix : kTestPrefix;
  monitor_.metric = metric_for_split(monitor_.metric, choosing_);
  stop_rule_ = stop_rule_for_split(config_, choosing_);
  check_stop_rule();
  model_ = task_.make_model(config_, data_);
  check_user(model_ != nullptr, "make_model() returned no model.", "return your model's .ptr().");
  if (!config_.resume.empty() && std::filesystem::is_regular_file(config_.resume))
    check_resumed_model(read_checkpoint_meta(config_.resume), config_.resume, task_.arch());
  if (config_.convert_layers == "on") {
    const auto conversion = nn::convert_layers(*model_);
    if (conversion.converted() > 0 || (!conversion.kept.empty() && world_.device().is_cuda()))
      layers_line_ = conversion.summary();  // said once the run starts: a refused one says only why
  }
  check_flags_apply(config_, task_);
  augment_ = data::augment_applies(config_.augment, task_.uses_builtin_data(), data_);
  check_profile_trace_flag(config_);
  auto& model = *model_;
  model.to(world_.device());
  // 2. Initial weights: every rank reads onto its own device (never all
  //    onto GPU 0); GradSync then broadcasts rank 0's copy. A resumed run
  //    has its weights in the checkpoint (which went on from --pretrain's).
  const std::string resume_from = find_resume_checkpoint();
  if (!config_.pretrain.empty() && !resume_from.empty()) {
    DDP_PRINT0(world_, "pretrain: %s not loaded: the run resumes from %s, which holds its weights\n",
               config_.pretrain.c_str(), resume_from.c_str());
  } else if (!config_.pretrain.empty()) {
    auto report = load_pretrained(config_.pretrain, model, world_.device(), config_.pretrain_skip);
    DDP_PRINT0(world_, "pretrain: %s: %s\n", config_.pretrain.c_str(), report.summary().c_str());
  }
  // 3. SyncBatchNorm, before the step takes the parameters.
  const bool sync_bn = config_.sync_bn == "on" || (config_.sync_bn == "auto" && world_.size() > 1);
  if (sync_bn) convert_sync_batchnorm(model, world_);
  // 4. The optimizer and schedule the flags ask for, as the task adjusts
  //    them. A resumed run keeps its global batch on any number of ranks,
  //    and its schedule's length unless --reschedule.
  const CheckpointMeta saved = resume_from.empty() ? CheckpointMeta{} : read_checkpoint_meta(resume_from);
  if (!resume_from.empty()) check_same_data(saved, resume_from);  // first: other data fails the checks below too
  keep_global_batch(saved);
  // Streamed data (shards) cuts each epoch into a stream count fixed for the
  // run: saved with its flags, so a resumed run keeps its order.
  const auto* streamed = dynamic_cast<const data::StreamDataset*>(data_.train.get());
  if (streamed && config_.shard_streams == 0) config_.shard_streams = world_.size();
  const int64_t per_rank = streamed ? streamed->epoch_samples(config_.shard_streams, world_.size())
                                    : DistributedSampler({data_.train->size(), world_.size(), world_.rank()}).num_samples();
  const int64_t batches = (per_rank + config_.batch - 1) / config_.batch;
  steps_per_epoch_ = (batches + config_.accum_steps - 1) / config_.accum_steps;
  check_user(steps_per_epoch_ > 0, "the training set is empty.", "check --data_root and --train-samples.");
  OptimizerSetup setup{train_step_options(config_, world_.device()).optimizer(),
                       LrScheduleOptions()
                           .kind(config_.schedule)
                           .peak_lr(config_.lr)
                           .total_steps(steps_per_epoch_ * config_.epochs)
                           .warmup_steps(warmup_steps())};
  task_.configure_optimizer(config_, setup);
  if (!resume_from.empty()) check_schedule_length(saved, setup.schedule);
  // 5. The training step: gradient sync (which broadcasts rank 0's
  //    weights), the flat optimizer, precision, graph capture.
  step_ = std::make_unique<TrainStep>(task_, model, world_,
                                      train_step_options(config_, world_.device()).optimizer(setup.optimizer));
  schedule_ = std::make_unique<LrSchedule>(setup.schedule);
  if (step_->optimizer().options().shard_over()) {  // --shard-optimizer or --shard-gradients
    const auto& opt = step_->optimizer();
    const auto& sync = step_->sync();
    const char* gather = opt.shards() == 1                ? "none (one rank)"
                         : step_->waits_for_parameters_by_block() ? "in the background, waited for block by block in the next forward"
                                                                  : "in the background, waited for before the next forward";
    DDP_PRINT0(world_,
               "optimizer state: %.2f MiB on this rank, sharded over %d rank(s); %.2f MiB unsharded; gradients %s; "
               "parameter gather %s\n",
               static_cast<double>(opt.state_bytes()) / (1 << 20), opt.shards(),
               static_cast<double>(opt.unsharded_state_bytes()) / (1 << 20),
               describe(sync.options().reduction(), world_).c_str(), gather);
    if (config_.shard_gradients)
      DDP_PRINT0(world_, "gradients: %.2f MiB on this rank, sharded over %d rank(s), and up to 3 buckets of %.2f MiB in flight; %.2f MiB unsharded\n",
                 static_cast<double>(sync.gradient_bytes()) / (1 << 20), sync.gradient_storage_sharded() ? world_.size() : 1,
                 std::min(config_.bucket_cap_mb, static_cast<double>(sync.unsharded_gradient_bytes()) / (1 << 20)),
                 static_cast<double>(sync.unsharded_gradient_bytes()) / (1 << 20));
  }
  is_bar_ = world_.share_string("progress", resolve_progress_mode(config_.progress) == ProgressMode::kBar ? "bar" : "") == "bar";
  // 6. Resume, then the run directory: a resumed run continues in its
  //    checkpoint's directory, so that metrics.jsonl goes on; a fresh one
  //    gets a new directory. The checkpoint is read (and so checked) before
  //    anything is written.
  if (!resume_from.empty()) resume(resume_from);
  if (!resume_from.empty() && nothing_left_to_train(config_, state_)) {
    run_dir_ = run_dir_of(resume_from);  // nothing to train: fit() says so, and the run's files stay as they are
    return;
  }
  open_run_dir(resume_from);
}

struct Trainer::EpochFeed {
  data::Loader loader;
  data::DeviceFeeder feeder;  // declared after the loader it reads: destroyed first
  EpochFeed(data::DatasetPtr data, std::vector<int64_t> indices, data::LoaderOptions options, torch::Device device,
            data::DeviceFeeder::Prepare prepare, std::shared_ptr<data::DeviceStage> stage)
      : loader(std::move(data), std::move(indices), std::move(options)),
        feeder(loader, device, std::move(prepare), std::move(stage)) {}
};

Trainer::~Trainer() = default;

// ddp::main chose the file once for this process (choose_resume_checkpoint)
// and put it in --resume: for a restart, this job's own newest. Rank 0's
// choice is every rank's. (A Trainer built without ddp::main may still be
// given a run directory or auto, resolved here.)
std::string Trainer::find_resume_checkpoint() {
  std::string path = world_.share_string(
      "resume_path", world_.is_main() ? resume_checkpoint(config_.resume, config_.save_path) : "");
  if (restart_attempt() > 0 && path.empty()) {
    // A restart before the job's first checkpoint starts again in the run
    // directory the job made, if it made one.
    restart_dir_ = world_.share_string("restart_dir",
                                       world_.is_main() ? job_run_dir(config_.save_path, "", job_id()) : "");
    DDP_PRINT0(world_, "restart %d: this job saved no checkpoint yet; starting again%s%s\n", restart_attempt(),
               restart_dir_.empty() ? "" : " in ", restart_dir_.c_str());
  } else if (path.empty() && !config_.resume.empty()) {
    DDP_PRINT0(world_, "resume: no checkpoint under %s; starting fresh\n", config_.save_path.c_str());
  }
  return path;
}

// PyTorch's DistributedSampler deals rank r every world-size-th sample of
// one permutation, so the global batch at step s is the same samples on any
// number of ranks as long as its size is the same. A resumed run therefore
// keeps the global batch: a per-rank --batch follows the new world size.
void Trainer::keep_global_batch(const CheckpointMeta& saved) {
  if (saved.world_size <= 0 || !saved.config.contains("batch")) return;
  const int64_t ranks = world_.size(), global = saved.config["batch"].get<int64_t>() * saved.world_size;
  const std::string was = std::to_string(global) + " (--batch " + std::to_string(global / saved.world_size) + " x " +
                          std::to_string(saved.world_size) + " rank(s))";
  if (ranks != saved.world_size && !config_.was_given("batch")) {
    check_user(global % ranks == 0,
               "the run's global batch " + was + " does not split over " + std::to_string(ranks) + " ranks.",
               "resume on a number of ranks that divides " + std::to_string(global) + " (--size).");
    config_.batch = static_cast<int>(global / ranks);
    DDP_PRINT0(world_, "resume: %d rank(s) instead of %d; --batch %d per rank keeps the global batch %lld\n",
               world_.size(), saved.world_size, config_.batch, static_cast<long long>(global));
  }
  check_user(config_.batch * ranks == global,
             "--batch " + std::to_string(config_.batch) + " on " + std::to_string(ranks) + " rank(s) changes the run's global batch " + was + ".",
             "drop --batch: a resumed run sets the per-rank batch to keep the global one.");
}

// A resumed run may read its data from elsewhere (--data_root and --val-root
// may change), but not other data: the checkpoint's weights, optimizer and
// sampler position belong to the samples it trained on. Checked before
// anything is loaded or written. A checkpoint from before the record has
// none, and resumes unchecked as it always did.
void Trainer::check_same_data(const CheckpointMeta& saved, const std::string& checkpoint) const {
  const std::string difference = data::data_difference(saved.data, data_identity_);
  if (difference.empty()) return;
  auto saved_flag = [&](const char* key) {
    return saved.config.contains(key) && saved.config[key].is_string() ? saved.config[key].get<std::string>() : "";
  };
  const std::string root = saved_flag("data_root"), val_root = saved_flag("val-root");
  throw UserError("checkpoint " + checkpoint + " trained on other data than this run reads: " + difference + ".",
                  "pass the --data_root" + std::string(val_root.empty() ? "" : " and --val-root") +
                      " the run trained on (" + root + (val_root.empty() ? "" : ", " + val_root) +
                      ") or a copy of that data, or start a new run without --resume.");
}

// More (or fewer) --epochs stretch a schedule that depends on the run's
// length: the learning rate would jump at the resume point.
void Trainer::check_schedule_length(const CheckpointMeta& saved, const LrScheduleOptions& now) const {
  const int64_t saved_epochs = saved.config.value("epochs", static_cast<int64_t>(config_.epochs));
  if (saved_epochs == config_.epochs || now.kind() == "constant" || config_.reschedule) return;
  const auto before = LrScheduleOptions(now).total_steps(steps_per_epoch_ * saved_epochs);
  const int64_t s = saved.state.step;
  char what[256];
  std::snprintf(what, sizeof(what), "the learning rate at the resume point (step %lld) would jump from %.4g to %.4g",
                static_cast<long long>(s), LrSchedule(before).at(s), LrSchedule(now).at(s));
  throw UserError("--epochs " + std::to_string(config_.epochs) + " changes the length of the run's " + now.kind() +
                      " schedule (" + std::to_string(saved_epochs) + " epochs): " + what + ".",
                  "add --reschedule to accept that, or resume with --epochs " + std::to_string(saved_epochs) + ".");
}

void Trainer::open_run_dir(const std::string& resume_from) {
  std::string dir;
  if (!resume_from.empty()) {
    dir = run_dir_of(resume_from);
  } else if (!restart_dir_.empty()) {
    dir = restart_dir_;  // a restart before the job's first checkpoint
  } else if (world_.is_main()) {
    dir = make_run_dir(config_.save_path, "train_" + timestamp());
  }
  // Rank 0 holds the directory from here until the job ends: a second job
  // that would write in it (a resume of the same run) stops here, before
  // it writes anything.
  if (world_.is_main()) run_dir_lock_ = RunDirLock(dir);
  run_dir_ = world_.share_string("run_dir", dir);
  if (!resume_from.empty() && world_.is_main()) set_aside_abandoned_branch();
  if (world_.is_main()) remove_stale_temp_files(run_dir_);  // what a kill mid-write left
  // The directory is this job's now: a restart finds it by this id.
  if (const std::string id = job_id(); world_.is_main() && !id.empty()) {
    // The checkpoint a restart would resume: the one this attempt resumed
    // when the directory is already this job's (an earlier attempt's), else
    // none yet (not the checkpoints of the run that this job resumed).
    const bool restarted_here = read_job_record(run_dir_).id == id && !resume_from.empty();
    write_job_record(run_dir_, {id, restarted_here ? std::filesystem::path(resume_from).filename().string() : ""});
  }
  metrics_ = std::make_unique<MetricsLog>(world_.is_main() ? run_dir_ + "/metrics.jsonl" : "");
  if (!resume_from.empty()) metrics_->truncate_to(state_.epoch, state_.step);  // drop rows logged after the checkpoint
  else if (!restart_dir_.empty()) metrics_->truncate_to(0, 0);  // the failed attempt's rows
  if (world_.is_main()) {  // a resumed run's as it goes on (e.g. on another number of ranks)
    write_file_atomic(run_dir_ + "/config.json", config_to_json(job_config()).dump(2) + "\n");
    write_file_atomic(run_dir_ + "/config.toml", config_to_toml(job_config()));  // --config repeats the run
    write_run_card(run_dir_, {config_.program.name, task_.arch(), data_.train->name(), data_.train->size(),
                              data_.test->size(), monitor_.metric, monitor_.goal_name()});
  }
}

// A resume from an older checkpoint of the run directory (epoch 2 of 4)
// starts a new branch of the run, as Lightning's ckpt_path does: the later
// checkpoints are the work of the branch left, so they are moved aside, not
// pruned by --keep-last nor found by --resume (set_aside_later_checkpoints).
// best.pt goes with them when it is from past the resume point; the live
// branch's best then starts again, so that its best.pt is its own. Rank 0.
void Trainer::set_aside_abandoned_branch() {
  std::vector<std::string> unreadable;
  const std::string aside = set_aside_later_checkpoints(run_dir_, state_.step, state_.epoch, timestamp(), &unreadable);
  if (aside.empty()) return;
  if (!std::filesystem::exists(run_dir_ + "/best.pt")) state_.best = std::numeric_limits<double>::quiet_NaN();
  std::string names;
  for (const auto& name : unreadable) names += (names.empty() ? "" : ", ") + name;
  std::printf("resume: the checkpoints past step %lld (another branch of this run%s%s) moved to %s\n",
              static_cast<long long>(state_.step), names.empty() ? "" : "; unreadable, kept as they are: ",
              names.c_str(), aside.c_str());
  std::fflush(stdout);
}

void Trainer::resume(const std::string& path) {
  auto meta = load_checkpoint(path, *model_, step_.get(), world_.device(), task_.arch());
  state_ = meta.state;
  DDP_PRINT0(world_, "resume: %s (epoch %lld, step %lld)\n", path.c_str(), static_cast<long long>(state_.epoch),
             static_cast<long long>(state_.step));
}

void Trainer::print_start() const {
  if (!world_.is_main()) return;
  // One screen: the flags given, the world, the data, the run directory.
  // Every value, defaults included, is in config.toml.
  Config c = config_;
  std::string given;
  for (const auto& f : flag_table(c))
    if (c.was_given(f.key())) {
      std::ostringstream v;
      std::visit([&](auto* p) { v << std::boolalpha << *p; }, f.target);
      given += " --" + f.key() + " " + v.str();
    }
  std::printf("config:%s (all flags: %s/config.toml)\n", given.empty() ? " defaults" : given.c_str(), run_dir_.c_str());
  std::printf("world: %d rank(s), backend %s, device %s; data: %s (%lld train, %lld test)%s; model %s; run dir %s\n",
              world_.size(), world_.backend_name().c_str(), world_.device().str().c_str(), data_.train->name().c_str(),
              static_cast<long long>(data_.train->size()), static_cast<long long>(data_.test->size()),
              data_.synthetic ? " [SYNTHETIC data]" : "", task_.arch().c_str(), run_dir_.c_str());
  if (!layers_line_.empty()) std::printf("%s\n", layers_line_.c_str());
  std::fflush(stdout);
}

// --train-samples / --test-samples above what the data holds take all of
// it; said once, so that a typo or a wrong folder does not pass unnoticed.
void Trainer::note_fewer_samples_than_asked() const {
  auto note = [&](const char* flag, int64_t asked, const data::Dataset& d) {
    if (asked > d.size())
      DDP_PRINT0(world_, "note: %s %lld is more than the %lld samples of %s; all %lld are used.\n", flag,
                 static_cast<long long>(asked), static_cast<long long>(d.size()), d.name().c_str(),
                 static_cast<long long>(d.size()));
  };
  note("--train-samples", config_.train_samples, *data_.train);
  if (data_.test) note("--test-samples", config_.test_samples, *data_.test);
}

// The whole run: epochs of training and validation, logs and checkpoints.
EpochMetrics Trainer::fit() {
  // A finished run resumed (by a job script that always resumes, say):
  // nothing to train, no error, so that such a script ends cleanly, and no
  // file of the run written (Trainer::Trainer opened no run directory).
  if (state_.epoch >= config_.epochs) {
    DDP_PRINT0(world_,
               "resume: the run in %s already trained all its %d epoch(s); nothing to do. To train on, resume it with "
               "--epochs N (more than %d) --reschedule.\n",
               run_dir_.c_str(), config_.epochs, config_.epochs);
    return {};
  }
  if (nothing_left_to_train(config_, state_)) {  // --patience ran out
    DDP_PRINT0(world_,
               "resume: the run in %s stopped early after epoch %lld (--patience %d ran out); nothing to do. To "
               "train on, resume it with a larger --patience.\n",
               run_dir_.c_str(), static_cast<long long>(state_.epoch), config_.patience);
    return {};
  }
  set_stop_can_checkpoint(true);  // a stop signal now checkpoints (signals.h); before "world: " is printed
  print_start();
  print_choosing_split();
  sanity_validation();
  const auto started = Clock::now();
  EpochMetrics last;
  for (int64_t epoch = state_.epoch + 1; epoch <= config_.epochs; ++epoch) {
    auto t0 = Clock::now();
    int64_t samples = 0;
    Metrics logs;
    // ---- train one epoch (--profile-trace: the last one under Kineto, on rank 0) ----
    double train_loss = 0;
    if (!config_.profile_trace.empty() && epoch == config_.epochs && world_.is_main()) {
      compat::profile_chrome_trace([&] { train_loss = train_epoch(epoch, samples, logs); }, config_.profile_trace);
      std::printf("profile: epoch %lld's training steps in %s\n", static_cast<long long>(epoch),
                  config_.profile_trace.c_str());
    } else {
      train_loss = train_epoch(epoch, samples, logs);
    }
    const double train_seconds = seconds_since(t0);
    // ---- --skip-bad-samples: the samples every rank replaced, summed, and
    // those the scan left out (the same on every rank) ----
    int64_t skipped = -1, incomplete = 0;
    const auto* streamed = dynamic_cast<const data::StreamDataset*>(data_.train.get());
    if (streamed && config_.skip_bad_samples) {
      auto n = torch::tensor({static_cast<double>(streamed->skipped(epoch - 1))}, torch::kDouble).to(world_.device());
      world_.all_reduce(n, "skipped samples (--skip-bad-samples)");
      incomplete = streamed->left_out();
      skipped = static_cast<int64_t>(n.item<double>()) + incomplete;
    }
    // ---- a stop agreed at the epoch's last step saves it without waiting
    // for its validation; the resumed run validates it ----
    if (stop_after_epoch_) save_and_stop(run_dir_ + "/preempt.pt");
    // ---- the next epoch's first batches load (with GPU decoding, are
    // decoded) while this one validates and saves ----
    if (epoch < config_.epochs) {
      next_feed_ = make_feed(epoch + 1, 0);
      next_feed_epoch_ = epoch + 1;
      next_feed_->feeder.start();
    }
    // ---- validate (a stop agreed during it saves as above) ----
    GeneratorsBeforeValidation generators(world_.device());
    std::optional<Metrics> validated = evaluate(choosing_split(), choosing_, -1, true);
    if (validated && config_.test_every_epoch && data_.val) {
      std::optional<Metrics> tested = evaluate(data_.test, kTestPrefix, -1, true);
      if (tested) validated->insert(tested->begin(), tested->end());
      else validated.reset();
    }
    if (!validated) {
      generators.restore();
      save_and_stop(run_dir_ + "/preempt.pt");
    }
    Metrics metrics = std::move(*validated);
    for (const auto& [name, v] : logs) metrics[name] = v;
    EpochEnd end{epoch, state_.step, metrics};
    task_.on_epoch_end(end);
    warn_if_not_finite(epoch, metrics);
    // ---- log ----
    last = EpochMetrics();
    last.epoch = epoch;
    last.step = state_.step;
    last.train_loss = train_loss;
    last.values = metrics;
    last.monitor = monitor_.metric;
    last.goal = monitor_.goal_name();
    last.lr = schedule_->at(std::max<int64_t>(state_.step - 1, 0));
    last.epoch_seconds = seconds_since(t0);
    last.samples_per_second = static_cast<double>(samples) / std::max(train_seconds, 1e-9);
    state_.epoch = epoch;
    state_.batch_in_epoch = 0;
    state_.epoch_loss_sum = state_.epoch_loss_count = 0;
    metrics_->append(last);
    if (world_.is_main()) {
      std::string line = "epoch " + std::to_string(epoch) + "/" + std::to_string(config_.epochs) + "  " +
                         format_metric("train_loss", train_loss);
      for (const auto& [name, v] : metrics) line += "  " + format_metric(name, v);
      char tail[128];
      std::snprintf(tail, sizeof(tail), "  %.1f s  %.0f samples/s  data wait %.0f%%", last.epoch_seconds,
                    last.samples_per_second, 100 * data_wait_seconds_ / std::max(train_seconds, 1e-9));
      if (skipped >= 0)
        line += "  skipped " + std::to_string(skipped) + " bad sample(s)" +
                (incomplete > 0 ? " (" + std::to_string(incomplete) + " incomplete)" : "");
      std::printf("%s%s\n", line.c_str(), tail);
      std::fflush(stdout);
    }
    hint_if_data_bound(epoch, data_wait_seconds_ / std::max(train_seconds, 1e-9), samples);
    // ---- checkpoint, and stop if asked ----
    auto monitored = metrics.find(monitor_.metric);
    check_user(choosing_split()->size() == 0 || monitored != metrics.end(),
               (config_.monitor.empty() ? "the task's monitor metric '" : "--monitor's metric '") + monitor_.metric +
                   "' is not among the task's metrics (" +
                   [&] {
                     std::string s;
                     for (const auto& [name, v] : metrics) s += (s.empty() ? "" : ", ") + name;
                     return s;
                   }() + ").",
               config_.monitor.empty() ? "return it from validation_metrics(), or name one of these in monitor()."
                                       : "name one of these, e.g. --monitor " + metrics.begin()->first + ":min.");
    const double value = monitored == metrics.end() ? std::numeric_limits<double>::quiet_NaN() : monitored->second;
    // A --stop-at metric the task does not report is an error, after this
    // epoch's checkpoint is saved.
    bool reached = false;
    std::exception_ptr stop_error;
    try {
      reached = reached_stop_at(metrics);
    } catch (const UserError&) {
      stop_error = std::current_exception();
    }
    const bool out_of_patience = patience_run_out_on_rank_0(value);
    const bool periodic = epoch % config_.save_epoch == 0 || epoch == config_.epochs || reached || out_of_patience ||
                          stop_error;
    save(epoch, value, periodic);
    if (stop_error) {
      world_.barrier("checkpoint before stopping");  // rank 0 may still be writing it
      std::rethrow_exception(stop_error);
    }
    if (reached) {
      DDP_PRINT0(world_, "reached --stop-at at epoch %lld; stopping.\n", static_cast<long long>(epoch));
      break;
    }
    if (out_of_patience) {
      DDP_PRINT0(world_, "early stopping: %s has not improved by more than %g for %d validation(s) (best %s); "
                 "stopping after epoch %lld.\n", monitor_.metric.c_str(), config_.min_delta, config_.patience,
                 format_value(monitor_.metric, state_.patience_best).c_str(), static_cast<long long>(epoch));
      break;
    }
    // A stop that came during the epoch's end (its saves, most likely) stops
    // here, not after one more step and a second save: with this epoch's
    // checkpoint, written now if the epoch was not one to save.
    if (epoch < config_.epochs && stop_agreed_by_ranks(world_, 0, "stop check after the epoch's checkpoint").first) {
      if (!periodic) save(epoch, value, true);
      world_.barrier("checkpoint before stopping");  // rank 0 may still be writing it
      throw Preempted("stopped by a signal after epoch " + std::to_string(epoch) + "; checkpoint saved in " + run_dir_ +
                      ". Resume: " + command("--resume " + run_dir_ + placement_flags()));
    }
  }
  next_feed_.reset();  // after a --stop-at stop
  world_.barrier("end of training");
  test_best();
  print_summary(last, seconds_since(started));
  return last;
}

// A CPU run that will clearly take long (e.g. 224-px images or a ResNet-50
// on two cores) says so once, early, with the flags that would help,
// instead of leaving the user to watch a slow bar.
void Trainer::hint_if_slow(int64_t batches_done, int64_t batches_per_epoch, double seconds) {
  constexpr double kMeasureSeconds = 10, kLongEpochSeconds = 15 * 60;
  if (seconds < kMeasureSeconds || batches_done < 2) return;
  hinted_slow_ = true;
  const double per_batch = seconds / static_cast<double>(batches_done);
  const double epoch_seconds = per_batch * static_cast<double>(batches_per_epoch);
  if (epoch_seconds < kLongEpochSeconds || !world_.is_main()) return;
  std::string faster;
  if (config_.dataset == "imagefolder" && (config_.image_size == 0 || config_.image_size > 64))
    faster += "--image-size 64 (now " + std::to_string(config_.image_size > 0 ? config_.image_size : 224) + "), ";
  const auto ignored = task_.ignored_flags();
  if (config_.model != "cnn" && std::find(ignored.begin(), ignored.end(), "model") == ignored.end())
    faster += "--model cnn (now " + config_.model + "), ";
  const int64_t minute_of_batches = std::max<int64_t>(1, static_cast<int64_t>(60 / per_batch));
  if (config_.dataset == "imagefolder")  // it takes every file: a smaller folder is the subset
    faster += "a folder of about " + std::to_string(minute_of_batches * config_.batch * world_.size()) +
              " images for a one-minute trial epoch, or a GPU";
  else
    faster += "--train-samples " + std::to_string(minute_of_batches * config_.batch * world_.size()) +
              " for a one-minute trial epoch, or a GPU";
  std::printf("\nhint: on this CPU an epoch takes about %.0f min (%.2f s per batch, %lld batches per rank); "
              "faster: %s.\n",
              epoch_seconds / 60, per_batch, static_cast<long long>(batches_per_epoch), faster.c_str());
  std::fflush(stdout);
}

// An epoch whose step waited for data a good part of the time says so,
// once per job (as Lightning warns about too few DataLoader workers), with
// what would feed the step faster: more loader threads while this rank's
// share of the node's cores allows, else (GPU decoding) a share of the
// decoding for nvJPEG, else a cheaper data path.
void Trainer::hint_if_data_bound(int64_t epoch, double wait_share, int64_t samples) {
  constexpr double kDataBound = 0.3;
  constexpr int64_t kMinBatches = 8;  // fewer: the first batch's latency is most of the wait
  if (hinted_data_ || !world_.is_main() || wait_share < kDataBound ||
      samples < kMinBatches * config_.batch * world_.size())
    return;
  hinted_data_ = true;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int ranks = std::max(1, world_.placement().local_world_size);
  const int per_rank = std::max(1, cores / ranks);
  const bool gpu_decode = (config_.dataset == "imagefolder" || config_.dataset == "shards") && world_.device().is_cuda() &&
                          data::gpu_decode_chosen(config_.image_decode, world_.device());
  char faster[256];
  if (config_.workers + 1 < per_rank)
    std::snprintf(faster, sizeof faster, "--workers %d (now %lld; %d cores for %d rank(s) on this node)", per_rank - 1,
                  static_cast<long long>(config_.workers), cores, ranks);
  else if (gpu_decode && config_.cpu_decode_share > 0)
    std::snprintf(faster, sizeof faster, "--cpu-decode-share %.2g (now %.2g), so that nvJPEG decodes the rest on the GPU",
                  config_.cpu_decode_share / 2, config_.cpu_decode_share);
  else
    std::snprintf(faster, sizeof faster, "data that costs less per sample (smaller files, or decoded ahead), or fewer "
                  "ranks per node");
  std::printf("hint: the training step waited for data %.0f%% of epoch %lld; faster: %s.\n", 100 * wait_share,
              static_cast<long long>(epoch), faster);
  std::fflush(stdout);
}

// Epoch `epoch`'s batches from `start_batch` on, as a function of (seed,
// epoch, rank): the sampler's order and the loader's keyed draws.
std::unique_ptr<Trainer::EpochFeed> Trainer::make_feed(int64_t epoch, int64_t start_batch) {
  std::vector<int64_t> indices;
  if (const auto* streamed = dynamic_cast<const data::StreamDataset*>(data_.train.get())) {
    indices = streamed->epoch_order(data::StreamOrderOptions()
                                        .seed(static_cast<uint64_t>(config_.seed))
                                        .epoch(epoch - 1)
                                        .streams(config_.shard_streams)
                                        .shuffle_buffer(config_.shuffle_buffer)
                                        .rank(world_.rank())
                                        .world(world_.size())
                                        .next_epoch_follows(epoch < config_.epochs),
                                    start_batch * config_.batch);
  } else {
    DistributedSampler sampler({data_.train->size(), world_.size(), world_.rank(), true,
                                static_cast<uint64_t>(config_.seed), false});
    sampler.set_epoch(epoch - 1);  // the order changes every epoch
    indices = sampler.indices();
  }
  auto loader_options = data::LoaderOptions(config_.batch)
                            .workers(config_.workers)
                            .prefetch(std::max(2, 2 * config_.workers))
                            .pin_memory(world_.device().is_cuda())
                            .seed(static_cast<uint64_t>(config_.seed))
                            .epoch(epoch - 1)
                            .rank(world_.rank())
                            .start_batch(start_batch);
  if (augment_) loader_options.transform(data::make_augment(data::AugmentOptions()));
  return std::make_unique<EpochFeed>(data_.train, std::move(indices), loader_options, world_.device(),
                                     [this](const torch::Tensor& t) { return step_->prepare(t); },
                                     data_.train->device_stage());
}

double Trainer::train_epoch(int64_t epoch, int64_t& samples_seen, Metrics& logs) {
  auto& model = *model_;
  model.train();
  // The next epoch's batches started loading during the last validation.
  std::unique_ptr<EpochFeed> feed = next_feed_ && next_feed_epoch_ == epoch && state_.batch_in_epoch == 0
                                        ? std::move(next_feed_)
                                        : make_feed(epoch, state_.batch_in_epoch);
  next_feed_.reset();
  data::Loader& loader = feed->loader;
  data::DeviceFeeder& feeder = feed->feeder;
  const int64_t micro_batches = loader.num_batches();
  const int64_t display_every = is_bar_ ? std::max(1, config_.log_every / 10) : config_.log_every;
  Progress progress(world_.is_main() ? resolve_progress_mode(is_bar_ ? "bar" : config_.progress) : ProgressMode::kNone,
                    static_cast<int>(epoch), config_.epochs, micro_batches);
  const auto dev = world_.device();
  // Running sums stay on the device: no host sync per step. [loss sum,
  // loss count, stop flag, seconds, then one sum per logged name]; a resumed
  // epoch starts from the saved global sums (held by rank 0 alone, so the
  // all-reduce counts them once). The stop flag and the seconds are filled
  // in for each all-reduce.
  constexpr int64_t kStop = 2, kSeconds = 3, kFirstLog = 4;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(dev);
  // The saved logs' names fix their order on every rank (each loaded the same checkpoint).
  if (log_names_.empty())
    for (const auto& [name, sum] : state_.epoch_log_sums) log_names_.push_back(name);
  auto sums = torch::zeros({kFirstLog + static_cast<int64_t>(log_names_.size())}, f64);
  if (state_.batch_in_epoch > 0 && world_.is_main()) {
    sums[0] = state_.epoch_loss_sum;
    sums[1] = state_.epoch_loss_count;
    for (size_t i = 0; i < log_names_.size(); ++i) {
      auto it = state_.epoch_log_sums.find(log_names_[i]);
      if (it != state_.epoch_log_sums.end()) sums[kFirstLog + static_cast<int64_t>(i)] = it->second;
    }
  }
  int64_t micro = state_.batch_in_epoch;
  const int64_t first_micro = micro;
  state_.batch_in_epoch = 0;
  state_.epoch_loss_sum = state_.epoch_loss_count = 0;
  state_.epoch_log_sums.clear();
  auto t0 = Clock::now();
  double lr = schedule_->at(state_.step);
  const int accum = config_.accum_steps;
  // A stop (SIGTERM, SIGINT) is agreed on at the loss all-reduces, which
  // every rank makes at the same micro-batches. Display points alone may be
  // minutes apart (--log-every 50 of 3-s steps), past Slurm's KillWait of
  // 30 s: so there is one more at the first micro-batch, and then every
  // micro-batches that take about kStopCheckSeconds, by the time the last
  // all-reduce measured (the same number on every rank).
  int64_t next_stop_check = micro + 1;
  bool stop_agreed = false;
  int64_t samples_before_step = samples_seen;

  while (auto batch = feeder.next()) {
    // Gradient accumulation: each optimizer step averages the micro-batches
    // of its group; the epoch's last group may be smaller, and is averaged
    // over its own size.
    const int64_t group_start = micro - micro % accum;
    const int64_t group_size = std::min<int64_t>(accum, micro_batches - group_start);
    const bool last_micro = micro + 1 == group_start + group_size;
    if (last_micro) lr = schedule_->at(state_.step);
    // ---- one micro-step (the task's forward and loss, backward; on the
    // last micro-batch also all-reduce, clip and the optimizer step), no
    // host sync ----
    auto out = step_->run(*batch, last_micro, lr, 1.0 / static_cast<double>(group_size));
    if (log_names_.empty() && !out.logs.empty()) {
      for (const auto& [name, t] : out.logs) log_names_.push_back(name);
      sums = torch::cat({sums, torch::zeros({static_cast<int64_t>(log_names_.size())}, f64)});
    }
    sums[0] += out.loss.to(torch::kDouble);
    sums[1] += 1;
    for (size_t i = 0; i < log_names_.size(); ++i) {
      auto it = out.logs.find(log_names_[i]);
      if (it != out.logs.end()) sums[kFirstLog + static_cast<int64_t>(i)] += it->second.to(torch::kDouble);
    }
    ++micro;
    samples_seen += batch->batch_size() * world_.size();
    if (!dev.is_cuda() && !std::isfinite(out.loss.item<double>()))
      throw NonFiniteLoss(epoch, state_.step, out.loss.item<double>(), run_dir_);
    if (last_micro) {
      ++state_.step;
      // --shard-optimizer: the step's parameter gather may be in flight, and
      // a hook may read the weights (an EMA of its own, say): it waits,
      // unless the next forward waits block by block (ddptrain's GPT under
      // ddptrain's LmTask, whose hook reads none).
      if (!step_->waits_for_parameters_by_block()) step_->wait_for_parameters();
      task_.on_step_end(StepEnd{state_.step, epoch, lr, samples_seen - samples_before_step});
      samples_before_step = samples_seen;
      if (after_step_hook()) after_step_hook()(world_, state_.step);
    }
    const bool log_point = micro % config_.log_every == 0 || micro == micro_batches;
    const bool display_point = micro % display_every == 0 || log_point;
    torch::Tensor mean;  // the sums over all ranks, where they were reduced
    auto reduce = [&](const char* what) {
      mean = sums.clone();
      mean[kStop] = stop_requested() ? 1.0 : 0.0;
      mean[kSeconds] = seconds_since(t0);
      world_.all_reduce(mean, what);
      if (mean[kStop].item<double>() > 0) stop_agreed = true;
      const double per_micro = mean[kSeconds].item<double>() / world_.size() / static_cast<double>(micro - first_micro);
      next_stop_check =
          micro + std::clamp<int64_t>(std::llround(kStopCheckSeconds / std::max(per_micro, 1e-9)), 1, display_every);
    };
    if (display_point) {
      reduce("train loss");
      const double avg = mean[0].item<double>() / std::max(1.0, mean[1].item<double>());
      if (!std::isfinite(avg)) throw NonFiniteLoss(epoch, state_.step, avg, run_dir_);
      const double samples_per_second = static_cast<double>(samples_seen) / std::max(seconds_since(t0), 1e-9);
      progress.update(micro, avg, lr, samples_per_second);
      if (!dev.is_cuda() && !hinted_slow_) hint_if_slow(micro - first_micro, micro_batches, seconds_since(t0));
      if (log_point) metrics_->log_step({state_.step, epoch, avg, lr, samples_per_second});
    } else if (micro >= next_stop_check && !stop_agreed) {
      reduce("stop check");
    }
    // Every rank agreed at the same micro-batch, so every rank stops at the
    // same optimizer step: the first that ends at or after it.
    if (stop_agreed && last_micro) {
      if (micro < micro_batches) {
        if (!mean.defined()) reduce("train loss at the stop");  // the sums now, for the resumed epoch's mean
        progress.close();
        state_.batch_in_epoch = micro;
        state_.epoch_loss_sum = mean[0].item<double>();
        state_.epoch_loss_count = mean[1].item<double>();
        for (size_t i = 0; i < log_names_.size(); ++i)
          state_.epoch_log_sums[log_names_[i]] = mean[kFirstLog + static_cast<int64_t>(i)].item<double>();
        state_.epoch = epoch - 1;
        save_and_stop(run_dir_ + "/preempt.pt");
      }
      stop_after_epoch_ = true;
    }
  }
  progress.close();
  data_wait_seconds_ = feeder.wait_seconds();
  auto total = sums.clone();
  world_.all_reduce(total, "epoch train loss");
  const double count = std::max(1.0, total[1].item<double>());
  // Until this epoch is validated, the point to resume from is its end:
  // all its batches trained, its loss sums kept (a stop agreed during
  // validation saves this; fit() moves on to the next epoch's start).
  state_.batch_in_epoch = micro_batches;
  state_.epoch_loss_sum = total[0].item<double>();
  state_.epoch_loss_count = total[1].item<double>();
  for (size_t i = 0; i < log_names_.size(); ++i)
    logs[log_names_[i]] = total[kFirstLog + static_cast<int64_t>(i)].item<double>() / count;
  return total[0].item<double>() / count;
}

// A validation metric that is NaN or infinite while the training loss is
// finite (training stops on a non-finite loss) is said once, with where it
// comes from: a parameter or buffer of the model that holds non-finite
// values (batch norm's running statistics, most often), or the task's own
// arithmetic. best.pt never follows a NaN monitor (Monitor::better).
void Trainer::warn_if_not_finite(int64_t epoch, const Metrics& metrics) {
  if (warned_not_finite_) return;
  std::string bad;
  for (const auto& [name, v] : metrics)
    if (!std::isfinite(v)) bad += (bad.empty() ? "" : ", ") + format_metric(name, v);
  if (bad.empty()) return;
  warned_not_finite_ = true;
  std::string where;
  for (const auto& p : model_->named_parameters())
    if (!torch::isfinite(p.value()).all().item<bool>()) {
      where = "parameter '" + p.key() + "'";
      break;
    }
  if (where.empty())
    for (const auto& b : model_->named_buffers())
      if (b.value().is_floating_point() && !torch::isfinite(b.value()).all().item<bool>()) {
        where = "buffer '" + b.key() + "'";
        break;
      }
  if (!world_.is_main()) return;
  if (!where.empty())
    std::fprintf(stderr,
                 "%s: warning: epoch %lld's validation gave %s: the model's %s holds NaN or infinite values "
                 "(evaluated as rank 0 holds it). Hint: batch norm's running statistics go bad on a batch of bad "
                 "inputs or at too high a learning rate; check the data and --lr.\n",
                 config_.program.name.c_str(), static_cast<long long>(epoch), bad.c_str(), where.c_str());
  else
    std::fprintf(stderr,
                 "%s: warning: epoch %lld's validation gave %s, but the model's parameters and buffers are "
                 "all finite. Hint: the task's validation_step() or validation_metrics() made it (a division by a "
                 "zero count, the log of 0?).\n",
                 config_.program.name.c_str(), static_cast<long long>(epoch), bad.c_str());
}

std::optional<Metrics> Trainer::evaluate(const data::DatasetPtr& test, const std::string& prefix, int64_t max_batches,
                                         bool stoppable, bool average) {
  if (test->size() == 0) return Metrics{};
  const std::string split = prefix == kValPrefix ? "validation" : "test";
  check_user(test->size() >= world_.size(), "the " + split + " set has " + std::to_string(test->size()) +
                                                " samples, fewer than the " + std::to_string(world_.size()) + " ranks.",
             prefix == kValPrefix ? "raise --val-split, or use fewer ranks." : "use a larger test set (--test-samples) or fewer ranks.");
  auto& model = *model_;
  step_->wait_for_parameters();  // --shard-optimizer: the last step's gather, done
  // Every rank evaluates rank 0's model (buffers included), the one best.pt keeps.
  step_->sync().broadcast_buffers();
  const auto averaged = average ? step_->averaged_weights() : nullptr;  // --ema: validation judges the average
  model.eval();
  torch::NoGradGuard no_grad;
  // Each test sample is seen by exactly one rank: no padding duplicates.
  data::Loader loader(test, shard_without_padding(test->size(), world_.rank(), world_.size()),
                      data::LoaderOptions(config_.batch * 2).workers(config_.workers).pin_memory(world_.device().is_cuda()));
  const auto dev = world_.device();
  Totals totals;
  const auto stage = test->device_stage();
  // `stoppable`: a stop signal is agreed on here too, as between training
  // steps, or a long validation (a large test split, a slow model) holds it
  // past the scheduler's kill grace. Checks come after the first batch and
  // then every kStopCheckSeconds of batches, at batch counts that every rank
  // reaches (shards differ by one sample at most); nullopt: stop, on every
  // rank alike.
  const int64_t eval_batch = config_.batch * 2;
  int64_t checkable = (test->size() / world_.size() + eval_batch - 1) / eval_batch;
  if (max_batches >= 0) checkable = std::min(checkable, max_batches);
  int64_t next_check = stoppable ? 1 : checkable + 1;
  const auto started = Clock::now();
  for (int64_t b = 0; max_batches < 0 || b < max_batches; ++b) {
    auto batch = loader.next();
    if (!batch) break;
    if (stage) stage->run(*batch, dev);
    for (auto& [name, t] : *batch) t = t.to(dev, true);
    if (batch->contains("input")) batch->input() = step_->prepare(batch->input());
    TensorMap sums;
    {
      auto amp = step_->autocast(dev.type());
      sums = task_.validation_step(*batch);
    }
    for (auto& [name, s] : sums) {
      auto d = s.detach().to(dev, torch::kDouble);  // a count made on the CPU joins the rest
      auto it = totals.find(name);
      if (it == totals.end()) totals.emplace(name, d.clone());
      else it->second += d;
    }
    const int64_t done = b + 1;
    if (done == next_check && done <= checkable) {
      const auto [stop, seconds] = stop_agreed_by_ranks(world_, seconds_since(started), "stop check during validation");
      if (stop) return std::nullopt;
      const double per_batch = seconds / static_cast<double>(done);
      next_check = done + std::clamp<int64_t>(std::llround(kStopCheckSeconds / std::max(per_batch, 1e-9)), 1, checkable);
    }
  }
  return with_split_prefix(task_.validation_metrics(reduce_totals(world_, totals, dev)), prefix);
}

// --stop-at NAME=V reaches V in the monitor's direction, so a plain '='
// is for the monitor only: another metric's direction is not known.
void Trainer::check_stop_rule() const {
  const StopRule& rule = stop_rule_;
  if (rule.empty()) return;
  check_user(rule.way != StopRule::Way::kMonitors || rule.metric == monitor_.metric,
             "--stop-at " + rule.str() + " gives no direction, and " + rule.metric + " is not the task's monitor (" +
                 monitor_.metric + ", where " + (monitor_.goal == Goal::kMax ? "higher" : "lower") + " is better).",
             "say which way: --stop-at " + rule.metric + "<=" + rule.value_text + " or --stop-at " + rule.metric +
                 ">=" + rule.value_text + ".");
}

// Warm-up in steps: at least one when asked for (a fraction of an epoch
// shorter than a step would otherwise round to none, and onecycle would
// fall back to its 30% rise).
int64_t Trainer::warmup_steps() const {
  const int64_t steps = std::llround(config_.warmup_epochs * static_cast<double>(steps_per_epoch_));
  return config_.warmup_epochs > 0 ? std::max<int64_t>(1, steps) : steps;
}

// A few validation batches before training (--sanity-val-steps), as
// Lightning runs them: a validation_step() that fails, or a --stop-at metric
// that validation does not report, shows now rather than after an epoch.
// The metric may still come from a training log or on_epoch_end(), so an
// unknown name is a warning here; after the first epoch it is an error.
void Trainer::sanity_validation() {
  if (config_.sanity_val_steps == 0 || choosing_split()->size() == 0) return;
  // As Lightning, the generators are put back afterwards: a validation_step
  // that draws random numbers must not change training.
  GeneratorsBeforeValidation generators(world_.device());
  const std::optional<Metrics> validated = evaluate(choosing_split(), choosing_, config_.sanity_val_steps, true);
  generators.restore();
  if (!validated) save_and_stop(run_dir_ + "/preempt.pt");  // the run as it starts (or resumed)
  const Metrics& metrics = *validated;
  const std::string& name = stop_rule_.metric;
  if (name.empty() || metrics.count(name)) return;
  std::string names;
  for (const auto& [n, v] : metrics) names += (names.empty() ? "" : ", ") + n;
  if (world_.is_main())
    std::fprintf(stderr,
                 "%s: warning: --stop-at names '%s', which validation does not report (it reports %s); unless a "
                 "training log or on_epoch_end() adds it, the run stops with an error after epoch 1. Hint: e.g. "
                 "--stop-at %s=VALUE.\n",
                 config_.program.name.c_str(), name.c_str(), names.c_str(), monitor_.metric.c_str());
}

bool Trainer::reached_stop_at(const Metrics& metrics) const {
  if (stop_rule_.empty()) return false;
  const std::string& name = stop_rule_.metric;
  auto it = metrics.find(name);
  if (it == metrics.end()) {
    std::string names;
    for (const auto& [n, v] : metrics) names += (names.empty() ? "" : ", ") + n;
    throw UserError("--stop-at names '" + name + "', which this task does not report (it reports " + names + ").",
                    "use one of those names, e.g. --stop-at " + monitor_.metric + "=VALUE.");
  }
  return stop_rule_.reached(it->second, monitor_.goal == Goal::kMax);
}

void Trainer::save_and_stop(const std::string& path) {
  step_->gather_optimizer_state();
  if (world_.is_main()) save_job_checkpoint(path);
  world_.barrier("checkpoint before stopping");
  throw Preempted("stopped by a signal at step " + std::to_string(state_.step) + "; checkpoint saved to " + path +
                  ". Resume: " + command("--resume " + run_dir_ + placement_flags()));
}

// The flags that describe the job, without those of this one invocation
// (--resume, --reschedule, --inject-fault): what config.toml and
// checkpoints keep.
Config Trainer::job_config() const {
  Config c = with_absolute_paths(config_);  // a run resumed from another directory finds its files
  c.resume.clear();
  c.reschedule = false;
  c.inject_fault.clear();
  return c;
}

CheckpointMeta Trainer::meta() const {
  CheckpointMeta m{state_, task_.arch(), config_to_json(job_config())};
  m.world_size = world_.size();
  m.data = data_identity_;
  return m;
}

// A command line that reruns this program: its path as started (the
// launcher starts ranks by absolute path), then `args`.
std::string Trainer::command(const std::string& args) const {
  return relaunch_command(program_invocation_name, args, world_.placement());
}

// The flags that place this job as ddptrain's launcher started it: a
// checkpoint never restores them (OnResume::kNotRestored), so the printed
// resume command repeats them. Under torchrun, Slurm or mpirun that
// launcher places the ranks again.
std::string Trainer::placement_flags() const {
  const Placement& where = world_.placement();
  if (where.source != "ddptrain") return "";
  std::string out;
  if (where.local_world_size > 1) out += " --size " + std::to_string(where.local_world_size);
  if (!config_.visible.empty()) out += " --visible " + config_.visible;
  if (config_.nnodes > 1)
    out += " --nnodes " + std::to_string(config_.nnodes) + " --node-rank " + std::to_string(config_.node_rank) +
           " --address " + config_.address + " --port " + std::to_string(config_.port);
  if (config_.max_restarts > 0) out += " --max-restarts " + std::to_string(config_.max_restarts);
  return out;
}

// best.pt follows the monitor at every validation (as Lightning's
// ModelCheckpoint does); epoch_N.pt is written at the save epochs.
void Trainer::save(int64_t epoch, double monitored, bool periodic) {
  step_->gather_optimizer_state();  // every rank: a sharded state is gathered whole
  if (!world_.is_main()) return;
  CheckpointMeta meta = this->meta();
  if (monitor_.better(monitored, state_.best)) {
    state_.best = monitored;
    meta.state = state_;
    save_checkpoint(run_dir_ + "/best.pt", *model_, step_.get(), meta);
    if (!periodic) std::printf("saved %s/best.pt (%s)\n", run_dir_.c_str(), format_metric(monitor_.metric, monitored).c_str());
  }
  save_top_k(epoch, monitored);
  if (!periodic) return;
  const std::string path = run_dir_ + "/epoch_" + std::to_string(epoch) + ".pt";
  save_job_checkpoint(path);
  std::printf("saved %s\n", path.c_str());
  remove_superseded_preempt(run_dir_, state_.step);
  if (config_.keep_last > 0) remove_old_checkpoints(run_dir_, config_.keep_last, epoch);
}

// --patience, decided by rank 0 (early_stopping.h says why) and shared in one
// all-reduce that every rank makes while --patience is on.
bool Trainer::patience_run_out_on_rank_0(double monitored) {
  if (config_.patience == 0) return false;
  const bool run_out = patience_run_out(monitor_, monitored, config_.min_delta, config_.patience, state_);
  auto decision = torch::full({1}, world_.is_main() && run_out ? 1.0 : 0.0,
                              torch::TensorOptions().dtype(torch::kDouble).device(world_.device()));
  world_.all_reduce(decision, "early stopping (--patience)");
  return decision.item<double>() > 0;
}

// --save-top-k: this validation's checkpoint, if it is among the best K of
// the run directory, then the one it pushed out removed. Rank 0.
void Trainer::save_top_k(int64_t epoch, double monitored) {
  if (config_.save_top_k == 0 || !enters_top_k(run_dir_, monitor_, config_.save_top_k, monitored)) return;
  CheckpointMeta meta = this->meta();
  meta.state.monitored = monitored;
  const std::string path = run_dir_ + "/" + top_k_name(epoch, monitor_.metric, monitored);
  save_checkpoint(path, *model_, step_.get(), meta);
  prune_top_k(run_dir_, monitor_, config_.save_top_k);
  std::printf("saved %s (top %d)\n", path.c_str(), config_.save_top_k);
}

// Saves a checkpoint to resume from (epoch_N.pt, preempt.pt) and records
// it as this job's newest, for a restart (find_resume_checkpoint). Rank 0.
void Trainer::save_job_checkpoint(const std::string& path) {
  save_checkpoint(path, *model_, step_.get(), meta());
  if (const std::string id = job_id(); !id.empty())
    write_job_record(run_dir_, {id, std::filesystem::path(path).filename().string()});
}

void Trainer::print_summary(const EpochMetrics& last, double seconds) const {
  if (!world_.is_main()) return;
  // The end of a run on one screen: what it reached, where it is, and the
  // commands that come next.
  std::printf("\n");
  if (world_.device().is_cuda())
    std::printf("peak GPU memory %.0f MiB (rank 0)\n",
                static_cast<double>(compat::peak_cuda_bytes(world_.device().index())) / (1024.0 * 1024.0));
  const double final_value = last.value(monitor_.metric);
  std::printf("done: %lld epoch(s) in %.1f s%s; %s final %s, best %s (%s is better)\n",
              static_cast<long long>(last.epoch), seconds, data_.synthetic ? " on SYNTHETIC data" : "",
              monitor_.metric.c_str(), format_value(monitor_.metric, final_value).c_str(),
              format_value(monitor_.metric, state_.best).c_str(),
              monitor_.goal == Goal::kMax ? "higher" : "lower");
  std::printf("run dir:  %s (best.pt, epoch_*.pt, metrics.jsonl, metrics.csv, curves.svg, config.toml)\n", run_dir_.c_str());
  std::printf("resume:   %s\n", command("--resume " + run_dir_ + placement_flags()).c_str());
  // export and report need no ranks: the program alone, under no launcher.
  const std::string program = program_invocation_name;
  std::printf("export:   %s export %s/best.pt weights.pt\n", program.c_str(), run_dir_.c_str());
  std::printf("view:     %s report %s; tensorboard --logdir %s\n", program.c_str(), run_dir_.c_str(), run_dir_.c_str());
  std::fflush(stdout);
}

// Which split chooses best.pt, the monitor and --stop-at, said at the
// start: with none, test chooses, and its numbers are no unbiased estimate.
void Trainer::print_choosing_split() const {
  if (!world_.is_main()) return;
  if (data_.val)
    std::printf("choosing on: validation, %s (%lld samples): %s, best.pt%s; test (%lld samples) on best.pt at the end%s\n",
                data_.val->name().c_str(), static_cast<long long>(data_.val->size()), monitor_.metric.c_str(),
                stop_rule_.empty() ? "" : (", --stop-at " + stop_rule_.str()).c_str(),
                static_cast<long long>(data_.test->size()), config_.test_every_epoch ? " and every epoch" : "");
  else
    std::printf("choosing on: test (no validation split): %s, best.pt%s. Hint: --val-split 0.1 holds out 10%% of the "
                "training set to choose on, and keeps test for reporting.\n",
                monitor_.metric.c_str(), stop_rule_.empty() ? "" : (", --stop-at " + stop_rule_.str()).c_str());
  std::fflush(stdout);
}

// With a validation split, test reports what best.pt (chosen on validation)
// does on data that chose nothing: printed apart from the epochs, and kept
// in the run directory's test.json. Rank 0 reads best.pt (the other ranks
// may not see its disk) and hands its weights to the others.
void Trainer::test_best() {
  if (!data_.val || data_.test->size() == 0) return;
  const std::string best = run_dir_ + "/best.pt";
  int64_t best_epoch = 0;
  if (world_.is_main() && std::filesystem::exists(best)) best_epoch = read_checkpoint_meta(best).state.epoch;
  best_epoch = std::stoll(world_.share_string("best_epoch", std::to_string(best_epoch)));
  step_->wait_for_parameters();  // before best.pt's weights are written over them
  if (best_epoch > 0) {
    // The parameters are views of the flat buffers: one broadcast per
    // buffer (evaluate() broadcasts the model's buffers), and the bf16
    // copies cast again, since a collective moves no version counter.
    if (world_.is_main()) load_model_weights(best, *model_, world_.device());
    torch::NoGradGuard no_grad;
    auto& sync = step_->sync();
    for (auto flat : sync.flat_params()) world_.broadcast(flat, 0, "best.pt's weights");
    sync.bf16_copies_stale();
  }
  // best.pt's weights as loaded: with --ema, its average already.
  const Metrics metrics = *evaluate(data_.test, kTestPrefix, -1, false, /*average=*/best_epoch == 0);
  if (!world_.is_main()) return;
  std::string line = best_epoch > 0 ? "test on best.pt (epoch " + std::to_string(best_epoch) + "):"
                                    : "test on the last weights (no best.pt: the monitor was never finite):";
  nlohmann::json json{{"checkpoint", best_epoch > 0 ? "best.pt" : ""}, {"epoch", best_epoch}};
  for (const auto& [name, v] : metrics) {
    line += "  " + format_metric(name, v);
    json[name] = v;
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  write_file_atomic(run_dir_ + "/test.json", json.dump(2) + "\n");
}

}  // namespace ddp
