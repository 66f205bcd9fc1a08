// `ddptrain generate CHECKPOINT --prompt TEXT`: text sampled from a GPT
// that --task lm trained, so that a person can see what it learned.
//
// The checkpoint's architecture string gives the model's sizes and its
// tokenizer. A byte-level model (trained on text) reads the prompt as
// bytes and prints text; a model trained on token files has no tokenizer
// here, so its prompt is token ids ("464 3290 318") and it prints ids.
// Sampling runs on the CPU: each new token is drawn from the softmax of the
// last position's logits divided by --temperature, kept to the --top-k most
// likely (0: all); --temperature 0 takes the most likely token. The context
// slides: only the last `context` tokens are fed back. --logits-out FILE
// also writes the prompt's logits, for checks against PyTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/models/gpt.h"

namespace ddp {

struct SampleOptions {
  /// Tokens to add after the prompt.
  TORCH_ARG(int64_t, tokens) = 200;
  /// Divides the logits; 0 picks the most likely token every time.
  TORCH_ARG(double, temperature) = 0.8;
  /// Draw among the k most likely tokens only (0: all).
  TORCH_ARG(int64_t, top_k) = 40;
  /// Seed of the draws: the same seed and prompt give the same text.
  TORCH_ARG(uint64_t, seed) = 0;
};

/// `prompt` (at least one token id) followed by `options.tokens` sampled
/// ones.
std::vector<int64_t> sample_tokens(models::Gpt& model, const std::vector<int64_t>& prompt,
                                   const SampleOptions& options);

/// The `generate` subcommand; `args` are the words after "generate".
/// Returns the exit code; UserError propagates to the caller.
int generate_command(const std::vector<std::string>& args);

}  // namespace ddp
