// Trainer: set-up in a fixed order, then the epoch loop.
#include "ddp/train/trainer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "ddp/compat.h"
#include "ddp/data/device_feeder.h"
#include "ddp/data/loader.h"
#include "ddp/data/transforms.h"
#include "ddp/error.h"
#include "ddp/io/progress.h"
#include "ddp/data/sampler.h"
#include "ddp/dist/sync_batchnorm.h"

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

std::atomic<int> g_stop{0};

}  // namespace

TrainStepOptions train_step_options(const Config& c, const torch::Device& device) {
  const bool cuda = device.is_cuda();
  if (cuda) compat::set_cuda_math(c.tf32);
  use_nhwc_batchnorm_kernels(c.bn_kernel == "auto");
  return TrainStepOptions()
      .amp(c.amp)
      .cuda_graph(c.cuda_graph)
      .channels_last(c.channels_last == "on" || (c.channels_last == "auto" && cuda))
      .accum_steps(c.accum_steps)
      .clip_grad_norm(c.clip_grad_norm)
      .bucket_cap_mb(c.bucket_cap_mb)
      .optimizer(FlatOptimizerOptions().name(c.optimizer).lr(c.lr).weight_decay(c.weight_decay).momentum(c.momentum))
      .loss(LossOptions().kind(c.loss).label_smoothing(c.label_smoothing));
}

void request_stop() { g_stop.store(1); }
bool stop_requested() { return g_stop.load() != 0; }

Trainer::Trainer(Config config, World& world, Parts parts)
    : config_(std::move(config)), world_(world), parts_(std::move(parts)) {
  auto& model = *parts_.model;
  model.to(world_.device());
  if (!config_.pretrain.empty()) {
    // Every rank reads onto its own device (never all onto GPU 0); GradSync
    // then broadcasts rank 0's copy, so all ranks start identical.
    auto report = load_pretrained(config_.pretrain, model, world_.device(), config_.pretrain_skip);
    DDP_PRINT0(world_, "pretrain: %s: %s\n", config_.pretrain.c_str(), report.summary().c_str());
  }
  const bool sync_bn = config_.sync_bn == "on" || (config_.sync_bn == "auto" && world_.size() > 1);
  if (sync_bn) convert_sync_batchnorm(model, world_);
  step_ = std::make_unique<TrainStep>(model, world_, train_step_options(config_, world_.device()));
  const int64_t per_rank = DistributedSampler({parts_.data.train->size(), world_.size(), world_.rank()}).num_samples();
  const int64_t batches = (per_rank + config_.batch - 1) / config_.batch;
  steps_per_epoch_ = (batches + config_.accum_steps - 1) / config_.accum_steps;
  check_user(steps_per_epoch_ > 0, "the training set is empty.", "check --data_root and --train-samples.");
  schedule_ = std::make_unique<LrSchedule>(
      LrScheduleOptions()
          .kind(config_.schedule)
          .peak_lr(config_.lr)
          .total_steps(steps_per_epoch_ * config_.epochs)
          .warmup_steps(static_cast<int64_t>(std::llround(config_.warmup_epochs * static_cast<double>(steps_per_epoch_)))));
  is_bar_ = world_.share_string("progress", resolve_progress_mode(config_.progress) == ProgressMode::kBar ? "bar" : "") == "bar";
  // A resumed run continues in its checkpoint's run directory, so that
  // metrics.jsonl goes on; a fresh one gets a new directory. The checkpoint
  // is read (and so checked) before anything is written.
  const std::string resume_from = find_resume_checkpoint();
  if (!resume_from.empty()) resume(resume_from);
  open_run_dir(resume_from);
  const char* fail = std::getenv("DDPTRAIN_FAIL_AT_STEP");
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  // Fault injection for tests: DDPTRAIN_FAIL_AT_STEP=RANK:STEP throws there
  // (first attempt only); RANK:STEP:segv crashes there with SIGSEGV.
  char how[8] = "";
  if (fail && (!attempt || std::atoi(attempt) == 0) &&
      std::sscanf(fail, "%d:%ld:%7s", &fail_rank_, &fail_step_, how) >= 2)
    fail_segv_ = std::string(how) == "segv";
  else
    fail_rank_ = -1;
}

Trainer::~Trainer() = default;

std::string Trainer::find_resume_checkpoint() const {
  if (config_.resume.empty()) return "";
  if (config_.resume != "auto") {
    check_user(fs::exists(config_.resume), "--resume " + config_.resume + " does not exist.",
               "pass an existing checkpoint, or --resume auto to pick the newest under --save_path.");
    return config_.resume;
  }
  std::string path = world_.share_string("resume_path", world_.is_main() ? find_latest_checkpoint(config_.save_path) : "");
  if (path.empty()) DDP_PRINT0(world_, "resume: no checkpoint under %s; starting fresh\n", config_.save_path.c_str());
  return path;
}

void Trainer::open_run_dir(const std::string& resume_from) {
  std::string dir;
  if (!resume_from.empty()) {
    dir = run_dir_of(resume_from);
  } else if (world_.is_main()) {
    dir = make_run_dir(config_.save_path, "train_" + timestamp());
  }
  run_dir_ = world_.share_string("run_dir", dir);
  metrics_ = std::make_unique<MetricsLog>(world_.is_main() ? run_dir_ + "/metrics.jsonl" : "");
  if (!resume_from.empty()) {
    metrics_->truncate_to(state_.epoch, state_.step);  // drop rows logged after the checkpoint
  } else if (world_.is_main()) {
    write_file_atomic(run_dir_ + "/config.json", config_to_json(config_).dump(2) + "\n");
    write_file_atomic(run_dir_ + "/config.toml", config_to_toml(config_));  // --config repeats the run
  }
}

void Trainer::resume(const std::string& path) {
  auto meta = load_checkpoint(path, *parts_.model, step_.get(), world_.device(), parts_.arch);
  state_ = meta.state;
  DDP_PRINT0(world_, "resume: %s (epoch %lld, step %lld)\n", path.c_str(), static_cast<long long>(state_.epoch),
             static_cast<long long>(state_.step));
}

EpochMetrics Trainer::fit() {
  if (world_.is_main()) {
    std::ostringstream os;
    print_config(config_, os);
    std::printf("%s", os.str().c_str());
    std::printf("world: %d rank(s), backend %s, device %s; data: %s (%lld train, %lld test); model %s; run dir %s\n",
                world_.size(), world_.backend_name().c_str(), world_.device().str().c_str(),
                parts_.data.train->name().c_str(), static_cast<long long>(parts_.data.train->size()),
                static_cast<long long>(parts_.data.test->size()), parts_.arch.c_str(), run_dir_.c_str());
    std::fflush(stdout);
  }
  EpochMetrics last;
  for (int64_t epoch = state_.epoch + 1; epoch <= config_.epochs; ++epoch) {
    auto t0 = Clock::now();
    int64_t samples = 0;
    const double train_loss = train_epoch(epoch, samples);
    const double train_seconds = seconds_since(t0);
    auto [test_loss, test_acc] = evaluate();
    last.epoch = epoch;
    last.step = state_.step;
    last.train_loss = train_loss;
    last.test_loss = test_loss;
    last.test_acc = test_acc;
    last.lr = schedule_->at(std::max<int64_t>(state_.step - 1, 0));
    last.epoch_seconds = seconds_since(t0);
    last.samples_per_second = static_cast<double>(samples) / std::max(train_seconds, 1e-9);
    state_.epoch = epoch;
    metrics_->append(last);
    DDP_PRINT0(world_,
               "epoch %lld/%d  train_loss %.4f  test_loss %.4f  test_acc %.2f%%  %.1f s  %.0f samples/s  "
               "data wait %.0f%%\n",
               static_cast<long long>(epoch), config_.epochs, train_loss, test_loss, 100 * test_acc,
               last.epoch_seconds, last.samples_per_second, 100 * data_wait_seconds_ / std::max(train_seconds, 1e-9));
    const bool reached = config_.stop_at_acc > 0 && test_acc >= config_.stop_at_acc;
    if (epoch % config_.save_epoch == 0 || epoch == config_.epochs || stop_after_epoch_ || reached) save(epoch, test_acc);
    if (reached) {
      DDP_PRINT0(world_, "reached --stop-at-acc %.4f at epoch %lld; stopping.\n", config_.stop_at_acc,
                 static_cast<long long>(epoch));
      break;
    }
    if (stop_after_epoch_ && epoch < config_.epochs)
      throw Preempted("stopped by a signal after epoch " + std::to_string(epoch) + "; checkpoint saved in " + run_dir_ +
                      ". Resume with --resume auto --save_path " + config_.save_path + ".");
  }
  world_.barrier("end of training");
  if (world_.device().is_cuda())
    DDP_PRINT0(world_, "peak GPU memory %.0f MiB (rank 0)\n",
               static_cast<double>(compat::peak_cuda_bytes(world_.device().index())) / (1024.0 * 1024.0));
  return last;
}

double Trainer::train_epoch(int64_t epoch, int64_t& samples_seen) {
  auto& model = *parts_.model;
  model.train();
  DistributedSampler sampler({parts_.data.train->size(), world_.size(), world_.rank(), true,
                              static_cast<uint64_t>(config_.seed), false});
  sampler.set_epoch(epoch - 1);  // the order changes every epoch
  auto loader_options = data::LoaderOptions(config_.batch)
                            .workers(config_.workers)
                            .prefetch(std::max(2, 2 * config_.workers))
                            .pin_memory(world_.device().is_cuda())
                            .seed(static_cast<uint64_t>(config_.seed))
                            .epoch(epoch - 1)
                            .rank(world_.rank())
                            .start_batch(state_.batch_in_epoch);
  if (config_.augment == "standard" && !parts_.data.train_augmented)
    loader_options.transform(data::make_augment(data::AugmentOptions()));
  data::Loader loader(parts_.data.train, sampler.indices(), loader_options);

  const int64_t micro_batches = loader.num_batches();
  const int64_t display_every = is_bar_ ? std::max(1, config_.log_every / 10) : config_.log_every;
  Progress progress(world_.is_main() ? resolve_progress_mode(is_bar_ ? "bar" : config_.progress) : ProgressMode::kNone,
                    static_cast<int>(epoch), config_.epochs, micro_batches);
  const auto dev = world_.device();
  // Loss sum and count stay on the device: no host sync per step.
  // [loss sum, loss count, stop flag]; a resumed epoch starts from the saved
  // global sums (held by rank 0 alone, so the all-reduce counts them once).
  auto loss_sum = torch::zeros({3}, torch::TensorOptions().dtype(torch::kDouble).device(dev));
  if (state_.batch_in_epoch > 0 && world_.is_main()) {
    loss_sum[0] = state_.epoch_loss_sum;
    loss_sum[1] = state_.epoch_loss_count;
  }
  int64_t micro = state_.batch_in_epoch;
  state_.batch_in_epoch = 0;
  state_.epoch_loss_sum = state_.epoch_loss_count = 0;
  auto t0 = Clock::now();
  double lr = schedule_->at(state_.step);

  data::DeviceFeeder feeder(loader, dev, [this](const torch::Tensor& t) { return step_->prepare(t); });
  while (auto batch = feeder.next()) {
    const auto& x = batch->input;
    const auto& y = batch->target;
    const bool last_micro = (micro + 1) % config_.accum_steps == 0 || micro + 1 == micro_batches;
    if (last_micro) lr = schedule_->at(state_.step);
    // ---- one micro-step (forward, loss, backward; on the last micro-batch
    // also all-reduce, clip and the optimizer step), no host sync ----
    auto loss = step_->run(x, y, last_micro, lr);
    loss_sum[0] += loss.to(torch::kDouble);
    loss_sum[1] += 1;
    ++micro;
    samples_seen += x.size(0) * world_.size();
    if (!dev.is_cuda() && !std::isfinite(loss.item<double>()))
      throw NonFiniteLoss(epoch, state_.step, loss.item<double>(), run_dir_);
    if (last_micro) {
      ++state_.step;
      if (world_.rank() == fail_rank_ && state_.step == fail_step_) {
        if (fail_segv_) std::raise(SIGSEGV);
        throw std::runtime_error("injected failure (DDPTRAIN_FAIL_AT_STEP) at step " + std::to_string(fail_step_));
      }
    }
    const bool log_point = micro % config_.log_every == 0 || micro == micro_batches;
    if (micro % display_every == 0 || log_point) {
      // The stop flag rides on the loss all-reduce, so every rank stops at
      // the same step boundary.
      auto mean = loss_sum.clone();
      mean[2] = stop_requested() ? 1.0 : 0.0;
      world_.all_reduce(mean, "train loss");
      const double avg = mean[0].item<double>() / std::max(1.0, mean[1].item<double>());
      if (!std::isfinite(avg)) throw NonFiniteLoss(epoch, state_.step, avg, run_dir_);
      const double samples_per_second = static_cast<double>(samples_seen) / std::max(seconds_since(t0), 1e-9);
      progress.update(micro, avg, lr, samples_per_second);
      if (log_point) metrics_->log_step({state_.step, epoch, avg, lr, samples_per_second});
      if (mean[2].item<double>() > 0 && last_micro) {
        if (micro < micro_batches) {
          progress.close();
          state_.batch_in_epoch = micro;
          state_.epoch_loss_sum = mean[0].item<double>();
          state_.epoch_loss_count = mean[1].item<double>();
          state_.epoch = epoch - 1;
          save_and_stop(run_dir_ + "/preempt.pt");
        }
        stop_after_epoch_ = true;
      }
    }
  }
  progress.close();
  data_wait_seconds_ = feeder.wait_seconds();
  auto total = loss_sum.clone();
  world_.all_reduce(total, "epoch train loss");
  return total[0].item<double>() / std::max(1.0, total[1].item<double>());
}

std::pair<double, double> Trainer::evaluate() {
  auto& model = *parts_.model;
  model.eval();
  torch::NoGradGuard no_grad;
  const auto& test = parts_.data.test;
  // Each test sample is seen by exactly one rank: no padding duplicates.
  data::Loader loader(test, shard_without_padding(test->size(), world_.rank(), world_.size()),
                      data::LoaderOptions(config_.batch * 2).workers(config_.workers).pin_memory(world_.device().is_cuda()));
  const auto dev = world_.device();
  auto sums = torch::zeros({3}, torch::TensorOptions().dtype(torch::kDouble).device(dev));  // loss, correct, count
  const bool classify = test->num_classes() > 0;
  LossOptions plain = LossOptions().kind(config_.loss);
  while (auto batch = loader.next()) {
    auto x = step_->prepare(batch->input.to(dev, true)), y = batch->target.to(dev, true);
    torch::Tensor out;
    {
      auto amp = step_->autocast(dev.type());
      out = model.forward(x).to(torch::kFloat);
    }
    const double n = static_cast<double>(x.size(0));
    sums[0] += compute_loss(out, y, plain).to(torch::kDouble) * n;
    if (classify) sums[1] += out.argmax(1).eq(y).sum().to(torch::kDouble);
    sums[2] += n;
  }
  world_.all_reduce(sums, "evaluation totals");
  const double count = std::max(1.0, sums[2].item<double>());
  return {sums[0].item<double>() / count, sums[1].item<double>() / count};
}

void Trainer::save_and_stop(const std::string& path) {
  if (world_.is_main()) {
    save_checkpoint(path, *parts_.model, step_.get(), CheckpointMeta{state_, parts_.arch, config_to_json(config_)});
  }
  world_.barrier("checkpoint before stopping");
  throw Preempted("stopped by a signal at step " + std::to_string(state_.step) + "; checkpoint saved to " + path +
                  ". Resume with --resume auto --save_path " + config_.save_path + ".");
}

void Trainer::save(int64_t epoch, double test_acc) {
  if (!world_.is_main()) return;
  CheckpointMeta meta{state_, parts_.arch, config_to_json(config_)};
  const std::string path = run_dir_ + "/epoch_" + std::to_string(epoch) + ".pt";
  if (test_acc > state_.best_acc) {
    state_.best_acc = test_acc;
    meta.state = state_;
    save_checkpoint(run_dir_ + "/best.pt", *parts_.model, step_.get(), meta);
  }
  save_checkpoint(path, *parts_.model, step_.get(), meta);
  std::printf("saved %s\n", path.c_str());
  if (config_.keep_last > 0) remove_old_checkpoints(run_dir_, config_.keep_last);
}

}  // namespace ddp
