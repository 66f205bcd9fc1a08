// The training step: autocast, loss scaling, clipping, the flat optimizer,
// and CUDA graph capture of the whole thing.
#include "ddp/train/train_step.h"
#include "ddp/program.h"

#include <cstdio>
#ifdef DDP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#include <optional>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/dist/sync_batchnorm.h"
#include <map>
#include <typeinfo>
#include <unordered_map>

#include "ddp/models/gpt.h"
#include "ddp/train/lm_task.h"
#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/side_stream.h"
#include "ddp/models/fused_linear.h"
#endif

namespace ddp {

#ifdef DDP_WITH_CUDA
struct TrainStep::Graph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  data::Batch input;   // static input buffers
  StepOutput out{torch::Tensor()};  // static outputs
  bool ready = false;
};
#else
struct TrainStep::Graph {
  bool ready = false;
};
#endif

namespace {

// The (Net, options) constructor's task: options.loss() on the Net's output.
class NetLossTask : public Task {
 public:
  NetLossTask(Net& net, LossOptions loss) : net_(net), loss_(std::move(loss)) {}
  StepOutput training_step(const data::Batch& b) override { return compute_loss(net_.forward(b.input()), b.target(), loss_); }
  TensorMap validation_step(const data::Batch&) override { return {}; }

 private:
  Net& net_;
  LossOptions loss_;
};

#ifdef DDP_WITH_CUDA
// A capture, once begun, holds the device's CUDA generator in capture mode
// (its random numbers counted for the graph) until capture_end; a capture
// abandoned half-way never gets there, and in LibTorch 2.x every later eager
// random draw (dropout) then fails. A small capture begun and ended on the
// same stream lets the generator go. (Not empty: an empty graph warns.)
void release_generator_from_capture(const c10::cuda::CUDAStream& stream) {
  c10::cuda::CUDAStreamGuard on(stream);
  at::cuda::CUDAGraph release;
  compat::begin_capture(release);
  at::empty({1}, at::TensorOptions().device(stream.device())).zero_();
  release.capture_end();
}

// True when `b` has the same names, shapes and strides as the graph's
// static inputs, so it can be copied into them.
bool same_layout(const data::Batch& b, const data::Batch& like) {
  if (b.size() != like.size()) return false;
  auto it = like.begin();
  for (const auto& [name, t] : b) {
    const auto& [other_name, other] = *it++;
    if (name != other_name || t.sizes() != other.sizes() || t.strides() != other.strides() ||
        t.scalar_type() != other.scalar_type())
      return false;
  }
  return true;
}
#endif

bool has_synced_batchnorm(torch::nn::Module& model) {
  for (const auto& m : model.modules())
    if (auto* bn = m->as<BatchNormImpl>(); bn && bn->synced()) return true;
  return false;
}

}  // namespace

TrainStep::TrainStep(Net& model, World& world, TrainStepOptions options)
    : TrainStep(*new NetLossTask(model, options.loss()), model, world, options) {
  own_task_.reset(&task_);
}

TrainStep::TrainStep(Task& task, torch::nn::Module& model, World& world, TrainStepOptions options)
    : task_(task), model_(model), world_(world), o_(std::move(options)) {
  if (o_.shard_gradients()) o_.shard_optimizer(true);  // ZeRO-2 is ZeRO-1 with the gradients sharded too
  const auto dev = world_.device();
  check_user(o_.amp() == "off" || o_.amp() == "bf16" || o_.amp() == "fp16", "unknown --amp '" + o_.amp() + "'.",
             "use --amp off, bf16 or fp16.");
  amp_on_ = o_.amp() != "off";
  fp16_ = o_.amp() == "fp16";
  amp_dtype_ = fp16_ ? c10::ScalarType::Half : c10::ScalarType::BFloat16;
  const bool fused = o_.optimizer().fused() && compat::kHasFusedOptimizers && dev.is_cuda();
#ifdef DDP_WITH_CUDA_KERNELS
  {
    // --side-stream auto: ddptrain's GPT trained by ddptrain's LmTask meets
    // the side stream's contract (cuda/side_stream.h: each weight gets its
    // gradient from ddptrain's functions alone); a subclass of either might
    // add a LibTorch op on a weight (a penalty, say), so only these exact
    // types vouch. One process only, until several GPUs are measured.
    // Under --recompute the weight gradients come out of a recompute node's
    // backward, which hands them on at once: not vouched.
    const bool vouched = typeid(model_) == typeid(models::GptImpl) && typeid(task_) == typeid(LmTask) &&
                         world_.size() == 1 &&
                         dynamic_cast<models::GptImpl&>(model_).options.recompute().kind == RecomputePolicy::Kind::kNone;
    // Decided here, for this step's life: only the fused linear layers under
    // bf16 autocast hand work aside.
    side_stream_ = dev.is_cuda() && amp_on_ && !fp16_ && models::fused_linear_enabled() &&
                   cuda::side_stream_wanted(vouched);
  }
#endif

  if (o_.cuda_graph()) {
    graph_wanted_ = true;
    if (!dev.is_cuda())
      fall_back("it needs a CUDA device");
    else if (o_.accum_steps() > 1)
      fall_back("gradient accumulation (--accum-steps > 1) is not captured");
    else if (o_.shard_gradients() && world_.size() > 1)
      fall_back("--shard-gradients makes its bucket buffers inside each backward, which a capture would fix");
    else if (!fused)
      fall_back("this LibTorch has no fused (capturable) optimizer kernels");
    else if (has_synced_batchnorm(model_))
      fall_back("SyncBatchNorm reads the global batch size on the host; use --sync-bn off to capture");
    else
      graph_ = std::make_unique<Graph>();
  }
  {
    // Autograd runs each parameter's gradient accumulation on the stream
    // that was current when its accumulator node was made (GradSync makes
    // them). With a graph that must be the capture stream: an accumulation
    // on the legacy default stream would break the capture.
#ifdef DDP_WITH_CUDA
    std::optional<c10::cuda::CUDAStreamGuard> on_side;
    if (graph_) on_side.emplace(graph_->stream);
#endif
    sync_ = std::make_unique<GradSync>(model_, world_,
                                       GradSyncOptions()
                                           .bucket_cap_mb(o_.bucket_cap_mb())
                                           .channels_last(o_.channels_last())
                                           .separate_1d(o_.optimizer().no_decay_1d())
                                           .separate_names(o_.optimizer().no_decay())
                                           .reduction(gradient_reduction())
                                           .shard_gradients(o_.shard_gradients())
                                           .gradient_norms(o_.clip_grad_norm() > 0));
#ifdef DDP_WITH_CUDA
    // GradSync copied the parameters into its flat buffers on the capture
    // stream and released their old storage, which belongs to the default
    // stream's pool: wait for the copies before anything can reuse it (a
    // race that once gave a different first loss).
    if (graph_) torch::cuda::synchronize(dev.index());
#endif
  }
  auto optimizer = o_.optimizer();
  if (o_.shard_optimizer()) optimizer.shard_over(&world_);
  optimizer_ = std::make_unique<FlatOptimizer>(*sync_, optimizer);
  // --shard-optimizer: ddptrain's GPT trained by ddptrain's LmTask waits
  // for the gather part by part inside its forward (exact types, as for
  // the side stream: a subclass may read a weight before the forward).
  // Not with bf16 autocast (its copies are cast from every buffer at the
  // forward's start) or --cuda-graph (a captured step waits in the step).
  if (optimizer_->shards() > 1 && typeid(model_) == typeid(models::GptImpl) && typeid(task_) == typeid(LmTask) &&
      !(amp_on_ && !fp16_) && !graph_wanted_)
    wait_by_part(dynamic_cast<models::GptImpl&>(model_));
  if (o_.ema() != 0) ema_ = std::make_unique<WeightEma>(model_, sync_->flat_params(), o_.ema());
  broadcast_buffers_ = world_.size() > 1 && !model_.buffers().empty() && !has_synced_batchnorm(model_);
  // SyncBatchNorm's backward all-reduces on the gradients' process group:
  // a bucket left for finish() would go out after it on this rank only.
  // ZeRO-2 too: a bucket waiting for a parameter this backward does not
  // reach would hold its buffer, and every later one, until finish().
  expect_unused_ = world_.size() > 1 && (has_synced_batchnorm(model_) || o_.shard_gradients());

  if (fp16_) {
    check_user(dev.is_cuda(), "--amp fp16 needs a CUDA device; this rank runs on " + dev.str() + ".",
               "use --amp bf16 or --amp off on CPU.");
    check_user(optimizer_->capturable(), "--amp fp16 needs LibTorch's fused CUDA optimizers (LibTorch 2.2 or later).",
               "use --amp bf16 with this build.");
    auto f = torch::TensorOptions().dtype(torch::kFloat).device(dev);
    scale_ = torch::full({1}, 65536.0, f);  // PyTorch GradScaler's defaults
    growth_tracker_ = torch::zeros({1}, f.dtype(torch::kInt));
    found_inf_ = torch::zeros({1}, f);
  }
}

TrainStep::~TrainStep() = default;

// Where each part of the GPT (-1: the embeddings; i: block i) has its
// parameters in the flat buffers; the gather is cut where a part begins,
// and the forward waits for a part's pieces just before the part runs
// (GptImpl::before_part), the rest (final norm, head) before the head.
struct TrainStep::PartWaits {
  FlatOptimizer* optimizer;
  int64_t layers;
  std::vector<std::vector<std::tuple<size_t, int64_t, int64_t>>> ranges;  // [part + 1]: (buffer, lo, len)
};

void TrainStep::wait_by_part(models::GptImpl& gpt) {
  const int64_t layers = gpt.options.n_layer();
  std::unordered_map<const void*, int64_t> part_of;
  for (auto* p : {&gpt.transformer->wte->weight, &gpt.transformer->wpe->weight}) part_of[p->unsafeGetTensorImpl()] = -1;
  for (int64_t i = 0; i < layers; ++i)
    for (const auto& p : gpt.transformer->h[static_cast<size_t>(i)]->parameters()) part_of[p.unsafeGetTensorImpl()] = i;
  // GradSync's parameters, in its order (param_slices()): trainable, each once.
  std::vector<torch::Tensor> params;
  std::unordered_map<const void*, bool> seen;
  for (const auto& p : model_.parameters())
    if (p.requires_grad() && seen.emplace(p.unsafeGetTensorImpl(), true).second) params.push_back(p);
  const auto& slices = sync_->param_slices();
  TORCH_CHECK(params.size() == slices.size(), "TrainStep: the GPT's parameters do not match GradSync's");
  auto waits = std::make_shared<PartWaits>(PartWaits{optimizer_.get(), layers, {}});
  waits->ranges.resize(static_cast<size_t>(layers + 1));
  // Each part's first element in each buffer (GradSync lays the slices out
  // in reverse: the embeddings last), where the gather is cut.
  std::vector<std::map<int64_t, int64_t>> first_of(sync_->flat_params().size());  // [buffer]: part -> offset
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = part_of.find(params[i].unsafeGetTensorImpl());
    const int64_t part = it == part_of.end() ? layers : it->second;  // final norm: waited for with the rest
    const auto& s = slices[i];
    auto [at, fresh] = first_of[s.flat].emplace(part, s.offset);
    if (!fresh) at->second = std::min(at->second, s.offset);
    if (part < layers) waits->ranges[static_cast<size_t>(part + 1)].emplace_back(s.flat, s.offset, s.numel);
  }
  std::vector<std::vector<std::pair<int64_t, int64_t>>> starts(first_of.size());
  for (size_t k = 0; k < first_of.size(); ++k)
    for (const auto& [part, offset] : first_of[k]) starts[k].emplace_back(offset, part);
  optimizer_->split_gather_at(std::move(starts));
  part_waits_ = waits;
  gpt.before_part = [weak = std::weak_ptr<PartWaits>(waits)](int64_t part) {
    auto w = weak.lock();
    if (!w) return;  // this TrainStep is gone
    if (part >= w->layers) {
      w->optimizer->wait_for_parameters();
      return;
    }
    for (const auto& [k, lo, len] : w->ranges[static_cast<size_t>(part + 1)]) w->optimizer->wait_for_range(k, lo, len);
  };
}

GradientReduction TrainStep::gradient_reduction() const {
  if (!o_.shard_optimizer()) return GradientReduction::kAllReduce;
  return o_.gradient_reduction() == GradientReduction::kAuto ? sharded_reduction(world_) : o_.gradient_reduction();
}

void TrainStep::fall_back(const std::string& why) {
  graph_wanted_ = false;
  fallback_ = why;
  graph_.reset();
  if (world_.is_main()) std::fprintf(stderr, "%s: --cuda-graph: %s; running eager.\n", program_name(), why.c_str());
}

bool TrainStep::graphed() const { return graph_ && graph_->ready; }

torch::Tensor TrainStep::prepare(const torch::Tensor& x) const {
  if (o_.channels_last() && x.dim() == 4) return x.contiguous(at::MemoryFormat::ChannelsLast);
  return x;
}

StepOutput TrainStep::step_body(const data::Batch& batch, bool last_micro, double loss_scale) {
  StepOutput out{torch::Tensor()};
  {
    std::optional<GradSync::NoSync> no_sync;
    if (!last_micro) no_sync.emplace(*sync_);
    // Under bf16 autocast, kernels that ask (param_slots.h) read the
    // parameters' bf16 copies until backward ends, cast from the parameters
    // where they changed since the copies were last made equal to them.
    GradSync::BF16Window bf16(*sync_, amp_on_ && amp_dtype_ == c10::ScalarType::BFloat16);
    {
      auto amp = autocast(world_.device().type());
      out = task_.training_step(batch);
    }
    auto& loss = out.loss;
    check_user(loss.defined() && loss.numel() == 1 && loss.is_floating_point(),
               "training_step() must return a scalar floating-point loss; it returned " +
                   (loss.defined() ? c10::str(loss.scalar_type(), " of shape ", loss.sizes()) : std::string("nothing")) + ".",
               "return the batch's mean loss, e.g. torch::mse_loss(output, target).");
    check_user(loss.requires_grad(), "the loss from training_step() does not depend on any trainable parameter.",
               "compute it from the model's output (and not under torch::NoGradGuard).");
    loss = loss.reshape({}).to(torch::kFloat);
    auto scaled = loss_scale != 1.0 ? loss * loss_scale : loss;
    if (fp16_) scaled = scaled * scale_;
    {
#ifdef DDP_WITH_CUDA_KERNELS
      // Weight gradients off the backward's critical path, on a second
      // stream, joined back here (side_stream.h).
      cuda::SideWork side(side_stream_);
      if (last_micro && expect_unused_) sync_->expect_gradients_from(scaled);
      scaled.backward();
      side.close();  // an error of the side work's fails the step here
#else
      if (last_micro && expect_unused_) sync_->expect_gradients_from(scaled);
      scaled.backward();
#endif
    }
  }  // the bf16 copies close before the optimizer changes the parameters
  if (last_micro) {
    torch::NoGradGuard no_grad;
    sync_->finish();
    torch::Tensor found_inf;
    if (fp16_) {
      found_inf_.zero_();
      // Reduce-scattered gradients: each rank checks its part, and all
      // agree on any infinity.
      at::_amp_foreach_non_finite_check_and_unscale_(
          sync_->gradients_sharded() ? optimizer_->gradient_parts() : sync_->flat_grads(), found_inf_,
          scale_.reciprocal());
      if (sync_->gradients_sharded()) world_.all_reduce(found_inf_, "the fp16 overflow check", c10d::ReduceOp::MAX);
      found_inf = found_inf_;
    }
    optimizer_->step(found_inf, o_.clip_grad_norm(), GradientsAfterStep::kDropped);  // set to none below
    if (fp16_) at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, 2.0, 0.5, 2000);
    if (ema_) {
      optimizer_->wait_for_parameters();  // the average reads every parameter (no overlap with --ema)
      ema_->update();                     // in the captured graph too
    }
    // As PyTorch 2.x's default zero_grad(set_to_none=True): the next
    // backward's gradients are copied into the flat buffer, not added to
    // zeros (GradSync::zero_grad).
    sync_->zero_grad(/*set_to_none=*/true);
  }
  out.loss = out.loss.detach();
  for (auto& [name, t] : out.logs) t = t.detach().reshape({}).to(torch::kFloat);
  return out;
}

torch::Tensor TrainStep::run(const torch::Tensor& x, const torch::Tensor& y, bool last_micro, double lr) {
  return run(data::Batch(x, y), last_micro, lr, 1.0 / o_.accum_steps()).loss;
}

StepOutput TrainStep::run(const data::Batch& batch, bool last_micro, double lr, double loss_scale) {
  if (last_micro) optimizer_->set_lr(lr);
  // --shard-optimizer: the last step's parameter gather ran while the host
  // got this batch; the forward reads every parameter (a CUDA graph's
  // replay and capture included, and the bf16 copies cast below).
  // ddptrain's GPT waits part by part inside its forward (wait_by_part).
  if (!part_waits_) optimizer_->wait_for_parameters();
  // Local batch norm on several ranks: rank 0's running statistics before
  // every forward, as PyTorch DDP's broadcast_buffers=True does. Outside the
  // captured graph, so a replay starts from them too.
  if (broadcast_buffers_) sync_->broadcast_buffers();
#ifdef DDP_WITH_CUDA
  if (graph_wanted_ && graph_) {
    auto& g = *graph_;
    const bool fits = !g.ready || same_layout(batch, g.input);
    if (g.ready && fits) {
      for (auto& [name, t] : g.input) t.copy_(batch.at(name), /*non_blocking=*/true);
      // The bf16 copies (param_slots.h) as the captured step expects them,
      // and what the replay leaves them as.
      sync_->before_graph_replay();
      g.graph.replay();
      sync_->graph_replayed();
      StepOutput out(g.out.loss.clone());
      for (const auto& [name, t] : g.out.logs) out.logs[name] = t.clone();
      return out;
    }
    if (fits && eager_steps_ >= o_.graph_warmup()) {
      if (try_capture(batch)) return run(batch, last_micro, lr, loss_scale);
      return step_body(batch, last_micro, loss_scale);  // capture failed: eager from now on
    }
    // Warm-up steps, and batches of another shape (an epoch's last, smaller
    // one), run eagerly on the capture stream: per-stream state (cuBLAS
    // workspaces) then exists before capture, as PyTorch advises, and the
    // gradient accumulators keep the stream they were made on.
    if (fits) ++eager_steps_;
    auto current = c10::cuda::getCurrentCUDAStream();
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(g.stream);
    StepOutput out{torch::Tensor()};
    {
      c10::cuda::CUDAStreamGuard on_side(g.stream);
      out = step_body(batch, last_micro, loss_scale);
    }
    at::cuda::CUDAEvent done;
    done.record(g.stream);
    done.block(current);
    return out;
  }
#endif
  return step_body(batch, last_micro, loss_scale);
}

bool TrainStep::try_capture(const data::Batch& batch) {
#ifdef DDP_WITH_CUDA
  auto& g = *graph_;
  torch::cuda::synchronize();
  g.input = data::Batch();
  for (const auto& [name, t] : batch) g.input[name] = t.clone();
  const bool cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  // Every replay must overwrite the gradients: capture from gradients set
  // to none, whatever the eager steps before left (a first step adds into
  // the zeros GradSync starts with).
  sync_->zero_grad(/*set_to_none=*/true);
  try {
    c10::cuda::CUDAStreamGuard on_side(g.stream);
    compat::begin_capture(g.graph);
    g.out = step_body(g.input, /*last_micro=*/true, /*loss_scale=*/1.0);
    g.graph.capture_end();
  } catch (const std::exception& e) {
    at::autocast::set_autocast_cache_enabled(cache);
    // Leave capture mode by hand and drop the half-made graph without its
    // destructor, which is not safe on a broken capture; the little memory
    // it holds is not worth a crash.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(g.stream.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(g.stream.stream(), &broken);
      if (broken) cudaGraphDestroy(broken);
    }
    (void)cudaGetLastError();
    // The step stopped part-way, but only on the host: a capture records
    // kernels without running them, so the device state (parameters,
    // moments, step counts, the fp16 loss scale) is as before. GradSync's
    // per-step state is not: buckets counted or launched into the dead
    // graph would make the next eager step reduce too early or not at all.
    sync_->abandon_step(/*wait_launched=*/false);
    sync_->bf16_copies_stale();
    release_generator_from_capture(g.stream);
    (void)graph_.release();
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::string what = c10_error ? c10_error->what_without_backtrace() : e.what();
    fall_back("capture failed (" + what.substr(0, what.find('\n')) + ")");
    return false;
  }
  at::autocast::set_autocast_cache_enabled(cache);
  torch::cuda::synchronize();
  g.ready = true;
  if (world_.is_main())
    std::fprintf(stderr, "%s: --cuda-graph: captured the training step after %lld eager steps.\n", program_name(),
                 static_cast<long long>(eager_steps_));
  return true;
#else
  (void)batch;
  return false;
#endif
}

std::unique_ptr<WeightEma::Swap> TrainStep::averaged_weights() {
  if (!ema_) return nullptr;
  optimizer_->wait_for_parameters();  // the swap writes the parameters
  return std::make_unique<WeightEma::Swap>(*ema_, [this] { sync_->bf16_copies_stale(); });
}

void TrainStep::save(TensorMap& state) const {
  optimizer_->save(state);
  if (ema_) ema_->save(state);
  if (fp16_) {
    state["scaler/scale"] = scale_.detach().cpu();
    state["scaler/growth_tracker"] = growth_tracker_.detach().cpu();
  }
}

void TrainStep::load(const TensorMap& state) {
  optimizer_->load(state);  // waits for a gather in flight first
  if (ema_) ema_->load(state);
  // The checkpoint's weights were just written, maybe where no version
  // counter sees it: the bf16 copies are cast again before they are read.
  sync_->bf16_copies_stale();
  torch::NoGradGuard no_grad;
  auto scale = state.find("scaler/scale"), growth = state.find("scaler/growth_tracker");
  if (fp16_ && scale != state.end()) scale_.copy_(scale->second);
  if (fp16_ && growth != state.end()) growth_tracker_.copy_(growth->second);
}

}  // namespace ddp
