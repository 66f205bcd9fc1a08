// A small GPT trained a few bf16 steps on the GPU, for tests that compare
// two code paths (fused kernels against LibTorch's ops, graphed against
// eager) by their loss trajectories.
#pragma once

#include <string>
#include <vector>

#include "ddp/models/fused_layer_norm.h"
#include "ddp/models/fused_linear.h"
#include "ddp/models/gpt.h"

namespace ddp::testing {

/// Losses of `steps` bf16 AdamW steps (lr 3e-3) of a GPT of `options`, made
/// by LmTask with seed 11, on CUDA device 0, over two fixed batches of 8
/// sequences whose targets are a function of the inputs (so the loss falls);
/// with `ignore_one`, one target of each batch is -100 (ignored). With
/// `graph`, the step is captured (and the test fails if it is not).
std::vector<double> small_gpt_bf16_losses(const ddp::models::GptOptions& options, bool graph, int steps,
                                          bool ignore_one = false);

/// ddptrain's GPT kernels on for a scope (process-wide they are off until a
/// program turns them on; ddptrain does, unless --linear-kernel or
/// --ln-kernel native), and off again however the test ends.
struct FusedLinearOn {
  FusedLinearOn() { ddp::models::use_fused_linear(true); }
  ~FusedLinearOn() { ddp::models::use_fused_linear(false); }
};
struct FusedLayerNormOn {
  FusedLayerNormOn() { ddp::models::use_fused_layer_norm(true); }
  ~FusedLayerNormOn() { ddp::models::use_fused_layer_norm(false); }
};
/// A trace's name for a GPT test's MLP: its GELU (tanh: the MLP in one
/// function; exact: two layers).
std::string mlp_case_name(ddp::models::GptGelu gelu);

/// `to`'s parameters set to `from`'s (a model of the same architecture).
void copy_parameters(torch::nn::Module& from, torch::nn::Module& to);

/// The largest |a[i] - b[i]| / |b[i]|.
double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace ddp::testing
