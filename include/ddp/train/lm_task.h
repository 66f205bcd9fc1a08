// Language modelling: next-token prediction with a GPT (--task lm).
//
//   ddptrain --task lm --model gpt-nano                  # Debian's fortunes, bytes
//   ddptrain --task lm --model gpt2 --data_root DIR      # DIR/train.bin, DIR/val.bin
//
// The data: token files or a byte-level text corpus (data/tokens.h), in
// windows of --context tokens; a sample is one window, and an epoch is
// --train-samples windows (default: the training tokens / context).
// The loss: cross-entropy of the next token at every position, averaged
// over all B x T positions. Metrics: test_loss (per token, in nats; the
// monitor, lower is better), test_perplexity = exp(test_loss), and the
// training throughput tokens_per_s (between the epoch's first and last
// optimizer steps, over all ranks).
#pragma once

#include <chrono>

#include "ddp/models/gpt.h"
#include "ddp/train/task.h"

namespace ddp {

class LmTask : public Task {
 public:
  /// The model flags (--context, --layers, --heads, --width, --vocab-size,
  /// --dropout, --linear-bias) and this task's defaults of built-in ones:
  /// --model gpt-nano, --data_root the fortunes corpus, no image
  /// augmentation, cosine schedule, gradient clipping at 1.
  void add_flags(Config& config) override;
  data::Splits make_data(const Config& config, World& world) override;
  /// `predict --split PATH`: the test split of the text or tokens in PATH,
  /// read as --data_root PATH is.
  data::DatasetPtr make_predict_data(const Config& config, World& world, const std::string& path) override {
    return test_split_at(config, world, path);
  }
  ModulePtr make_model(const Config& config, const data::Splits& data) override;
  /// Adam and AdamW with betas (0.9, 0.95), as GPT-2 and nanoGPT train;
  /// --lr and --weight-decay as given (or their defaults).
  void configure_optimizer(const Config& config, OptimizerSetup& setup) override;

  StepOutput training_step(const data::Batch& batch) override;
  TensorMap validation_step(const data::Batch& batch) override;
  Metrics validation_metrics(const Totals& totals) override;
  Monitor monitor() const override { return {"test_loss", Goal::kMin}; }
  void on_step_end(const StepEnd& step) override;
  void on_epoch_end(EpochEnd& epoch) override;
  /// The image and classification flags, where given another value than
  /// their default.
  std::vector<std::string> ignored_flags() const override;

  /// The model the flags describe, before the data is known (--vocab-size 0
  /// leaves the preset's vocabulary).
  static models::GptOptions model_options(const Config& config);
  /// Builds and keeps the model (make_model calls it; so does ddptrain
  /// bench, which has no data).
  ModulePtr make_gpt(const models::GptOptions& options, const std::string& tokenizer);
  models::Gpt& gpt() { return gpt_; }
  /// "bytes" (text read as bytes: samples print as text) or "tokens".
  const std::string& tokenizer() const { return tokenizer_; }

 private:
  models::Gpt gpt_{nullptr};
  std::string tokenizer_ = "bytes";
  std::vector<std::string> ignored_;
  void note_ignored_flags(const Config& config);
  int64_t context_ = 0;          // tokens per sample
  int64_t steps_in_epoch_ = 0;
  int64_t samples_after_first_ = 0;  // over all ranks, in the steps after the epoch's first
  std::chrono::steady_clock::time_point first_step_end_, last_step_end_;
};

/// Next-token cross-entropy of B x T x V logits against B x T targets:
/// the mean over all positions, or the sum with `sum`. CUDA logits go
/// through ddptrain's fused kernels where the build has them
/// (fused_cross_entropy.h; --ce-kernel native turns them off), others
/// through LibTorch's cross_entropy. `overwrite_logits`: the caller reads
/// the logits no more, so the fused backward may write the gradient over
/// them (ignored on the LibTorch path).
torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& targets, bool sum = false,
                              bool overwrite_logits = false);

}  // namespace ddp
