// Bucketed, overlapped gradient all-reduce over a flat gradient buffer.
#include "ddp/dist/grad_sync.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "ddp/dist/param_slots.h"
#include "ddp/error.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/side_stream.h"
#endif

namespace ddp {
namespace {

// param_slots.h's lookup: each live GradSync's parameters, by tensor. A
// parameter keeps its TensorImpl when GradSync moves its data into the flat
// buffer (set_data), so the key holds for the GradSync's life.
struct SlotRegistry {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, std::pair<GradSync*, size_t>> where;
};
SlotRegistry& slot_registry() {
  static auto* r = new SlotRegistry;  // kept for the process: autograd threads may outlive main's statics
  return *r;
}

// A tensor over `view`'s memory, with its shape and strides, that is not an
// autograd view of it: autograd's gradient accumulation adopts such a tensor
// as .grad instead of copying it (it copies views and shared tensors).
torch::Tensor same_memory(const torch::Tensor& view) {
  return torch::empty({0}, view.options()).set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

bool is_same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.scalar_type() == b.scalar_type() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

// Runs after a parameter's AccumulateGrad node has added this step's gradient
// into .grad, so the bucket's bytes are final when the count reaches zero.
// (A tensor hook would run before accumulation and race with the all-reduce.)
struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::function<void()> f) : fire(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fire();
    return outputs;
  }
  std::function<void()> fire;
};

// A view of `numel` elements of `flat` at `offset` with the shape of `like`;
// 4-D tensors get channels-last strides when asked.
torch::Tensor shaped_view(const torch::Tensor& flat, int64_t offset, const torch::Tensor& like, bool channels_last) {
  auto slice = flat.narrow(0, offset, like.numel());
  if (!channels_last || like.dim() != 4) return slice.view(like.sizes());
  const int64_t c = like.size(1), h = like.size(2), w = like.size(3);
  return slice.as_strided(like.sizes(), {c * h * w, 1, w * c, c});
}

// Per parameter: dtype, requires_grad, number of dims, then up to kMaxDims
// sizes. A row of zeros stands for "no parameter here".
constexpr int64_t kMaxDims = 6;
constexpr int64_t kSignature = 3 + kMaxDims;

torch::Tensor signatures(const std::vector<torch::Tensor>& params) {
  auto sig = torch::zeros({static_cast<int64_t>(params.size()), kSignature}, torch::kLong);
  auto a = sig.accessor<int64_t, 2>();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    a[i][0] = static_cast<int64_t>(p.scalar_type()) + 1;
    a[i][1] = p.requires_grad() ? 1 : 0;
    a[i][2] = p.dim();
    for (int64_t d = 0; d < std::min<int64_t>(p.dim(), kMaxDims); ++d) a[i][3 + d] = p.size(d);
  }
  return sig;
}

std::string describe_signature(const torch::Tensor& row) {
  auto r = row.accessor<int64_t, 1>();
  if (r[0] == 0) return "missing";
  std::string s = "[";
  for (int64_t d = 0; d < std::min<int64_t>(r[2], kMaxDims); ++d) s += (d ? ", " : "") + std::to_string(r[3 + d]);
  s += "] ";
  s += c10::toString(static_cast<c10::ScalarType>(r[0] - 1));
  if (!r[1]) s += " frozen";
  return s;
}

// Every rank must hold the same parameters in the same order, as PyTorch's
// DDP checks at construction: otherwise the broadcast and the buckets pair
// unrelated tensors, or wait for collectives that never come. Rank 0's
// signatures go to every rank, each compares its own, and all agree on the
// first difference (lowest parameter, then lowest rank), so that every rank
// throws the same error and none is left waiting.
// The tensors that `names` name among the model's parameters (a tied one
// under either of its names). A name the model lacks is the caller's typo.
std::set<const void*> parameters_named(torch::nn::Module& model, const std::vector<std::string>& names) {
  std::set<const void*> out;
  std::set<std::string> unfound(names.begin(), names.end());
  for (const auto& item : model.named_parameters())
    if (std::find(names.begin(), names.end(), item.key()) != names.end()) {
      out.insert(item.value().unsafeGetTensorImpl());
      unfound.erase(item.key());
    }
  if (!unfound.empty()) {
    std::string known;
    for (const auto& item : model.named_parameters()) known += (known.empty() ? "" : ", ") + item.key();
    throw UserError("no parameter named '" + *unfound.begin() + "' to keep apart from weight decay; the model's are " +
                        known + ".",
                    "name parameters as named_parameters() does, e.g. 'tok_emb.weight'.");
  }
  return out;
}

void check_same_parameters(torch::nn::Module& model, World& world) {
  const auto named = model.named_parameters();
  std::vector<torch::Tensor> params;
  for (const auto& item : named) params.push_back(item.value());
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(world.device());
  const auto mine = signatures(params);
  auto count = torch::full({1}, mine.size(0), on);
  world.broadcast(count, 0, "parameter count");
  const int64_t n0 = count.cpu().item<int64_t>();
  auto theirs = world.is_main() ? mine.to(world.device()) : torch::zeros({n0, kSignature}, on);
  world.broadcast(theirs, 0, "parameter signatures");
  theirs = theirs.cpu();
  const int64_t n = mine.size(0), none = std::max(n, n0) + 1;
  int64_t first = none;
  for (int64_t i = 0; i < std::max(n, n0) && first == none; ++i)
    if (i >= n || i >= n0 || !torch::equal(mine[i], theirs[i])) first = i;
  auto where = torch::full({1}, first * world.size() + world.rank(), on);
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  if (first == none) where.fill_(big);
  world.all_reduce(where, "parameter check", c10d::ReduceOp::MIN);
  const int64_t agreed = where.cpu().item<int64_t>();
  if (agreed == big) return;
  const int64_t index = agreed / world.size();
  const int rank = static_cast<int>(agreed % world.size());
  auto row = index < n ? mine[index].clone() : torch::zeros({kSignature}, torch::kLong);
  auto row_dev = row.to(world.device());
  world.broadcast(row_dev, rank, "differing parameter");
  row = row_dev.cpu();
  const std::string name = world.share_string(
      "differing parameter", index < n ? named[index].key() : "(none: rank " + std::to_string(world.rank()) +
                                                                " has " + std::to_string(n) + " parameters)",
      rank);
  throw UserError("the model on rank " + std::to_string(rank) + " differs from rank 0's at parameter " +
                      std::to_string(index) + " '" + name + "': " + describe_signature(row) + " on rank " +
                      std::to_string(rank) + ", " +
                      describe_signature(index < n0 ? theirs[index] : torch::zeros({kSignature}, torch::kLong)) +
                      " on rank 0.",
                  "every rank must build the same model (same flags, same code, same parameter order).");
}

}  // namespace

ShardRange shard_range(int64_t n, int ranks, int rank) {
  const int64_t chunk = (n + ranks - 1) / ranks;
  const int64_t lo = std::min(n, rank * chunk);
  return ShardRange{lo, std::min(n, lo + chunk) - lo};
}

GradientReduction sharded_reduction(const World& world) {
  return world.has_reduce_scatter() ? GradientReduction::kReduceScatter : GradientReduction::kAllReduce;
}

std::string describe(GradientReduction r, const World& world) {
  if (world.size() == 1) return "not reduced (one rank)";
  if (r != GradientReduction::kReduceScatter)
    return "all-reduced whole (the " + world.backend_name() + " backend has no reduce_scatter here)";
  return world.has_reduce_scatter() ? "reduce-scattered (" + world.backend_name() + " reduce_scatter)"
                                    : "reduce-scattered (one " + world.backend_name() + " reduce per rank's part)";
}

GradSync::GradSync(torch::nn::Module& model, World& world, GradSyncOptions options)
    : world_(world),
      options_(options),
      sharded_((options.reduction() == GradientReduction::kReduceScatter || options.shard_gradients()) &&
               world.size() > 1),
      zero2_(options.shard_gradients() && world.size() > 1) {
  // A tensor registered under two names (a tied embedding and output head)
  // is one parameter: it gets one slice, and autograd sums both uses into it.
  std::set<const void*> seen;
  for (auto& p : model.parameters())
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params_.push_back(p);
  buffers_ = model.buffers();
  if (world_.size() > 1) check_same_parameters(model, world_);

  if (options_.broadcast_at_start() && world_.size() > 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : model.parameters()) {
      auto d = p.data();
      world_.broadcast(d, 0, "initial parameters");
    }
    broadcast_buffers();
  }

  // Group by (dtype, device, and whether put apart: 1-D with separate_1d,
  // or named in separate_names); within a group, reverse registration order.
  const std::set<const void*> named_apart = parameters_named(model, options_.separate_names());
  std::map<std::tuple<int, std::string, bool>, std::vector<size_t>> groups;
  for (size_t i = params_.size(); i-- > 0;) {
    const auto& p = params_[i];
    const bool apart = (options_.separate_1d() && p.dim() < 2) || named_apart.count(p.unsafeGetTensorImpl()) > 0;
    groups[{static_cast<int>(p.scalar_type()), p.device().str(), apart}].push_back(i);
  }
  bucket_of_.assign(params_.size(), 0);
  grad_views_.assign(params_.size(), torch::Tensor());
  const int64_t cap_bytes = static_cast<int64_t>(options_.bucket_cap_mb() * 1024 * 1024);
  // With several ranks, the last bucket also carries one "used" flag per
  // parameter (see the header): its buffer gets them as a tail that the
  // bucket's all-reduce covers and flat_grads() (what clipping and the
  // optimizer see) does not.
  const int64_t num_flags = world_.size() > 1 ? static_cast<int64_t>(params_.size()) : 0;
  slices_.assign(params_.size(), ParamSlice());
  fired_.assign(params_.size(), 0);
  torch::Tensor last_storage;
  for (auto it = groups.begin(); it != groups.end(); ++it) {
    const auto& members = it->second;
    const bool last_group = std::next(it) == groups.end();
    const auto& first = params_[members.front()];
    // Every slice starts on a 256-byte boundary: cuDNN and vectorised
    // kernels fault on (or slow down for) misaligned tensors. The padding is
    // zero in both buffers, so sums and optimizer steps leave it zero.
    const int64_t align = std::max<int64_t>(1, 256 / static_cast<int64_t>(first.element_size()));
    auto padded = [align](int64_t n) { return (n + align - 1) / align * align; };
    int64_t total = 0;
    for (size_t i : members) total += padded(params_[i].numel());
    // ZeRO-2: this rank's part only; the flags on their own.
    const auto own = shard_range(total, world_.size(), world_.rank());
    auto storage = zero2_ ? torch::Tensor() : torch::zeros({total + (last_group ? num_flags : 0)}, first.options());
    auto flat = zero2_ ? torch::zeros({own.len}, first.options()) : storage.narrow(0, 0, total);
    own_lo_.push_back(own.lo);
    unsharded_grad_bytes_ += total * static_cast<int64_t>(first.element_size());
    auto flat_param = torch::zeros({total}, first.options());
    const size_t flat_index = flat_grads_.size();
    flat_grads_.push_back(flat);
    flat_params_.push_back(flat_param);
    flat_1d_.push_back(std::get<2>(it->first) ? 1 : 0);
    const int64_t elem = static_cast<int64_t>(flat.element_size());
    int64_t offset = 0;
    Bucket cur;
    cur.flat = flat_index;
    for (size_t i : members) {
      auto& p = params_[i];
      const int64_t n = padded(p.numel());
      if (cur.expected > 0 && (cur.numel + n) * elem > cap_bytes) {
        buckets_.push_back(cur);
        cur = Bucket();
        cur.flat = flat_index;
        cur.offset = offset;
      }
      // The parameter and its gradient live inside the flat buffers from now on.
      {
        torch::NoGradGuard no_grad;
        auto pv = shaped_view(flat_param, offset, p, options_.channels_last());
        pv.copy_(p.detach());
        p.set_data(pv);
      }
      p.mutable_grad() = zero2_ ? torch::Tensor() : shaped_view(flat, offset, p, options_.channels_last());
      grad_views_[i] = p.grad();
      slices_[i] = ParamSlice{flat_index, offset, p.numel()};
      bucket_of_[i] = buckets_.size();
      cur.numel += n;
      cur.expected += 1;
      offset += n;
    }
    if (cur.expected > 0) buckets_.push_back(cur);
    if (last_group && num_flags > 0) {
      used_flags_ = zero2_ ? torch::zeros({num_flags}, first.options()) : storage.narrow(0, total, num_flags);
      last_storage = storage;
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) buckets_[bucket_of_[i]].members.push_back(i);
  staged_.assign(params_.size(), 0);
  if (zero2_ && options_.gradient_norms() && options_.reduction() != GradientReduction::kReduceScatter)
    norms_.assign(params_.size(), torch::Tensor());
  for (auto& b : buckets_) {
    if (zero2_) continue;  // buffers made in each step (stage())
    b.view = flat_grads_[b.flat].narrow(0, b.offset, b.numel);
    if (sharded_) cut_parts(b, flat_grads_[b.flat], 0);
  }
  if (used_flags_.defined() && !zero2_) {
    auto& b = buckets_.back();
    b.view = last_storage.narrow(0, b.offset, b.numel + num_flags);
  }

  slot_taken_.assign(params_.size(), 0);
  {
    auto& r = slot_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (size_t i = 0; i < params_.size(); ++i) r.where[params_[i].unsafeGetTensorImpl()] = {this, i};
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<ReadyHook>([this, i] { mark_ready(i); })));
    accumulators_.push_back(std::move(acc));
  }
  reset_step();
}

GradSync::~GradSync() {
  {
    auto& r = slot_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (size_t i = 0; i < params_.size(); ++i) {
      auto it = r.where.find(params_[i].unsafeGetTensorImpl());
      if (it != r.where.end() && it->second.first == this) r.where.erase(it);
    }
  }
  // Wait for anything in flight so no collective outlives its buffer.
  for (auto& b : buckets_)
    for (auto& w : b.works) try { w->wait(); } catch (...) {}
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

// The bucket cut at the ranks' parts of its flat buffer, as views of
// `whole`, which holds the flat buffer's elements from `whole_offset` on.
void GradSync::cut_parts(Bucket& b, const torch::Tensor& whole, int64_t whole_offset) {
  b.parts.clear();
  const int64_t n = flat_params_[b.flat].numel();
  for (int r = 0; r < world_.size(); ++r) {
    const auto part = shard_range(n, world_.size(), r);
    const int64_t lo = std::clamp(part.lo, b.offset, b.offset + b.numel);
    const int64_t hi = std::clamp(part.lo + part.len, b.offset, b.offset + b.numel);
    b.parts.push_back(whole.narrow(0, lo - whole_offset, hi - lo));
    if (r == world_.rank()) b.own_lo = lo - b.offset;
  }
}

int64_t GradSync::gradient_bytes() const {
  int64_t n = 0;
  for (const auto& g : flat_grads_) n += g.numel() * static_cast<int64_t>(g.element_size());
  return n;
}

// ZeRO-2: parameter i's gradient into its bucket's buffer (made, zeroed,
// by the first), and .grad to none, so that autograd's tensor is freed. A
// parameter that got no gradient leaves zeros there.
void GradSync::stage(size_t i) {
  if (staged_[i]) return;
  auto& b = buckets_[bucket_of_[i]];
  torch::NoGradGuard no_grad;
  if (!b.staging.defined()) {
    // An all-reduced last bucket carries the used flags as its tail, as
    // without ZeRO-2: the same length, so that Gloo's ring cuts it, and so
    // sums it, the same way (with 3 ranks the order of a sum depends on it).
    const bool tail = flags_in_last_bucket() && &b == &buckets_.back();
    b.staging = torch::zeros({b.numel + (tail ? used_flags_.numel() : 0)}, flat_params_[b.flat].options());
    cut_parts(b, b.staging, b.offset);
    bucket_bytes_ += b.staging.numel() * static_cast<int64_t>(b.staging.element_size());
    peak_bucket_bytes_ = std::max(peak_bucket_bytes_, bucket_bytes_);
  }
  auto& p = params_[i];
  if (p.grad().defined()) {
#ifdef DDP_WITH_CUDA_KERNELS
    cuda::join_side_work();  // a weight gradient may still be in the making on the side stream
#endif
    shaped_view(b.staging, slices_[i].offset - b.offset, p, options_.channels_last()).copy_(p.grad());
    p.mutable_grad() = torch::Tensor();
  }
  staged_[i] = 1;
}

// ZeRO-2: waits for bucket j's reduction, averages, keeps this rank's part
// (and, asked, each parameter's norm over the whole bucket), frees the rest.
void GradSync::retire(size_t j) {
  auto& b = buckets_[j];
  wait_bucket(j, "gradient reduction (bucket " + std::to_string(j) + " of " + std::to_string(buckets_.size()) + ")");
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / world_.size();
  const auto& mine = b.parts[static_cast<size_t>(world_.rank())];
  if (options_.reduction() == GradientReduction::kReduceScatter) {
    mine.mul_(inv);
  } else {
    b.staging.mul_(inv);  // the whole bucket, as the unsharded run averages it
    if (b.staging.numel() > b.numel) used_flags_.copy_(b.staging.narrow(0, b.numel, used_flags_.numel()));
    if (options_.gradient_norms()) {
      std::vector<torch::Tensor> grads;
      for (size_t i : b.members) grads.push_back(b.staging.narrow(0, slices_[i].offset - b.offset, slices_[i].numel));
      const auto norms = compat::per_tensor_norms(grads);
      for (size_t k = 0; k < b.members.size(); ++k) norms_[b.members[k]] = norms[k];
    }
  }
  if (mine.numel() > 0) flat_grads_[b.flat].narrow(0, b.offset + b.own_lo - own_lo_[b.flat], mine.numel()).copy_(mine);
  bucket_bytes_ -= b.staging.numel() * static_cast<int64_t>(b.staging.element_size());
  b.staging = torch::Tensor();
  b.parts.clear();
  b.works.clear();
}

torch::Tensor GradSync::owned_gradients(size_t flat) const {
  const auto& g = flat_grads_.at(flat);
  if (!sharded_ || zero2_) return g;
  const auto part = shard_range(g.numel(), world_.size(), world_.rank());
  return g.narrow(0, part.lo, part.len);
}

void GradSync::wait_bucket(size_t i, const std::string& what) {
  for (const auto& w : buckets_[i].works) world_.wait(w, what);
}

torch::Tensor GradSync::param_view(const torch::Tensor& flat, size_t i, bool channels_last) const {
  return shaped_view(flat, slices_.at(i).offset, params_.at(i), channels_last);
}

void GradSync::reset_step() {
  for (auto& b : buckets_) {
    b.pending = b.expected;
    b.works.clear();
  }
  next_bucket_ = 0;
  retired_ = 0;
  std::fill(staged_.begin(), staged_.end(), 0);
  launched_in_backward_ = 0;
  std::fill(fired_.begin(), fired_.end(), 0);
  unreached_.assign(params_.size(), 0);
}

void GradSync::zero_grad(bool set_to_none) {
  torch::NoGradGuard no_grad;
  if (zero2_) {  // no views: .grad is none between synced backwards
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    if (!set_to_none)
      for (auto& f : flat_grads_) f.zero_();
  } else if (set_to_none) {
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  } else {
    for (auto& f : flat_grads_) f.zero_();
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = grad_views_[i];
  }
  std::fill(fired_.begin(), fired_.end(), 0);  // no gradient is there now
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(slot_taken_.begin(), slot_taken_.end(), 0);
}

// A parameter whose .grad is not its view (set to none, or replaced by the
// user) and that got no gradient this step: its slice may hold an older
// step's gradient. Zero it before it is all-reduced or stepped.
void GradSync::zero_slices_left_behind() {
  for (size_t i : usage_.unused_here) zero_slice_left_behind(i);
}

void GradSync::zero_slice_left_behind(size_t i) {
  if (zero2_) return;  // its bucket's buffer starts zeroed
  auto& p = params_[i];
  if (p.grad().defined() && p.grad().is_same(grad_views_[i])) return;
  torch::NoGradGuard no_grad;
  grad_views_[i].zero_();
  p.mutable_grad() = grad_views_[i];
}

void GradSync::expect_gradients_from(const torch::Tensor& loss) {
  if (!sync_enabled_ || world_.size() == 1 || !loss.grad_fn()) return;
  std::unordered_set<const torch::autograd::Node*> reached{loss.grad_fn().get()};
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    for (const auto& edge : node->next_edges())
      if (edge.function && reached.insert(edge.function.get()).second) todo.push_back(edge.function.get());
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (reached.count(accumulators_[i].get()) > 0 || unreached_[i]) continue;
    unreached_[i] = 1;
    // Its slice goes out with the bucket: no older step's gradient in it.
    if (!fired_[i]) zero_slice_left_behind(i);
    auto& b = buckets_[bucket_of_[i]];
    if (b.pending > 0) --b.pending;
  }
  launch_ready_in_order(/*from_backward=*/false);
}

void GradSync::abandon_step(bool wait_launched) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; wait_launched && i < buckets_.size(); ++i)
      wait_bucket(i, "gradient reduction of an abandoned step (bucket " + std::to_string(i) + ")");
    for (auto& b : buckets_) {
      b.staging = torch::Tensor();
      b.parts.clear();
    }
    bucket_bytes_ = 0;
    reset_step();
  }
  zero_grad();
}

void GradSync::mark_ready(size_t param_index) {
  // optimizer.zero_grad() sets gradients to None on LibTorch 2.x (and a user
  // may replace .grad): autograd then accumulated into a fresh tensor, not
  // into the flat buffer that is all-reduced and stepped. Copy it into its
  // slice and make .grad the view again, so nothing is silently lost.
  auto& p = params_[param_index];
  const auto& view = grad_views_[param_index];
  if (!zero2_ && (!p.grad().defined() || !p.grad().is_same(view))) {
    torch::NoGradGuard no_grad;
    // A gradient written into its slot (take_gradient_slot) is there already.
    if (!p.grad().defined()) view.zero_();
    else if (!is_same_memory(p.grad(), view)) view.copy_(p.grad());
    p.mutable_grad() = view;
  }
  if (!sync_enabled_ || world_.size() == 1) {
    fired_[param_index] = 1;  // nothing reads it before finish()
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Its bucket may be on the wire already, counted without it.
  TORCH_CHECK(!unreached_[param_index], "GradSync: parameter ", param_index,
              " got a gradient from a backward that expect_gradients_from() found not to reach it");
  fired_[param_index] = 1;
  if (zero2_) stage(param_index);
  auto& b = buckets_[bucket_of_[param_index]];
  if (b.pending > 0) --b.pending;
  launch_ready_in_order(/*from_backward=*/true);
}

void GradSync::launch_ready_in_order(bool from_backward) {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    auto& b = buckets_[next_bucket_];
    if (used_flags_.defined() && next_bucket_ + 1 == buckets_.size()) write_used_flags();
    // ZeRO-2: gradients that no hook of this backward handed over (kept in
    // .grad from earlier micro-steps), or zeros.
    if (zero2_)
      for (size_t i : b.members) stage(i);
#ifdef DDP_WITH_CUDA_KERNELS
    // Weight gradients may still be in the making on the side stream.
    cuda::join_side_work();
#endif
    if (!sharded_) {
      b.works.push_back(world_.all_reduce_async(b.view));
    } else {
      // The used flags go to every rank; the gradients each to their part's
      // owner, or (all-reduce on ZeRO-2) whole to every rank.
      if (used_flags_.defined() && next_bucket_ + 1 == buckets_.size()) {
        if (flags_in_last_bucket()) b.staging.narrow(0, b.numel, used_flags_.numel()).copy_(used_flags_);
        else b.works.push_back(world_.all_reduce_async(used_flags_));
      }
      if (options_.reduction() == GradientReduction::kReduceScatter) {
        auto more = world_.reduce_scatter_async(b.parts);
        b.works.insert(b.works.end(), more.begin(), more.end());
      } else {
        b.works.push_back(world_.all_reduce_async(b.staging));
      }
    }
    if (from_backward) ++launched_in_backward_;
    ++next_bucket_;
    // ZeRO-2: at most two buckets' buffers in flight behind the newest.
    while (zero2_ && retired_ + 2 < next_bucket_) retire(retired_++);
  }
}

// This rank's flags, written just before the last bucket's all-reduce
// carries them; by then every backward of the step has run here. Usually
// every hook fired: one fill. Otherwise one fill per run of used ones.
void GradSync::write_used_flags() {
  torch::NoGradGuard no_grad;
  const size_t n = fired_.size();
  if (std::all_of(fired_.begin(), fired_.end(), [](char f) { return f != 0; })) {
    used_flags_.fill_(1);
    return;
  }
  used_flags_.zero_();
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j < n && fired_[j]) ++j;
    if (j > i) used_flags_.narrow(0, static_cast<int64_t>(i), static_cast<int64_t>(j - i)).fill_(1);
    i = j + 1;
  }
}

void GradSync::finish() {
  usage_.unused_here.clear();
  for (size_t i = 0; i < fired_.size(); ++i)
    if (!fired_[i]) usage_.unused_here.push_back(i);
  usage_.used_anywhere = used_flags_;
  zero_slices_left_behind();
  if (world_.size() == 1) {
    reset_step();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Parameters that got no gradient this step still take part, with zeros.
    for (auto& b : buckets_) b.pending = 0;
    launch_ready_in_order(/*from_backward=*/false);
  }
  if (zero2_) {
    std::lock_guard<std::mutex> lock(mu_);
    while (retired_ < buckets_.size()) retire(retired_++);
    reset_step();
    return;
  }
  const double inv = 1.0 / world_.size();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    wait_bucket(i, std::string(sharded_ ? "gradient reduce-scatter" : "gradient all-reduce") + " (bucket " +
                       std::to_string(i) + " of " + std::to_string(buckets_.size()) + ")");
    // Sharded: only this rank's part holds the sum (the flags' need no average).
    (sharded_ ? buckets_[i].parts[static_cast<size_t>(world_.rank())] : buckets_[i].view).mul_(inv);
  }
  reset_step();
}

// ---- param_slots.h ----------------------------------------------------------

void GradSync::make_bf16_copies() {
  flat_bf16_.clear();
  for (const auto& flat : flat_params_)
    flat_bf16_.push_back(flat.scalar_type() == torch::kFloat
                             ? torch::empty(flat.sizes(), flat.options().dtype(torch::kBFloat16))
                             : torch::Tensor());
  bf16_views_.assign(params_.size(), torch::Tensor());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& s = slices_[i];
    if (flat_bf16_[s.flat].defined())
      bf16_views_[i] = shaped_view(flat_bf16_[s.flat], s.offset, params_[i], options_.channels_last());
  }
}

// The sum of the parameters' and the flat buffers' version counters: an
// in-place change to any of them raises it (the counters only grow).
int64_t GradSync::version_signature() const {
  int64_t sum = 0;
  for (const auto& p : params_) sum += static_cast<int64_t>(p._version());
  for (const auto& f : flat_params_) sum += static_cast<int64_t>(f._version());
  return sum;
}

// Casts the copies where they exist and are not current. Under a CUDA
// graph capture the cast is only recorded, to run at each replay: the host
// records nothing then (graph_replayed does, after a replay, from what the
// captured step does to the copies).
void GradSync::cast_stale_bf16_copies() {
  if (bf16_views_.empty() || bf16_signature_ == version_signature()) return;  // none, or current
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < flat_bf16_.size(); ++k)
    if (flat_bf16_[k].defined()) flat_bf16_[k].copy_(flat_params_[k]);
  if (compat::stream_capturing()) capture_casts_ = true;
  else bf16_signature_ = version_signature();
}

void GradSync::bf16_copies(bool open) {
  std::lock_guard<std::mutex> lock(mu_);
  // Allocated when the step that first asked ends, outside a capture where
  // it can be (a capture's allocations live in its graph's private pool).
  if (!open && bf16_wanted_ && bf16_views_.empty() && !compat::stream_capturing()) {
    make_bf16_copies();
    bf16_signature_ = -1;
  }
  if (open && compat::stream_capturing()) capture_casts_ = capture_writes_ = false;  // a capture's step begins
  if (open) cast_stale_bf16_copies();
  bf16_open_ = open;
}

bool GradSync::bf16_copies_current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !bf16_views_.empty() && bf16_signature_ == version_signature();
}

torch::Tensor GradSync::bf16_flat(size_t k) const {
  std::lock_guard<std::mutex> lock(mu_);
  return bf16_views_.empty() ? torch::Tensor() : flat_bf16_[k];
}

void GradSync::bf16_copies_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (bf16_views_.empty()) return;
  if (compat::stream_capturing()) capture_writes_ = true;
  else bf16_signature_ = version_signature();
}

void GradSync::before_graph_replay() {
  std::lock_guard<std::mutex> lock(mu_);
  // A captured step that casts at its start needs nothing; one that relies
  // on the copies being current gets a cast here where they are not.
  if (!capture_casts_) cast_stale_bf16_copies();
}

void GradSync::graph_replayed() {
  std::lock_guard<std::mutex> lock(mu_);
  // The replay changed the parameters without the host seeing it: the
  // copies are current only if the captured step wrote them (its
  // optimizer), else stale for the next eager step.
  bf16_signature_ = capture_writes_ ? version_signature() : -1;
}

void GradSync::refresh_bf16_copies() {
  std::lock_guard<std::mutex> lock(mu_);
  cast_stale_bf16_copies();
}

void GradSync::bf16_copies_stale() {
  std::lock_guard<std::mutex> lock(mu_);
  bf16_signature_ = -1;
}

torch::Tensor GradSync::bf16_copy(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!bf16_open_) return torch::Tensor();
  if (bf16_views_.empty()) {
    bf16_wanted_ = true;  // made when this window closes, used from the next step on
    return torch::Tensor();
  }
  return bf16_views_[index];
}

torch::Tensor GradSync::take_gradient_slot(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (zero2_ || slot_taken_[index] || params_[index].grad().defined()) return torch::Tensor();
  slot_taken_[index] = 1;
  return same_memory(grad_views_[index]);
}

size_t GradSync::gradient_slots_taken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<size_t>(std::count(slot_taken_.begin(), slot_taken_.end(), 1));
}

bool GradSync::has_bf16_copies() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !bf16_views_.empty();
}

namespace param_slots {
namespace {
template <typename F>
torch::Tensor ask(const torch::Tensor& param, F f) {
  if (!param.defined()) return torch::Tensor();
  auto& r = slot_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.where.find(param.unsafeGetTensorImpl());
  return it == r.where.end() ? torch::Tensor() : f(*it->second.first, it->second.second);
}
}  // namespace

torch::Tensor bf16_copy(const torch::Tensor& param) {
  return ask(param, [](GradSync& s, size_t i) { return s.bf16_copy(i); });
}

torch::Tensor take_gradient_slot(const torch::Tensor& param) {
  return ask(param, [](GradSync& s, size_t i) { return s.take_gradient_slot(i); });
}
}  // namespace param_slots

void GradSync::broadcast_buffers() {
  if (world_.size() == 1 || buffers_.empty()) return;
  torch::NoGradGuard no_grad;
  // One broadcast per dtype (BatchNorm: float statistics, int64 counters),
  // not one per buffer: this runs before every step with local batch norm.
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (auto& b : buffers_) by_dtype[b.scalar_type()].push_back(b);
  for (auto& [dtype, group] : by_dtype) {
    std::vector<torch::Tensor> flat;
    for (auto& b : group) flat.push_back(b.reshape(-1));
    auto all = torch::cat(flat);
    world_.broadcast(all, 0, "buffers");
    int64_t at = 0;
    for (auto& b : group) {
      b.copy_(all.slice(0, at, at + b.numel()).view_as(b));
      at += b.numel();
    }
  }
}

}  // namespace ddp
