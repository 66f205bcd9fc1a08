// Data-parallel gradient synchronisation: what DistributedDataParallel does
// in PyTorch, for a LibTorch module.
//
// At construction every parameter and buffer is broadcast from rank 0. Then
// each parameter becomes a view into one flat parameter buffer per dtype and
// its .grad a view into a flat gradient buffer of the same layout, so that an
// optimizer can update every parameter with a few kernels over two flat
// tensors (see flat_optimizer.h). With separate_1d, the parameters of fewer
// than 2 dimensions get flat buffers of their own, so that an optimizer can
// give them other settings (no weight decay); their buckets follow the
// others', and are small. With channels_last, 4-D weights get
// channels-last strides inside their slice. The gradient buffer is cut into buckets of at most `bucket_cap_mb`, filled in
// reverse registration order (the order backward produces gradients). A hook
// on each parameter's gradient accumulator counts down its bucket; when a
// bucket is complete its all-reduce starts at once, so communication overlaps
// the rest of backward. Buckets are launched strictly in index order on every
// rank, so collectives always match. finish() launches any bucket whose
// parameters got no gradient (they contribute zeros, as with
// find_unused_parameters), waits, and divides by the world size.
//
// Which parameters got a gradient: PyTorch leaves a parameter that got none
// on every rank untouched (its .grad stays None, so torch.optim skips it),
// while one that got a gradient on some rank only is stepped with the
// average. Each rank knows on the host which hooks fired; the ranks agree
// through one flag per parameter appended to the last bucket's all-reduce
// (no extra collective, and device data, so a captured graph replays it).
// With one rank the host's knowledge is the answer. The optimizer reads
// both (usage()). In a captured CUDA graph the parameters used are those of
// the captured step, as with PyTorch's static graphs.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "ddp/compat.h"
#include "ddp/dist/world.h"

namespace ddp {

/// How a bucket's gradients are summed over the ranks.
enum class GradientReduction {
  kAuto,           // TrainStep: kReduceScatter where the backend has one (sharded_reduction()), else kAllReduce
  kAllReduce,      // every rank gets the whole sum
  kReduceScatter,  // each rank gets the sum of its own part only (shard_range() of every flat buffer)
};

/// Rank `rank`'s part of a flat buffer of `n` elements sharded over
/// `ranks`: parts of ceil(n / ranks) elements in rank order, the last ones
/// shorter or empty. The sharded optimizer (flat_optimizer.h) steps this
/// part, and a reduce-scatter gives each rank the sum over it.
struct ShardRange {
  int64_t lo = 0, len = 0;
};
ShardRange shard_range(int64_t n, int ranks, int rank);

/// What a sharded optimizer's gradients take on `world`: kReduceScatter
/// where its backend has a reduce_scatter (NCCL in LibTorch 2.3+), else
/// kAllReduce, the closest correct one: Gloo in LibTorch 1.13 has no
/// reduce_scatter, and one reduce per part would sum in another order
/// than the unsharded run's all-reduce.
GradientReduction sharded_reduction(const World& world);
/// For the start line: "reduce-scattered (NCCL reduce_scatter)", ...
std::string describe(GradientReduction r, const World& world);

struct GradSyncOptions {
  /// Largest bucket, in MiB. PyTorch's default is 25.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Broadcast parameters and buffers from rank 0 at construction.
  TORCH_ARG(bool, broadcast_at_start) = true;
  /// Give 4-D parameters (convolution weights) channels-last strides, to
  /// match channels-last activations.
  TORCH_ARG(bool, channels_last) = false;
  /// Put the parameters of fewer than 2 dimensions (biases, norm weights)
  /// in flat buffers of their own, apart from the matrices and embeddings
  /// (for FlatOptimizerOptions::no_decay_1d).
  TORCH_ARG(bool, separate_1d) = false;
  /// Parameters by name (as named_parameters() gives them) that go in the
  /// 1-D parameters' buffers too, e.g. an embedding table (for
  /// FlatOptimizerOptions::no_decay). A name the model lacks is a UserError.
  TORCH_ARG(std::vector<std::string>, separate_names) = {};
  /// kReduceScatter (for a sharded optimizer, with several ranks): each
  /// bucket is reduce-scattered, so that after finish() each rank holds the
  /// average over its shard_range() of every flat gradient buffer only;
  /// the rest of the buffers holds unspecified values. kAuto is kAllReduce.
  TORCH_ARG(GradientReduction, reduction) = GradientReduction::kAllReduce;
  /// ZeRO-2 (with several ranks): no gradient buffer of the whole model.
  /// Each rank keeps a buffer of its shard_range() of every flat buffer;
  /// as backward hands a parameter its gradient, it is copied into its
  /// bucket's buffer (made then) and .grad is set to none; a complete
  /// bucket is reduced (reduction()), this rank's part copied out, and the
  /// bucket's buffer freed, at most two buckets behind the newest. Gradient
  /// memory per rank: 1/world-size, plus the buckets in flight. Kernels get
  /// no gradient slot (param_slots.h); with gradient accumulation the
  /// micro-steps but the last accumulate in .grad, whole, as usual.
  TORCH_ARG(bool, shard_gradients) = false;
  /// With shard_gradients and all-reduced buckets: each parameter's
  /// gradient norm is taken from the whole bucket before it is freed
  /// (gradient_norms()), so that clipping's norm is the unsharded one bit
  /// for bit.
  TORCH_ARG(bool, gradient_norms) = false;
};

/// Where one parameter lives in the flat buffers: `numel` elements of
/// buffer `flat` from `offset` (padding excluded).
struct ParamSlice {
  size_t flat = 0;
  int64_t offset = 0, numel = 0;
};

/// Which parameters got a gradient in the step that finish() completed.
struct GradUsage {
  /// Parameters (indices into param_slices()) whose gradient no backward of
  /// the step reached on this rank; empty when all were used.
  std::vector<size_t> unused_here;
  /// With several ranks: one float per parameter, on the gradients' device,
  /// positive where some rank produced a gradient (device data: no host
  /// sync). Undefined with one rank, where unused_here is unused everywhere.
  torch::Tensor used_anywhere;
};

class GradSync {
 public:
  GradSync(torch::nn::Module& model, World& world, GradSyncOptions options = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  /// Zeroes every gradient in place (the views stay views). With
  /// set_to_none, as PyTorch's optimizer.zero_grad(set_to_none=True): each
  /// .grad becomes undefined and nothing is written; the next backward then
  /// hands each parameter its first gradient (autograd keeps the tensor it
  /// made rather than adding it to zeros), which is copied into the flat
  /// slice, and .grad is the view again. Slices that got no gradient are
  /// zeroed in finish(). Fewer passes over the gradients: one copy, against
  /// a fill and an add.
  void zero_grad(bool set_to_none = false);

  /// While the returned guard lives, backward only accumulates locally; use it
  /// for every micro-step but the last of gradient accumulation.
  class NoSync {
   public:
    explicit NoSync(GradSync& s) : s_(s), before_(s.sync_enabled_) { s_.sync_enabled_ = false; }
    ~NoSync() { s_.sync_enabled_ = before_; }
   private:
    GradSync& s_;
    bool before_;
  };
  NoSync no_sync() { return NoSync(*this); }

  /// Before the step's last backward (the one that syncs): the parameters
  /// that `loss`'s autograd graph does not reach will get no gradient from
  /// it, so their buckets count them ready now, and a bucket that waited
  /// only for them is launched before backward starts, as PyTorch DDP marks
  /// unused parameters in prepare_for_backward. Without it such a bucket
  /// is launched in finish(), after any collective that the backward
  /// itself issues (SyncBatchNorm's all-reduce), while a rank that used the
  /// parameter launched it before: the ranks' collectives go out of order.
  void expect_gradients_from(const torch::Tensor& loss);

  /// Launches what backward did not, waits for every bucket and averages.
  /// Call after the last backward of a step and before the optimizer.
  void finish();

  /// Forgets a step that stopped part-way (a failed CUDA graph capture, an
  /// exception in backward): no bucket is left half-counted or launched, and
  /// the gradients are zero, so the next step runs as if this one had never
  /// begun. `wait_launched`: wait for buckets already launched, whose
  /// all-reduce still writes into the gradients; a failed capture passes
  /// false, as its collectives were only recorded, never run.
  void abandon_step(bool wait_launched = true);

  /// Copies every buffer (e.g. BatchNorm running stats) from rank 0.
  void broadcast_buffers();

  /// Opens (true) or closes (false) the window in which param_slots.h hands
  /// out bf16 copies of the parameters: open it at the start of a step's
  /// forward, close it after its last backward, before the optimizer
  /// changes the parameters. Opening casts the flat parameters to the bf16
  /// copies (one kernel per flat buffer) unless they are current
  /// (bf16_copies_current: the later micro-batches of a step, or a step
  /// after an optimizer that wrote them). The copies are made (allocated)
  /// when a window closes after some kernel asked for one, outside a CUDA
  /// graph capture; until then there are none.
  void bf16_copies(bool open);
  /// bf16_copies open (when `on`) for a scope, closed on the way out,
  /// exceptions included.
  class BF16Window {
   public:
    BF16Window(GradSync& s, bool on) : s_(s), on_(on) {
      if (on_) s_.bf16_copies(true);
    }
    ~BF16Window() {
      if (on_) s_.bf16_copies(false);
    }
   private:
    GradSync& s_;
    bool on_;
  };
  /// Whether the bf16 copies hold the parameters' values as far as the host
  /// can tell: cast, or written by the optimizer (bf16_copies_written), and
  /// no parameter or flat buffer changed in place since (by their version
  /// counters; a write through .data() is not seen, as autograd does not
  /// see it either).
  bool bf16_copies_current() const;
  /// Flat buffer k's bf16 copy (undefined until made), for an optimizer
  /// that writes the next step's copies as it updates the parameters.
  torch::Tensor bf16_flat(size_t k) const;
  /// The optimizer has written every copy from the parameters it updated
  /// (const: a record of what the copies hold, kept for a const holder).
  void bf16_copies_written() const;
  /// Casts the copies if they exist and are not current.
  void refresh_bf16_copies();
  /// Around a CUDA graph replay of a captured training step, which runs no
  /// host code (so no version counter moves): before, a cast where the
  /// captured step does not cast and the copies are not current; after,
  /// the copies are current if the captured step wrote them (the
  /// optimizer), else stale.
  void before_graph_replay();
  void graph_replayed();
  /// The copies no longer hold the parameters (e.g. a failed capture
  /// recorded a step that never ran, a checkpoint was loaded, or the
  /// parameters were written where their version counters do not see it:
  /// through .data(), set_data(), a collective or raw memory): the next
  /// window casts them.
  void bf16_copies_stale();

  /// param_slots.h's functions for this GradSync's parameter `index`.
  torch::Tensor bf16_copy(size_t index);
  torch::Tensor take_gradient_slot(size_t index);
  /// Gradient slots handed out since the last zero_grad, and whether the
  /// bf16 copies exist: what tests check to see that a model's kernels use
  /// them.
  size_t gradient_slots_taken() const;
  bool has_bf16_copies() const;

  /// Where each trainable parameter (in registration order) lives in the
  /// flat buffers.
  const std::vector<ParamSlice>& param_slices() const { return slices_; }
  /// Parameter i's elements inside `flat`, a tensor laid out like flat
  /// buffer param_slices()[i].flat, with the parameter's shape: 4-D ones
  /// with channels-last strides where `channels_last` (e.g. this run's,
  /// options().channels_last()), else contiguous.
  torch::Tensor param_view(const torch::Tensor& flat, size_t i, bool channels_last) const;
  /// Which parameters got a gradient in the last finished step (see above).
  const GradUsage& usage() const { return usage_; }

  size_t num_buckets() const { return buckets_.size(); }
  /// Buckets whose all-reduce started inside backward in this step so far
  /// (reset by finish()); lets tests prove that communication overlaps.
  size_t launched_during_backward() const { return launched_in_backward_; }
  /// The flat gradient buffers, one per (dtype, device), and with
  /// separate_1d also per kind (fewer than 2 dimensions or not); with
  /// shard_gradients, this rank's part of each (owned_gradients()).
  const std::vector<torch::Tensor>& flat_grads() const { return flat_grads_; }
  /// The flat parameter buffers, laid out like flat_grads().
  const std::vector<torch::Tensor>& flat_params() const { return flat_params_; }
  /// Whether flat buffer `flat` holds the parameters put apart: those of
  /// fewer than 2 dimensions (with separate_1d) and those of separate_names
  /// (false for every buffer when neither is set).
  bool holds_1d(size_t flat) const { return flat_1d_.at(flat) != 0; }
  const GradSyncOptions& options() const { return options_; }
  /// Whether finish() leaves each rank only its part of the gradients
  /// averaged (reduction() kReduceScatter with several ranks).
  bool gradients_sharded() const { return sharded_; }
  /// Whether this rank holds only its part of the gradients at all
  /// (shard_gradients with several ranks); then flat_grads() are those
  /// parts, and parameters' .grad are none after each synced backward.
  bool gradient_storage_sharded() const { return zero2_; }
  /// The ranks the gradients are sharded over (world size).
  int gradients_world_size() const { return world_.size(); }
  /// Per parameter (param_slices() order), its averaged gradient's L2 norm
  /// (a float scalar), taken as its bucket completed, with
  /// options().gradient_norms() on an all-reduced, sharded storage; empty
  /// otherwise. Valid after finish().
  const std::vector<torch::Tensor>& gradient_norms() const { return norms_; }
  /// Bytes of gradient buffers this rank keeps (flat_grads()), what it
  /// would keep unsharded, and the most bytes of bucket buffers alive at
  /// once so far (shard_gradients: the buckets in flight; else 0).
  int64_t gradient_bytes() const;
  int64_t unsharded_gradient_bytes() const { return unsharded_grad_bytes_; }
  int64_t peak_bucket_bytes() const { return peak_bucket_bytes_; }
  /// This rank's part of flat gradient buffer `flat` (shard_range()); the
  /// whole buffer when the gradients are not sharded.
  torch::Tensor owned_gradients(size_t flat) const;

 private:
  struct Bucket {
    size_t flat = 0;            // which flat buffer
    int64_t offset = 0, numel = 0;
    size_t expected = 0;        // parameters in this bucket
    size_t pending = 0;         // gradients still missing this step
    std::vector<c10::intrusive_ptr<compat::Work>> works;  // launched this step (empty: not yet)
    torch::Tensor view;
    std::vector<torch::Tensor> parts;  // sharded: each rank's part of the bucket (some empty)
    std::vector<size_t> members;       // its parameters
    torch::Tensor staging;             // shard_gradients: the bucket's gradients, while in flight
    int64_t own_lo = 0;                // shard_gradients: where this rank's part starts in the bucket
  };
  void mark_ready(size_t param_index);
  void zero_slices_left_behind();
  void zero_slice_left_behind(size_t i);
  void launch_ready_in_order(bool from_backward);
  void write_used_flags();
  void reset_step();
  void make_bf16_copies();
  void wait_bucket(size_t i, const std::string& what);
  void cut_parts(Bucket& b, const torch::Tensor& whole, int64_t whole_offset);
  void stage(size_t i);
  void retire(size_t j);
  bool flags_in_last_bucket() const {  // ZeRO-2 over an all-reduce
    return zero2_ && used_flags_.defined() && options_.reduction() != GradientReduction::kReduceScatter;
  }

  World& world_;
  GradSyncOptions options_;
  bool sharded_ = false;
  bool zero2_ = false;             // shard_gradients with several ranks
  std::vector<int64_t> own_lo_;    // zero2_: per flat buffer, where this rank's part starts
  std::vector<char> staged_;       // zero2_: param index -> its gradient is in its bucket's buffer this step
  size_t retired_ = 0;             // zero2_: buckets reduced and copied out this step
  std::vector<torch::Tensor> norms_;
  int64_t unsharded_grad_bytes_ = 0, bucket_bytes_ = 0, peak_bucket_bytes_ = 0;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> grad_views_;  // param index -> its slice of the flat gradients
  std::vector<size_t> bucket_of_;  // param index -> bucket
  std::vector<Bucket> buckets_;
  std::vector<torch::Tensor> flat_grads_;
  std::vector<torch::Tensor> flat_params_;
  std::vector<char> flat_1d_;  // per flat buffer: holds_1d()
  std::vector<torch::Tensor> buffers_;
  std::vector<ParamSlice> slices_;
  std::vector<char> fired_;   // param index -> its hook fired in this step (any micro-batch)
  std::vector<char> unreached_;  // param index -> counted ready by expect_gradients_from in this step
  torch::Tensor used_flags_;  // several ranks: one per parameter, after the last bucket
  GradUsage usage_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  size_t next_bucket_ = 0;
  size_t launched_in_backward_ = 0;
  bool sync_enabled_ = true;
  // param_slots.h: the bf16 copies (flat, laid out like flat_params_, and
  // one view per parameter), whether they are current, whether a kernel
  // asked for them; per parameter, whether its gradient slot was handed out
  // since the last zero_grad.
  std::vector<torch::Tensor> flat_bf16_, bf16_views_;
  bool bf16_open_ = false, bf16_wanted_ = false;
  mutable int64_t bf16_signature_ = -1;  // version_signature() when the copies were last made equal; -1: never
  // What the step being captured (or last captured) does to the copies: casts them at its start, writes them in
  // its optimizer.
  bool capture_casts_ = false;
  mutable bool capture_writes_ = false;
  int64_t version_signature() const;
  void cast_stale_bf16_copies();
  std::vector<char> slot_taken_;
  mutable std::mutex mu_;
};

}  // namespace ddp
