// Optimizer steps over flat buffers: LibTorch's fused kernels where they
// exist, else torch::optim's arithmetic applied to whole buffers.
#include "ddp/train/flat_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include <torch/csrc/autograd/variable.h>

#include "ddp/compat.h"
#include "ddp/error.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/adamw.h"
#endif

namespace ddp {

namespace {
std::string joined_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ",") + n;
  return out;
}
}  // namespace

void decay_matrices_only(FlatOptimizerOptions& options, torch::nn::Module& model) {
  std::vector<std::string> tables;
  auto note = [&](const std::string& prefix, const torch::nn::Module& m) {
    if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&m) || dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&m))
      tables.push_back(prefix.empty() ? "weight" : prefix + ".weight");
  };
  note("", model);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) note(item.key(), *item.value());
  options.no_decay_1d(true).no_decay(tables);
}

FlatOptimizer::FlatOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                             FlatOptimizerOptions options)
    : FlatOptimizer(std::move(params), std::move(grads), std::move(options), nullptr) {}

FlatOptimizer::FlatOptimizer(const GradSync& sync, FlatOptimizerOptions options)
    : FlatOptimizer(sync.flat_params(), sync.flat_grads(), std::move(options), &sync) {}

FlatOptimizer::FlatOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                             FlatOptimizerOptions options, const GradSync* sync)
    : o_(std::move(options)), params_(std::move(params)), grads_(std::move(grads)), sync_(sync) {
  check_user(o_.name() == "sgd" || o_.name() == "adam" || o_.name() == "adamw",
             "unknown optimizer '" + o_.name() + "'.", "use --optimizer sgd, adam or adamw.");
  check_user(!o_.no_decay_1d() || (sync_ && sync_->options().separate_1d()),
             "no_decay_1d needs the 1-D parameters in flat buffers of their own.",
             "build the FlatOptimizer on a GradSync made with GradSyncOptions().separate_1d(true), as TrainStep does.");
  check_user(o_.no_decay().empty() || (sync_ && sync_->options().separate_names() == o_.no_decay()),
             "no_decay needs its parameters in flat buffers of their own.",
             "build the FlatOptimizer on a GradSync made with GradSyncOptions().separate_names(the same names), as "
             "TrainStep does.");
  TORCH_CHECK(params_.size() == grads_.size() && !params_.empty(), "FlatOptimizer needs matching flat buffers");
  adam_ = o_.name() != "sgd";
  const auto& dev = params_.front().device();
  fused_ = o_.fused() && compat::kHasFusedOptimizers && dev.is_cuda();
#ifdef DDP_WITH_CUDA_KERNELS
  // ddptrain's own Adam kernel (cuda/adamw.h) for fp32 buffers: the
  // clipping's coefficient and the next step's bf16 copies in its pass.
  own_adam_ = fused_ && adam_ && std::all_of(params_.begin(), params_.end(), [](const torch::Tensor& t) {
                return t.scalar_type() == torch::kFloat && t.is_contiguous();
              });
#endif
  torch::NoGradGuard no_grad;
  shard_ = o_.shard_over() && o_.shard_over()->size() > 1 ? o_.shard_over() : nullptr;
  // Reduce-scattered gradients hold the sum over this rank's part only:
  // the same parts as the state's, over the same ranks.
  grads_sharded_ = sync_ && sync_->gradients_sharded();
  TORCH_CHECK(!grads_sharded_ || (shard_ && shard_->size() == sync_->gradients_world_size()),
              "FlatOptimizer: sharded gradients need shard_over, over the same ranks");
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto part = shard_range(params_[i].numel(), shard_ ? shard_->size() : 1, shard_ ? shard_->rank() : 0);
    lo_.push_back(part.lo);
    len_.push_back(part.len);
    sp_.push_back(params_[i].narrow(0, lo_.back(), len_.back()));
    // ZeRO-2's gradient buffers are this part already.
    sg_.push_back(grads_sharded_ ? sync_->owned_gradients(i) : grads_[i].narrow(0, lo_.back(), len_.back()));
    TORCH_CHECK(sg_.back().numel() == len_.back() && (grads_sharded_ || params_[i].sizes() == grads_[i].sizes()),
                "flat parameter and gradient buffers differ in size");
    m_.push_back(torch::zeros_like(sp_.back()));
    if (adam_) v_.push_back(torch::zeros_like(sp_.back()));
    step_.push_back(torch::zeros({}, params_[i].options().dtype(torch::kFloat)));
    const bool exempt = (o_.no_decay_1d() || !o_.no_decay().empty()) && sync_->holds_1d(i);
    weight_decay_.push_back(exempt ? 0.0 : o_.weight_decay());
    if (!sync_) slices_.push_back(ParamSlice{i, 0, params_[i].numel()});
  }
  if (sync_) slices_ = sync_->param_slices();
  lr_t_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(dev));
  set_lr(o_.lr());
  init_state();
}

// Per-slice state, allocated once: nothing is created lazily inside a step,
// which a CUDA graph would replay without re-running the host code.
void FlatOptimizer::init_state() {
  const size_t n = slices_.size();
  host_missed_.assign(n, 0);
  may_have_missed_.assign(n, 0);
  missed_.clear();
  own_step_.clear();
  if (!fused_ || !adam_) return;
  for (size_t i = 0; i < n; ++i) {
    const auto on = step_[slices_[i].flat].options();
    missed_.push_back(torch::zeros({}, on));
    own_step_.push_back(torch::zeros({}, on));
  }
}

void FlatOptimizer::set_lr(double lr) {
  lr_ = lr;
  if (fused_) lr_t_.fill_(lr);
}

int64_t FlatOptimizer::steps_taken() const {
  return fused_ ? static_cast<int64_t>(step_.front().item<float>()) : host_step_;
}

std::vector<int64_t> FlatOptimizer::parameter_steps() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < slices_.size(); ++i) {
    if (!fused_) out.push_back(host_step_ - host_missed_[i]);
    else if (!adam_) out.push_back(steps_taken());
    else out.push_back(static_cast<int64_t>((step_[slices_[i].flat] - missed_[i]).item<float>()));
  }
  return out;
}

// clip_grad_norm_'s rule over every parameter's gradient, on the device.
// The Adam kernels apply the scale in their pass: ddptrain's takes the
// coefficient, LibTorch's fused one its inverse (a divisor); returned.
// Elsewhere the gradients are multiplied here (and an undefined tensor is
// returned).
torch::Tensor FlatOptimizer::clip(double max_norm) {
  // Per parameter, in the model's order, as clip_grad_norm_ walks
  // model.parameters(): one norm over a whole flat buffer rounds otherwise
  // (on the CPU, 1e-6 relative apart and more for a large model, which a
  // run then carries on). Its coefficient as Python spells max / t:
  // t.reciprocal() * max, one rounding more than a division.
  std::vector<torch::Tensor> per_param;
  per_param.reserve(slices_.size());
  for (size_t i = 0; i < slices_.size(); ++i) per_param.push_back(grads_sharded_ ? part(sg_, i) : slice(grads_, i));
  // ZeRO-2 over all-reduced buckets kept each parameter's norm: the unsharded total, bit for bit.
  const bool kept = grads_sharded_ && !sync_->gradient_norms().empty();
  auto total = kept ? compat::norm_of_norms(sync_->gradient_norms())
                    : grads_sharded_ ? sharded_norm(per_param) : compat::clip_grad_total_norm(per_param);
  auto coef = ((total + 1e-6).reciprocal() * max_norm).clamp_max(1.0);
  if (own_adam_) return coef;
  if (fused_ && adam_) return ((total + 1e-6) / max_norm).clamp_min(1.0);
  for (const auto& g : grads_sharded_ ? sg_ : grads_) g.mul_(coef.to(g.scalar_type()));
  return {};
}

// The L2 norm of the whole gradient when each rank holds the sum over its
// part only: each rank's squared norm over its parts, summed over the ranks
// (on the device). Another order of summation than the unsharded norm's:
// equal to rounding.
torch::Tensor FlatOptimizer::sharded_norm(const std::vector<torch::Tensor>& parts) const {
  std::vector<torch::Tensor> held;
  for (const auto& p : parts)
    if (p.numel() > 0) held.push_back(p);
  auto sq = held.empty() ? torch::zeros({}, params_.front().options().dtype(torch::kFloat))
                         : compat::clip_grad_total_norm(held).square();
  auto total = sq.reshape({1}).contiguous();
  shard_->all_reduce(total, "the gradient norm over the shards (--clip-grad-norm with --shard-optimizer)");
  return total.reshape({}).sqrt();
}

torch::Tensor FlatOptimizer::slice(const std::vector<torch::Tensor>& flat, size_t i) const {
  const auto& s = slices_[i];
  return flat[s.flat].narrow(0, s.offset, s.numel);
}

torch::Tensor FlatOptimizer::part(const std::vector<torch::Tensor>& part, size_t i) const {
  const auto& s = slices_[i];
  const int64_t lo = lo_[s.flat], hi = lo + len_[s.flat];
  const int64_t a = std::clamp(s.offset, lo, hi), b = std::clamp(s.offset + s.numel, lo, hi);
  return part[s.flat].narrow(0, a - lo, b - a);
}

// Each rank's part of `whole[k]` from that rank (`mine[k]`, laid out like
// this rank's part), into `whole[k]` on every rank: an all-gather made of
// broadcasts, which every backend has, over the parts in place; each part
// cut again where a model's part begins (`part_starts[k]`, if any), and the
// pieces started in the order of their parts, then buffers, then offsets:
// the same order on every rank, as collectives must be. Started only: per
// buffer, its pieces' handles, to be waited for (World::wait) before the
// piece is read, or this rank's part written.
std::vector<FlatOptimizer::Pending> FlatOptimizer::start_broadcast_parts(
    const std::vector<torch::Tensor>& whole, const std::vector<torch::Tensor>& mine,
    const std::vector<std::vector<std::pair<int64_t, int64_t>>>& part_starts) {
  const int ranks = shard_->size();
  struct Cut {
    size_t k;
    int64_t lo, len, part;
    int root;
  };
  std::vector<Cut> cuts;
  for (size_t k = 0; k < whole.size(); ++k) {
    const int64_t n = whole[k].numel(), chunk = (n + ranks - 1) / ranks;
    if (len_[k] > 0 && !whole[k].narrow(0, lo_[k], len_[k]).is_same(mine[k]))
      whole[k].narrow(0, lo_[k], len_[k]).copy_(mine[k]);
    std::map<int64_t, int64_t> part_at;  // offset -> the part that begins there
    if (k < part_starts.size())
      for (const auto& [offset, part] : part_starts[k])
        if (offset >= 0 && offset < n) part_at[offset] = part;
    std::set<int64_t> edges{n};
    for (int r = 0; r < ranks; ++r) edges.insert(std::min(n, r * chunk));
    for (const auto& [offset, part] : part_at) edges.insert(offset);
    for (auto a = edges.begin(), b = std::next(a); b != edges.end(); ++a, ++b) {
      auto in = part_at.upper_bound(*a);
      const int64_t part = in == part_at.begin() ? 0 : std::prev(in)->second;
      cuts.push_back({k, *a, *b - *a, part, static_cast<int>(*a / chunk)});
    }
  }
  std::stable_sort(cuts.begin(), cuts.end(), [](const Cut& x, const Cut& y) { return x.part < y.part; });
  std::vector<Pending> out(whole.size());
  started_parts_.clear();
  for (const auto& c : cuts) {
    auto piece = whole[c.k].narrow(0, c.lo, c.len);
    out[c.k].push_back(Piece{c.lo, c.len, c.part, shard_->broadcast_async(piece, c.root)});
    started_parts_.push_back(c.part);
  }
  return out;
}

void FlatOptimizer::broadcast_parts(const std::vector<torch::Tensor>& whole, const std::vector<torch::Tensor>& mine) {
  for (auto& pieces : start_broadcast_parts(whole, mine))
    for (const auto& piece : pieces) shard_->wait(piece.work, "the sharded optimizer's state (--shard-optimizer)");
}

// One update of the tensors p[k] (gradients g[k], moments m[k] and v[k],
// weight decay weight_decay[k]); the fused kernels read the step count from
// step[k], the composed arithmetic takes it from host_step.
void FlatOptimizer::update(const std::vector<torch::Tensor>& p, const std::vector<torch::Tensor>& g,
                           const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
                           const std::vector<torch::Tensor>& step, const std::vector<double>& weight_decay,
                           int64_t host_step, const torch::Tensor& found_inf, const torch::Tensor& grad_scale,
                           const std::vector<torch::Tensor>& p16) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (own_adam_) {
    for (size_t i = 0; i < p.size(); ++i)
      if (p[i].numel() > 0)  // a rank's part may be empty (--shard-optimizer)
      cuda::adam_step(p[i], g[i], m[i], v[i], step[i], lr_t_,
                      {o_.beta1(), o_.beta2(), weight_decay[i], o_.eps(), o_.name() == "adamw", store_clipped_},
                      grad_scale, found_inf,
                      p16.empty() ? torch::Tensor() : p16[i]);
    // As in-place ATen ops would: GradSync reads the flat buffers' counters
    // to tell whether its bf16 copies are stale, and autograd's checks on
    // saved tensors see the copies (a graph that saved one) change.
    for (const auto& t : p) torch::autograd::impl::bump_version(t);
    for (const auto& t : p16) torch::autograd::impl::bump_version(t);
    return;
  }
#endif
  if (fused_) {
    // A fused kernel takes one weight decay: one call per value (two with
    // no_decay_1d), each over the tensors that have it.
    for (double wd : std::set<double>(weight_decay.begin(), weight_decay.end())) {
      auto with_wd = [&](const std::vector<torch::Tensor>& all) {
        std::vector<torch::Tensor> out;
        for (size_t i = 0; i < all.size(); ++i)
          if (weight_decay[i] == wd && p[i].numel() > 0) out.push_back(all[i]);  // parts may be empty
        return out;
      };
      if (with_wd(p).empty()) continue;
      if (adam_)
        compat::fused_adam(with_wd(p), with_wd(g), with_wd(m), with_wd(v), with_wd(step), lr_t_, o_.beta1(), o_.beta2(),
                           wd, o_.eps(), o_.name() == "adamw", found_inf, grad_scale);
      else
        compat::fused_sgd(with_wd(p), with_wd(g), with_wd(m), wd, o_.momentum(), lr_t_, found_inf);
    }
    // LibTorch's fused kernels leave the version counters as they were
    // (GradSync reads them to tell whether its bf16 copies are stale).
    for (const auto& t : p) torch::autograd::impl::bump_version(t);
    return;
  }
  TORCH_CHECK(!grad_scale.defined(), "FlatOptimizer: a gradient scale needs the fused Adam kernels");
  for (size_t i = 0; i < p.size(); ++i) {
    const double wd = weight_decay[i];
    torch::Tensor grad = g[i];
    if (!adam_) {
      // torch::optim::SGD (dampening 0, no Nesterov); a zero buffer makes the
      // first step's buf equal the gradient, as its clone does.
      if (wd != 0) grad = grad.add(p[i], wd);
      if (o_.momentum() != 0) grad = m[i].mul_(o_.momentum()).add_(grad);
      p[i].add_(grad, -lr_);
      continue;
    }
    // torch::optim::Adam / AdamW, whole tensor at once.
    const double bc1 = 1 - std::pow(o_.beta1(), static_cast<double>(host_step));
    const double bc2 = 1 - std::pow(o_.beta2(), static_cast<double>(host_step));
    if (o_.name() == "adamw") {
      if (wd != 0) p[i].mul_(1 - lr_ * wd);
    } else if (wd != 0) {
      grad = grad.add(p[i], wd);
    }
    m[i].mul_(o_.beta1()).add_(grad, 1 - o_.beta1());
    v[i].mul_(o_.beta2()).addcmul_(grad, grad, 1 - o_.beta2());
    auto denom = (v[i].sqrt() / std::sqrt(bc2)).add_(o_.eps());
    p[i].addcdiv_(m[i], denom, -lr_ / bc1);
  }
}

// The common step: every buffer whole, with the buffers' step count.
void FlatOptimizer::whole_step(const torch::Tensor& found_inf, const torch::Tensor& grad_scale,
                               const std::vector<torch::Tensor>& p16) {
  if (!fused_) {
    update(sp_, sg_, m_, v_, {}, weight_decay_, ++host_step_, {});
    return;
  }
  for (auto& s : step_) s.add_(1);
  update(sp_, sg_, m_, v_, step_, weight_decay_, 0, found_inf, grad_scale, p16);
  // A skipped (overflowed) step does not count, as in PyTorch's GradScaler.
  if (found_inf.defined())
    for (auto& s : step_) s.sub_(found_inf.squeeze());  // [1] -> [] (view({}) would pick the dtype overload)
}

void FlatOptimizer::step(const torch::Tensor& found_inf, double max_grad_norm, GradientsAfterStep after) {
  torch::NoGradGuard no_grad;
  wait_for_parameters();  // the last step's gather still reads (root) or writes the parts this one updates
  check_user(fused_ || !found_inf.defined(), "fp16 loss scaling needs the fused CUDA optimizers of LibTorch 2.2 or later.",
             "use --amp bf16 (or off) with this build.");
  // The whole step's gradients are scaled in the Adam kernels' own pass;
  // the fix-ups below then read them already scaled.
  const torch::Tensor grad_scale = max_grad_norm > 0 ? clip(max_grad_norm) : torch::Tensor();
  const GradUsage* usage = sync_ ? &sync_->usage() : nullptr;
  const size_t n = slices_.size();
  std::vector<char> unused_here(n, 0);
  if (usage)
    for (size_t i : usage->unused_here) unused_here[i] = 1;
  auto save = [&](size_t i, bool unused) {
    return Saved{i, unused, part(sp_, i).clone(), part(m_, i).clone(), adam_ ? part(v_, i).clone() : torch::Tensor()};
  };
  whole_m_.clear();
  whole_v_.clear();
  std::vector<Saved> saved;
  if (fused_) {
    // Which parameters no rank used is device data here: save every one
    // this rank did not use, and (Adam) every one that may have missed a
    // step before, whose own step count may then differ from the buffer's.
    for (size_t i = 0; i < n; ++i)
      if (unused_here[i] || (adam_ && may_have_missed_[i])) saved.push_back(save(i, unused_here[i]));
    // A fix-up that steps a parameter again on its own reads its clipped
    // gradient; the others only put values back.
    store_clipped_ = after == GradientsAfterStep::kRead ||
                     std::any_of(saved.begin(), saved.end(), [&](const Saved& s) { return adam_ && may_have_missed_[s.slice]; });
    const auto p16 = bf16_targets();
    whole_step(found_inf, grad_scale, p16);
    if (!saved.empty()) fused_fix_ups(saved, usage ? usage->used_anywhere : torch::Tensor(), found_inf, p16);
    for (size_t i = 0; i < n; ++i) may_have_missed_[i] = may_have_missed_[i] || unused_here[i];
    if (shard_) gather_parameters();
    // The kernel wrote the next step's bf16 copies, and the fix-ups theirs.
    if (!p16.empty()) sync_->bf16_copies_written();
    return;
  }
  // Composed: the ranks' decision on the host (a parameter unused on every
  // rank is unused here, so only this rank's unused ones need a look), so
  // that every rank takes the same path and ends with the same bits.
  std::vector<char> skipped(n, 0);
  if (usage && !usage->unused_here.empty()) {
    torch::Tensor flags;
    if (usage->used_anywhere.defined()) flags = usage->used_anywhere.to(torch::kCPU, torch::kFloat).contiguous();
    for (size_t i : usage->unused_here) skipped[i] = !flags.defined() || flags.data_ptr<float>()[i] <= 0;
  }
  for (size_t i = 0; i < n; ++i)
    if (skipped[i] || (adam_ && host_missed_[i] > 0)) saved.push_back(save(i, skipped[i]));
  whole_step({}, {});
  if (!saved.empty()) composed_fix_ups(saved, skipped);
  if (shard_) gather_parameters();
}

// Every rank's updated part to every rank, started: the host goes on
// (the next batch, logging) while the parts travel, until a reader of the
// parameters calls wait_for_parameters(). Under a CUDA graph capture the
// wait is recorded in the graph at once (a replay must end gathered).
void FlatOptimizer::gather_parameters() {
  gathers_ = start_broadcast_parts(params_, sp_, part_starts_);
  if (compat::stream_capturing()) wait_for_parameters();
}

FlatOptimizer::~FlatOptimizer() {
  for (auto& pieces : gathers_)
    for (auto& piece : pieces) try {
        piece.work->wait();
      } catch (...) {
      }
}

void FlatOptimizer::split_gather_at(std::vector<std::vector<std::pair<int64_t, int64_t>>> part_starts) {
  part_starts_ = std::move(part_starts);
}

void FlatOptimizer::wait_for_parameters() {
  for (size_t k = 0; k < gathers_.size(); ++k) wait_for_buffer(k);
  gathers_.clear();
}

void FlatOptimizer::wait_for_buffer(size_t k) { wait_for_range(k, 0, params_[k].numel()); }

// The broadcasts wrote the flat parameters where no version counter sees
// it: bumped here, where the data is known to be written, so that
// GradSync's bf16 copies count as stale.
void FlatOptimizer::wait_for_range(size_t k, int64_t lo, int64_t len) {
  if (k >= gathers_.size() || gathers_[k].empty() || len <= 0) return;
  auto& pieces = gathers_[k];
  const size_t before = pieces.size();
  for (auto it = pieces.begin(); it != pieces.end();) {
    if (it->lo < lo + len && lo < it->lo + it->len) {
      shard_->wait(it->work, "the sharded optimizer's parameter gather (--shard-optimizer)");
      it = pieces.erase(it);
    } else {
      ++it;
    }
  }
  if (pieces.size() == before) return;
  torch::autograd::impl::bump_version(params_[k]);
  pieces_waited_ += static_cast<int64_t>(before - pieces.size());
  if (pieces.empty()) ++buffers_waited_;
}

int64_t FlatOptimizer::pieces_pending() const {
  int64_t n = 0;
  for (const auto& p : gathers_) n += static_cast<int64_t>(p.size());
  return n;
}

std::vector<int64_t> FlatOptimizer::pending_parts() const {
  std::vector<int64_t> parts;
  for (const auto& pieces : gathers_)
    for (const auto& piece : pieces) parts.push_back(piece.part);
  return parts;
}

bool FlatOptimizer::parameters_pending() const {
  return std::any_of(gathers_.begin(), gathers_.end(), [](const Pending& p) { return !p.empty(); });
}

// After the whole-buffer step on the fused path: each saved parameter goes
// back to where the step began, is stepped again on its own slice with its
// own step count if it may have missed a step, and keeps that result only
// where some rank had a gradient (a select on the device).
void FlatOptimizer::fused_fix_ups(std::vector<Saved>& saved, const torch::Tensor& used_anywhere,
                                  const torch::Tensor& found_inf, const std::vector<torch::Tensor>& p16) {
  // The slices changed here get their bf16 copies (p16) again (the kernel
  // wrote the whole step's), so the copies stay equal to the parameters.
  auto refresh_bf16 = [&](size_t i, const torch::Tensor& p) {
    if (!p16.empty()) slice(p16, i).copy_(p);
  };
  for (auto& s : saved) {
    const size_t i = s.slice;
    auto p = part(sp_, i), g = part(sg_, i), m = part(m_, i);
    auto v = adam_ ? part(v_, i) : torch::Tensor();
    // Missed steps count only in steps that count (not an fp16 overflow).
    auto count_missed = [&](const torch::Tensor& missed) {
      if (!adam_) return;
      missed_[i].add_(found_inf.defined() ? missed * (1 - found_inf.squeeze()) : missed);
    };
    if (s.unused_here && !used_anywhere.defined()) {  // one rank: unused everywhere
      p.copy_(s.p);
      m.copy_(s.m);
      if (adam_) v.copy_(s.v);
      count_missed(torch::ones({}, missed_.empty() ? p.options() : missed_[i].options()));
      refresh_bf16(i, p);
      continue;
    }
    if (adam_ && may_have_missed_[i]) {
      p.copy_(s.p);
      m.copy_(s.m);
      v.copy_(s.v);
      torch::sub_out(own_step_[i], step_[slices_[i].flat], missed_[i]);
      update({p}, {g}, {m}, {v}, {own_step_[i]}, {weight_decay_[slices_[i].flat]}, 0, found_inf);
    }
    if (s.unused_here) {
      const auto skip = used_anywhere.select(0, static_cast<int64_t>(i)).le(0);
      p.copy_(torch::where(skip, s.p, p));
      m.copy_(torch::where(skip, s.m, m));
      if (adam_) {
        v.copy_(torch::where(skip, s.v, v));
        count_missed(skip.to(torch::kFloat));
      }
    }
    refresh_bf16(i, p);
  }
}

// The flat bf16 copies ddptrain's Adam kernel writes, one per flat buffer
// (all defined), or none: not that kernel, no GradSync, or no copies yet.
std::vector<torch::Tensor> FlatOptimizer::bf16_targets() const {
  if (!own_adam_ || !sync_ || shard_) return {};
  std::vector<torch::Tensor> out;
  for (size_t k = 0; k < params_.size(); ++k) {
    auto t = sync_->bf16_flat(k);
    if (!t.defined()) return {};
    out.push_back(t);
  }
  return out;
}

// After the whole-buffer step on the composed path, where `skipped` is the
// ranks' agreed decision: restore the skipped parameters, and step the ones
// that missed steps before again with their own count.
void FlatOptimizer::composed_fix_ups(std::vector<Saved>& saved, const std::vector<char>& skipped) {
  for (auto& s : saved) {
    const size_t i = s.slice;
    auto p = part(sp_, i), m = part(m_, i);
    auto v = adam_ ? part(v_, i) : torch::Tensor();
    p.copy_(s.p);
    m.copy_(s.m);
    if (adam_) v.copy_(s.v);
    if (skipped[i]) {
      ++host_missed_[i];
      continue;
    }
    update({p}, {part(sg_, i)}, {m}, {v}, {}, {weight_decay_[slices_[i].flat]}, host_step_ - host_missed_[i], {});
  }
}

// The optimizer state's layout in a checkpoint: each parameter's moments in
// its logical order (row-major over its shape, as the model's weights are
// saved), whatever memory format this run gave its 4-D weights. A resume
// with another --channels-last (auto flips it between CPU and GPU) then
// reads them right. Older checkpoints hold the writer's memory format,
// "channels_last" or "contiguous", which load_checkpoint() tells from
// their header.
namespace {
constexpr const char* kLogicalLayout = "logical";
}

// Flat buffer k of `flat` with every parameter's elements in `to_channels_last`
// order (or logical, contiguous order), on the CPU; `from_channels_last` says
// which order `flat` holds them in.
torch::Tensor FlatOptimizer::relaid(const torch::Tensor& flat, size_t k, bool from_channels_last,
                                    bool to_channels_last) const {
  auto out = flat.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
  if (!sync_ || from_channels_last == to_channels_last) return out;
  for (size_t i = 0; i < slices_.size(); ++i) {
    if (slices_[i].flat != k) continue;
    auto dst = sync_->param_view(out, i, to_channels_last);
    if (dst.dim() == 4) dst.copy_(sync_->param_view(flat, i, from_channels_last));
  }
  return out;
}

bool FlatOptimizer::channels_last() const { return sync_ && sync_->options().channels_last(); }

void FlatOptimizer::gather_state() {
  if (!shard_) return;
  torch::NoGradGuard no_grad;
  wait_for_parameters();  // a checkpoint follows, which writes the parameters too
  whole_m_.clear();
  whole_v_.clear();
  for (const auto& p : params_) {
    whole_m_.push_back(torch::zeros_like(p));
    if (adam_) whole_v_.push_back(torch::zeros_like(p));
  }
  broadcast_parts(whole_m_, m_);
  if (adam_) broadcast_parts(whole_v_, v_);
}

int64_t FlatOptimizer::state_bytes() const {
  int64_t n = 0;
  for (const auto* list : {&m_, &v_, &step_})
    for (const auto& t : *list) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

int64_t FlatOptimizer::unsharded_state_bytes() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel() * static_cast<int64_t>(p.element_size()) * (adam_ ? 2 : 1);
  for (const auto& s : step_) n += s.numel() * static_cast<int64_t>(s.element_size());
  return n;
}

void FlatOptimizer::save(TensorMap& state) const {
  TORCH_CHECK(!parameters_pending(),
              "FlatOptimizer: saved while the parameters are still being gathered; call wait_for_parameters() "
              "(or gather_state()) on every rank first");
  TORCH_CHECK(!shard_ || whole_m_.size() == m_.size(),
              "FlatOptimizer: a sharded state is saved after gather_state() on every rank");
  const auto& m_all = shard_ ? whole_m_ : m_;
  const auto& v_all = shard_ ? whole_v_ : v_;
  state["name"] = string_tensor(o_.name());
  // The buffers' layout: with no_decay_1d the 1-D parameters have their own.
  state["no_decay_1d"] = torch::full({}, o_.no_decay_1d() ? 1.0f : 0.0f);
  if (!o_.no_decay().empty()) state["no_decay"] = string_tensor(joined_names(o_.no_decay()));
  state["layout"] = string_tensor(kLogicalLayout);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto k = std::to_string(i);
    // The composed path counts on the host; the fused one on the device.
    auto step = fused_ ? step_[i].detach().cpu() : torch::full({}, static_cast<double>(host_step_), torch::kFloat);
    state["step/" + k] = step;
    state["m/" + k] = relaid(m_all[i], i, channels_last(), false);
    if (adam_) state["v/" + k] = relaid(v_all[i], i, channels_last(), false);
  }
  // Steps each parameter missed (no gradient on any rank): Adam's
  // per-parameter step count is the buffer's minus this.
  auto missed = torch::zeros({static_cast<int64_t>(slices_.size())}, torch::kFloat);
  for (size_t i = 0; i < slices_.size(); ++i)
    missed[static_cast<int64_t>(i)] = missed_.empty() ? static_cast<float>(host_missed_[i]) : missed_[i].item<float>();
  state["missed_steps"] = missed;
}

void FlatOptimizer::load(const TensorMap& state) {
  wait_for_parameters();  // a resume writes the parameters next
  auto name = state.find("name");
  check_user(name != state.end() && tensor_string(name->second) == o_.name(),
             "the checkpoint's optimizer state is not for --optimizer " + o_.name() + ".",
             "resume with the optimizer that wrote it.");
  // Checkpoints written before no_decay_1d existed decayed every parameter.
  auto grouping = state.find("no_decay_1d");
  const bool apart = grouping != state.end() && grouping->second.item<float>() != 0;
  check_user(apart == o_.no_decay_1d(),
             std::string("the checkpoint's optimizer state ") +
                 (apart ? "leaves the 1-D parameters (biases, norm weights) undecayed; this run decays every parameter."
                        : "decays every parameter; this run leaves the 1-D ones (biases, norm weights) undecayed, as "
                          "nanoGPT."),
             "resume with the ddptrain that wrote it (--task lm decayed every parameter before it followed nanoGPT), "
             "or start without --resume.");
  // Checkpoints written before no_decay existed exempted no parameter by name.
  auto named = state.find("no_decay");
  const std::string saved_names = named == state.end() ? "" : tensor_string(named->second);
  check_user(saved_names == joined_names(o_.no_decay()),
             "the checkpoint's optimizer state exempts {" + saved_names + "} from weight decay by name; this run "
                 "exempts {" + joined_names(o_.no_decay()) + "}.",
             "resume with the configure_optimizer() that wrote it, or start without --resume.");
  // The order the moments are in: logical, or an older writer's memory
  // format; a state of no record (not from a checkpoint) is in this run's.
  bool saved_channels_last = channels_last();
  if (auto layout = state.find("layout"); layout != state.end()) {
    const std::string l = tensor_string(layout->second);
    check_user(l == kLogicalLayout || l == "channels_last" || l == "contiguous",
               "the checkpoint's optimizer state has the layout '" + l + "', which this ddptrain does not know.",
               "resume with the ddptrain that wrote it.");
    saved_channels_last = l == "channels_last";
  }
  torch::NoGradGuard no_grad;
  auto read = [&](const std::string& key, torch::Tensor& dst, size_t flat = SIZE_MAX) {
    auto src = state.find(key);
    check_user(src != state.end() && src->second.sizes() == dst.sizes(),
               "the checkpoint's optimizer state '" + key + "' does not fit this model.",
               "resume with the model and optimizer that wrote it.");
    if (flat == SIZE_MAX) dst.copy_(src->second);
    else dst.copy_(relaid(src->second.contiguous(), flat, saved_channels_last, channels_last()));
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto k = std::to_string(i);
    read("step/" + k, step_[i]);
    // The whole buffer's state, of which this rank keeps its part.
    auto whole = torch::empty_like(params_[i]);
    read("m/" + k, whole, i);
    m_[i].copy_(whole.narrow(0, lo_[i], len_[i]));
    if (adam_) {
      read("v/" + k, whole, i);
      v_[i].copy_(whole.narrow(0, lo_[i], len_[i]));
    }
  }
  host_step_ = static_cast<int64_t>(step_.front().item<float>());
  // Checkpoints written before per-parameter counts have none: no missed steps.
  auto missed = state.find("missed_steps");
  const bool have = missed != state.end();
  check_user(!have || missed->second.numel() == static_cast<int64_t>(slices_.size()),
             "the checkpoint's optimizer state 'missed_steps' does not fit this model.",
             "resume with the model and optimizer that wrote it.");
  for (size_t i = 0; i < slices_.size(); ++i) {
    const float m = have ? missed->second.reshape(-1)[static_cast<int64_t>(i)].item<float>() : 0.0f;
    host_missed_[i] = static_cast<int64_t>(m);
    may_have_missed_[i] = m > 0;
    if (!missed_.empty()) missed_[i].fill_(m);
  }
}

}  // namespace ddp
