// Activation recomputation (checkpointing) for any part of a LibTorch model:
// what torch.utils.checkpoint does in Python, for C++.
//
// Why: a block's forward keeps its intermediate activations alive for its
// backward; for a deep model they, not the weights, are what fills memory.
// Run under recompute(), the block's forward keeps only its inputs; its
// backward runs the forward again (with autograd on), then backpropagates
// through that re-run. The cost is one more forward of the block.
//
// The re-run computes what the first run computed, bit for bit:
// - the CPU generator's state (and the CUDA device's, when the inputs live
//   there) is saved before the forward and put back for the re-run, so
//   dropout draws the same mask; the generators are restored afterwards, so
//   the rest of the program sees no difference;
// - autocast's settings (on or off, dtype; CPU and CUDA) are those of the
//   forward, whatever the backward thread has;
// - the module's buffers (BatchNorm's running statistics and counter) are
//   put back after the re-run, so they are updated once per step, as
//   without recompute.
//
// Gradients reach parameters through the recompute node itself: the
// parameters are inputs of the node, so the autograd graph of the loss
// reaches them (GradSync's expect_gradients_from and its per-parameter hooks
// see them as usual: a bucket's all-reduce starts when its last parameter's
// gradient lands, during the recomputed backward). A function that uses a
// parameter it was not given fails in backward with a message naming the
// fix, instead of silently losing that gradient.
#pragma once

#include <functional>
#include <vector>

#include <torch/torch.h>

namespace ddp {

/// A piece of forward computation: tensors in, tensors out. It must compute
/// the same thing when called again with the same inputs (it may draw
/// random numbers: they are replayed).
using RecomputeFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs fn(inputs) without keeping its activations; backward re-runs it.
/// `params`: every tensor that requires grad which fn reads other than
/// through `inputs` (its module's parameters). `buffers`: tensors fn may
/// update in place (running statistics), restored after the re-run. Under
/// no-grad mode, or when nothing requires grad, fn just runs.
std::vector<torch::Tensor> recompute(const RecomputeFn& fn, const std::vector<torch::Tensor>& inputs,
                                     const std::vector<torch::Tensor>& params,
                                     const std::vector<torch::Tensor>& buffers = {});

/// recompute() of a module's forward(x): its parameters and buffers are
/// taken from the module.
template <typename ModuleType>
torch::Tensor recompute(const ModuleType& module, const torch::Tensor& x) {
  // The module is held by value (a holder or pointer): backward runs it later.
  auto run = [module = ModuleType(module)](const std::vector<torch::Tensor>& in) mutable {
    return std::vector<torch::Tensor>{module->forward(in[0])};
  };
  return recompute(run, {x}, module->parameters(), module->buffers())[0];
}

/// A Sequential (or a stage of blocks) with every `every`-th module run
/// under recompute, starting with the first; 1: each module, 0: none. The
/// Sequential must outlive the step's backward.
torch::Tensor recompute_sequential(torch::nn::Sequential& seq, torch::Tensor x, int64_t every = 1);

/// Whether this thread is re-running a forward for recompute's backward
/// (e.g. to skip a side effect that the first run already had).
bool is_recomputing();

/// --recompute's value for the built-in models: which parts recompute.
struct RecomputePolicy {
  enum class Kind { kNone, kMlp, kBlocks, kStages };
  Kind kind = Kind::kNone;
  /// With kBlocks: every `every`-th block, from the first.
  int64_t every = 1;
  /// Block `i` (0-based) recomputes under this policy.
  bool block(int64_t i) const { return kind == Kind::kBlocks && every > 0 && i % every == 0; }
};
/// "none", "mlp", "blocks", "blocks:N" (N >= 1) or "stages"; UserError for
/// anything else.
RecomputePolicy parse_recompute(const std::string& value);

}  // namespace ddp
