// SGD with momentum, Adam and AdamW over flat parameter buffers.
//
// GradSync lays every parameter and gradient out in one flat buffer per
// dtype, so an optimizer step is a fixed handful of kernels over those few
// tensors, however many parameter tensors the model has. On CUDA with
// LibTorch 2.2+ the step is LibTorch's fused kernel (one launch per buffer,
// with the learning rate and the step count held on the device, so a CUDA
// graph can capture it); elsewhere it is the same arithmetic as
// torch::optim's per-tensor optimizers, written with tensor ops over the
// flat buffers. Both equal torch::optim::SGD/Adam/AdamW to fp32 rounding
// (tests/train/flat_optimizer_test.cpp).
//
// Built on a GradSync, it also leaves alone the parameters that got no
// gradient on any rank in a step, as torch.optim does with a .grad of None:
// no weight decay, no momentum or moment update, and for Adam a per-
// parameter step count that does not advance (its bias correction uses its
// own count, as PyTorch's per-parameter state["step"]). While every
// parameter has had a gradient in every step on this rank, a step is the
// same few whole-buffer kernels as before. Otherwise the affected
// parameters are saved before that step and set afterwards, each on its
// own slice: restored where no rank had a gradient (chosen on the device
// from GradSync's flags, so a CUDA graph can capture it), or stepped again
// with its own step count where it has missed steps before. The fused
// kernels are elementwise, so a rank that takes this path for a parameter
// gets the same bits as one that does not; the composed path decides from
// the ranks' flags read on the host, which is free on the CPU (the only
// place it runs without a sync: without fused kernels a CUDA step is not
// captured anyway, and the read happens only in steps where this rank left
// some parameter unused).
//
// Weight decay applies to every parameter, as torch.optim with one param
// group, unless no_decay_1d asks for nanoGPT's two groups (--task lm does):
// decay on matrices and embeddings (2 or more dimensions), none on biases
// and norm weights. The fused kernels take one weight decay per call, so
// GradSync keeps the 1-D parameters in flat buffers of their own
// (GradSyncOptions::separate_1d), and a step makes one fused call per
// weight decay, each over whole buffers; the unused-parameter fix-ups step
// a slice with its buffer's decay. Both groupings equal torch.optim's
// (tests/train/weight_decay_groups_test.cpp). A checkpoint records the
// grouping, since it decides the buffers that the state is laid out in.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/dist/grad_sync.h"
#include "ddp/dist/world.h"
#include "ddp/io/checkpoint.h"

namespace ddp {

using WorldPtr = World*;  // TORCH_ARG spells its setter's argument const T&

struct FlatOptimizerOptions {
  TORCH_ARG(std::string, name) = "adamw";  // sgd | adam | adamw
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.0;   // L2 for sgd/adam, decoupled for adamw
  TORCH_ARG(double, momentum) = 0.9;       // sgd
  TORCH_ARG(double, beta1) = 0.9;          // floats: the seed's betas=(0, 0.999) crashed PyTorch
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  /// Use LibTorch's fused kernels where this build has them (CUDA, 2.2+).
  TORCH_ARG(bool, fused) = true;
  /// Weight decay on the parameters of 2 or more dimensions only (matrices,
  /// embeddings, convolution kernels); biases and norm weights get none, as
  /// with nanoGPT's two param groups. Off: every parameter decays, as
  /// torch.optim with one group. Needs the GradSync constructor, on a
  /// GradSync made with GradSyncOptions().separate_1d(true) (TrainStep does
  /// that).
  TORCH_ARG(bool, no_decay_1d) = false;
  /// Parameters by name that get no weight decay either, e.g. embedding
  /// tables ({"tok_emb.weight"}); like no_decay_1d, they need the GradSync
  /// constructor (TrainStep puts them apart: GradSyncOptions::separate_names).
  TORCH_ARG(std::vector<std::string>, no_decay) = {};
  /// ZeRO-1 (--shard-optimizer): with several ranks, each keeps the state
  /// (moments, momentum) of 1/world-size of every flat buffer and updates
  /// only that part of the parameters; the parts are then broadcast, each
  /// from its rank, so every rank gets all parameters: started by step()
  /// and waited for by wait_for_parameters(), which every reader of the
  /// parameters calls first. The
  /// gradients are all-reduced whole as before (Gloo in LibTorch 1.13 has
  /// no reduce-scatter), so clipping's norm is the unsharded one and the
  /// update is elementwise: the same bits as unsharded. Built on a GradSync
  /// whose gradients are reduce-scattered (GradSync::gradients_sharded()),
  /// each rank reads only its part of them, and clipping's norm is summed
  /// over the ranks' parts (equal to the unsharded one to rounding). Where
  /// a fused Adam kernel clips in its pass (CUDA), or the gradients are
  /// reduce-scattered, only this rank's part of the gradients is left
  /// clipped. nullptr: unsharded.
  TORCH_ARG(WorldPtr, shard_over) = nullptr;
};

/// The common rule for weight decay, as timm's and nanoGPT's param groups
/// (with embeddings exempt too): the matrices and convolution kernels of
/// `model` decay; biases, norm weights (1-D) and the tables of its
/// torch::nn::Embedding and EmbeddingBag modules do not. One call in
/// Task::configure_optimizer: ddp::decay_matrices_only(setup.optimizer, *model).
void decay_matrices_only(FlatOptimizerOptions& options, torch::nn::Module& model);

/// Whether the caller reads the gradients after FlatOptimizer::step().
enum class GradientsAfterStep {
  kRead,     // left clipped, as clip_grad_norm_ leaves them
  kDropped,  // set to none right after the step: their clipped values need not be stored
};

class FlatOptimizer {
 public:
  /// `params[i]` and `grads[i]` are flat buffers of equal size; each is
  /// stepped whole, every step, with weight_decay() (no_decay_1d needs the
  /// GradSync constructor, which knows the parameters' shapes).
  FlatOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads, FlatOptimizerOptions options);
  /// Steps GradSync's flat buffers, and skips the parameters that got no
  /// gradient on any rank (sync.usage(), read at every step()).
  FlatOptimizer(const GradSync& sync, FlatOptimizerOptions options);
  /// Waits for a gather still in flight (errors ignored), so that no
  /// collective writes the parameters after their optimizer is gone.
  ~FlatOptimizer();
  FlatOptimizer(const FlatOptimizer&) = delete;
  FlatOptimizer& operator=(const FlatOptimizer&) = delete;

  /// Sets the learning rate for the next step(). Call it outside a CUDA graph
  /// capture: it writes the device-side copy that a captured step reads.
  void set_lr(double lr);
  double lr() const { return lr_; }

  /// One update of every parameter. With `found_inf` (a 1-element float
  /// tensor, fp16 loss scaling), a non-zero value skips the update on the
  /// device; this needs the fused kernels.
  ///
  /// With `max_grad_norm` > 0 the gradients are first clipped to that joint
  /// L2 norm, by torch.nn.utils.clip_grad_norm_'s rule (scaled by
  /// max / (norm + 1e-6) where that is below 1), without reading the norm
  /// back to the host, and are left clipped (but see `after`). The Adam/AdamW kernels apply
  /// the scale in their own pass over the gradients, so clipping costs no
  /// pass of its own there: ddptrain's (fp32 buffers on CUDA, with its CUDA
  /// kernels) multiplies by the coefficient, as clip_grad_norm_ does;
  /// LibTorch's fused one divides by its inverse (an fp32 rounding of the
  /// clipped gradient apart, and not at all where nothing is clipped).
  /// Elsewhere the gradients are multiplied before the step.
  ///
  /// Built on a GradSync that has bf16 copies of the parameters
  /// (param_slots.h), ddptrain's Adam kernel also writes the updated
  /// parameters into them, in bf16, so the next step need not cast them.
  ///
  /// `after` says whether the caller reads the gradients after the step.
  /// kDropped (TrainStep, which sets them to none right after) lets
  /// ddptrain's Adam kernel clip without storing the clipped values back,
  /// where no fix-up steps a parameter that missed steps again (which
  /// reads them).
  void step(const torch::Tensor& found_inf = {}, double max_grad_norm = 0,
            GradientsAfterStep after = GradientsAfterStep::kRead);

  /// Sharded: step() ends with its parameter gather started, not done
  /// (the host runs ahead: the next batch, logging). Every reader of the
  /// parameters calls this first, on every rank: the next forward,
  /// evaluation, a checkpoint, the weights' moving average. Waits through
  /// World::wait (a dead peer is a CollectiveError naming the gather), and
  /// moves the flat buffers' version counters as the data lands (GradSync's
  /// bf16 copies then count as stale). Nothing pending, or unsharded: returns
  /// at once. step(), gather_state() and load() call it themselves.
  void wait_for_parameters();
  /// The same for flat buffer k alone (GradSync's flat_params()[k]), or
  /// for its elements [lo, lo + len) (the gather's pieces that overlap
  /// them), e.g. just before the layer that reads them.
  void wait_for_buffer(size_t k);
  void wait_for_range(size_t k, int64_t lo, int64_t len);
  /// The gather's pieces: each rank's part of flat buffer k, cut again
  /// where a model's parts begin: `part_starts[k]` holds (offset, part) for
  /// the first element of each part in buffer k, a part being a number in
  /// the order the forward reads them (e.g. -1 the embeddings, i block i).
  /// The pieces are started in that order (then by buffer and offset), so
  /// that an early part's pieces travel first and wait_for_range() on a
  /// part waits for its pieces only. From the next step on; more
  /// broadcasts, the same bits.
  void split_gather_at(std::vector<std::vector<std::pair<int64_t, int64_t>>> part_starts);
  /// Whether some buffer's gather is started and not yet waited for.
  bool parameters_pending() const;
  /// Pieces of the gather started and not yet waited for; buffer gathers
  /// and pieces waited for over this optimizer's life (whoever waited);
  /// the part of each piece pending, and of each piece of the last gather
  /// in the order started (0 without split_gather_at): for tests.
  int64_t pieces_pending() const;
  std::vector<int64_t> pending_parts() const;
  const std::vector<int64_t>& started_parts() const { return started_parts_; }
  int64_t buffers_waited() const { return buffers_waited_; }
  int64_t pieces_waited() const { return pieces_waited_; }

  /// Whether step() runs without host synchronisation or host-side
  /// per-step scalars (so it can be captured in a CUDA graph).
  bool capturable() const { return fused_; }

  /// Optimizer steps taken (read from the device).
  int64_t steps_taken() const;
  /// Per parameter (GradSync's order): the steps it took part in, which is
  /// Adam's state["step"] (read from the device).
  std::vector<int64_t> parameter_steps() const;

  /// Sharded: every rank calls this before a checkpoint is written (by any
  /// rank): the state's parts are broadcast into whole buffers that save()
  /// then writes, as an unsharded run does; they are freed by the next
  /// step. Unsharded: nothing.
  void gather_state();
  /// save() writes the whole state (sharded: gathered by gather_state()
  /// since the last step, else a UserError names the missing call); load()
  /// reads a whole state and keeps this rank's part: checkpoints are the
  /// same sharded or not, for any number of ranks.
  void save(TensorMap& state) const;
  void load(const TensorMap& state);

  /// Bytes of optimizer state this rank holds (moments, momentum, step
  /// counts), and what it would hold unsharded.
  int64_t state_bytes() const;
  int64_t unsharded_state_bytes() const;
  /// Ranks the state is sharded over (1: not sharded).
  int shards() const { return shard_ ? shard_->size() : 1; }
  /// This rank's part of each flat gradient buffer (the whole buffers
  /// unsharded): what step() reads, e.g. for a check for infinities.
  const std::vector<torch::Tensor>& gradient_parts() const { return sg_; }

  const FlatOptimizerOptions& options() const { return o_; }

 private:
  struct Saved {
    size_t slice;
    bool unused_here;
    torch::Tensor p, m, v;
  };
  FlatOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads, FlatOptimizerOptions options,
                const GradSync* sync);
  void init_state();
  torch::Tensor clip(double max_norm);
  torch::Tensor sharded_norm(const std::vector<torch::Tensor>& parts) const;
  torch::Tensor slice(const std::vector<torch::Tensor>& flat, size_t i) const;
  // Parameter slice i within this rank's part of its flat buffer, in
  // `part`'s coordinates (a tensor laid out like sp_, sg_, m_ or v_);
  // empty where the slice lies outside the part.
  torch::Tensor part(const std::vector<torch::Tensor>& part, size_t i) const;
  struct Piece {  // a broadcast of elements [lo, lo + len) of a flat buffer, of a model's part
    int64_t lo, len, part;
    c10::intrusive_ptr<compat::Work> work;
  };
  using Pending = std::vector<Piece>;  // one buffer's
  void gather_parameters();
  std::vector<Pending> start_broadcast_parts(const std::vector<torch::Tensor>& whole,
                                             const std::vector<torch::Tensor>& mine,
                                             const std::vector<std::vector<std::pair<int64_t, int64_t>>>& part_starts = {});
  void broadcast_parts(const std::vector<torch::Tensor>& whole, const std::vector<torch::Tensor>& mine);
  bool channels_last() const;  // this run's 4-D slices are in channels-last order
  torch::Tensor relaid(const torch::Tensor& flat, size_t k, bool from_channels_last, bool to_channels_last) const;
  void update(const std::vector<torch::Tensor>& p, const std::vector<torch::Tensor>& g,
              const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
              const std::vector<torch::Tensor>& step, const std::vector<double>& weight_decay, int64_t host_step,
              const torch::Tensor& found_inf, const torch::Tensor& grad_scale = {},
              const std::vector<torch::Tensor>& p16 = {});
  void whole_step(const torch::Tensor& found_inf, const torch::Tensor& grad_scale,
                  const std::vector<torch::Tensor>& p16 = {});
  std::vector<torch::Tensor> bf16_targets() const;
  void fused_fix_ups(std::vector<Saved>& saved, const torch::Tensor& used_anywhere, const torch::Tensor& found_inf,
                     const std::vector<torch::Tensor>& p16);
  void composed_fix_ups(std::vector<Saved>& saved, const std::vector<char>& skipped);

  FlatOptimizerOptions o_;
  bool adam_ = true, fused_ = false;
  bool own_adam_ = false;  // ddptrain's Adam kernel (cuda/adamw.h): fp32 buffers on CUDA
  bool store_clipped_ = true;  // this step's: the kernel writes the clipped gradients back
  std::vector<torch::Tensor> params_, grads_;
  // This rank's part of each flat buffer: [lo_, lo_ + len_) of params_[k],
  // grads_[k] (the whole buffers when not sharded); the moments cover it.
  World* shard_ = nullptr;
  bool grads_sharded_ = false;  // only this rank's part of the gradients is reduced (GradSync::gradients_sharded)
  std::vector<int64_t> lo_, len_;
  std::vector<torch::Tensor> sp_, sg_;
  std::vector<torch::Tensor> m_, v_;  // first/second moments (sgd: momentum buffer in m_), over the parts
  std::vector<torch::Tensor> whole_m_, whole_v_;  // sharded: gathered for save(), until the next step
  int64_t gathered_at_ = -1;                      // steps_taken() when gathered
  std::vector<Pending> gathers_;  // sharded: per flat buffer, its parameter gather in flight (empty: none)
  std::vector<std::vector<std::pair<int64_t, int64_t>>> part_starts_;  // split_gather_at()
  std::vector<int64_t> started_parts_;                                 // the last gather's, for tests
  int64_t buffers_waited_ = 0, pieces_waited_ = 0;
  std::vector<torch::Tensor> step_;   // fused path: one float step count per buffer, on its device
  std::vector<double> weight_decay_;  // per buffer: o_.weight_decay(), or 0 for 1-D parameters with no_decay_1d
  torch::Tensor lr_t_;                // learning rate on the device (fused path)
  double lr_ = 0;
  int64_t host_step_ = 0;             // composed path
  // Per parameter slice: where it lives, and the steps it missed since the
  // start (a parameter's own step count is the buffer's minus that).
  const GradSync* sync_ = nullptr;
  std::vector<ParamSlice> slices_;
  std::vector<torch::Tensor> missed_;      // fused: a float scalar each, on the device
  std::vector<torch::Tensor> own_step_;    // fused: scratch for the step count that the kernel reads
  std::vector<int64_t> host_missed_;       // composed: exact, the same on every rank
  std::vector<char> may_have_missed_;      // fused: left unused on this rank in some step so far
};

}  // namespace ddp
