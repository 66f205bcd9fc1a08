// The language-modelling task (lm_task.h).
#include "ddp/train/lm_task.h"

#include <cmath>
#include <filesystem>
#include <limits>

#include "ddp/data/tokens.h"
#include "ddp/dist/world.h"
#include "ddp/error.h"
#include "ddp/train/fused_cross_entropy.h"

namespace fs = std::filesystem;

namespace ddp {

// GPT-2's 50257 tokens rounded up to a multiple of 64, as nanoGPT does for
// faster matmuls; the extra rows are never targets.
constexpr int64_t kGpt2PaddedVocab = 50304;

void LmTask::add_flags(Config& config) {
  config.model = "gpt-nano";
  config.data_root = data::kFortunesDir;
  config.augment = "none";     // the image flips and crops mean nothing for tokens
  config.schedule = "cosine";
  config.clip_grad_norm = 1.0;
  config.add_flag("--context", "lm: tokens per sample, the model's context (0: the --model preset's: gpt-nano 64, gpt2 1024)", 0);
  config.add_flag("--layers", "lm: Transformer blocks (0: the preset's: gpt-nano 2, gpt2 12)", 0);
  config.add_flag("--heads", "lm: attention heads (0: the preset's: gpt-nano 4, gpt2 12)", 0);
  config.add_flag("--width", "lm: embedding width (0: the preset's: gpt-nano 64, gpt2 768)", 0);
  config.add_flag("--vocab-size", "lm: vocabulary (0: 256 for text, which is read as bytes; 50304 for token files)", 0);
  config.add_flag("--dropout", "lm: dropout in the model", 0.0);
  config.add_flag("--linear-bias", "lm: biases in the linear layers and LayerNorms (GPT-2: yes)", true);
  config.add_flag("--gelu",
                  "lm: the MLP's GELU: exact (erf, as nanoGPT's nn.GELU) or tanh (GPT-2's own approximation; on a "
                  "GPU with --linear-kernel auto it runs inside the MLP's matmuls)",
                  "exact", {"exact", "tanh"});
}

models::GptOptions LmTask::model_options(const Config& c) {
  auto o = models::gpt_preset(c.model);
  if (c.flag<int>("context") > 0) o.block_size(c.flag<int>("context"));
  if (c.flag<int>("layers") > 0) o.n_layer(c.flag<int>("layers"));
  if (c.flag<int>("heads") > 0) o.n_head(c.flag<int>("heads"));
  if (c.flag<int>("width") > 0) o.n_embd(c.flag<int>("width"));
  if (c.flag<int>("vocab-size") > 0) o.vocab_size(c.flag<int>("vocab-size"));
  check_user(c.flag<int>("context") >= 0 && c.flag<int>("layers") >= 0 && c.flag<int>("heads") >= 0 &&
                 c.flag<int>("width") >= 0 && c.flag<int>("vocab-size") >= 0,
             "--context, --layers, --heads, --width and --vocab-size must be 0 (the preset's) or positive.");
  o.dropout(c.flag<double>("dropout")).bias(c.flag<bool>("linear-bias"));
  o.gelu(c.flag<std::string>("gelu") == "tanh" ? models::GptGelu::kTanh : models::GptGelu::kExact);
  o.recompute(parse_recompute(c.recompute));
  check_user(o.recompute().kind != RecomputePolicy::Kind::kStages, "--recompute stages applies to the ResNets.",
             "for a GPT use --recompute mlp, blocks or blocks:N.");
  check_user(!(c.cuda_graph && o.recompute().kind != RecomputePolicy::Kind::kNone && o.dropout() > 0),
             "--recompute " + c.recompute + " with --cuda-graph and --dropout " + c10::str(o.dropout()) +
                 ": a captured step cannot replay dropout's random numbers in the recomputed backward.",
             "use --dropout 0, or drop --cuda-graph or --recompute.");
  return o;
}

data::Splits LmTask::make_data(const Config& c, World& world) {
  check_user(models::is_gpt(c.model), "--task lm trains a GPT; --model " + c.model + " is not one.",
             "pass --model gpt-nano, gpt2 or gpt.");
  note_ignored_flags(c);
  const auto o = model_options(c);
  context_ = o.block_size();
  const fs::path root(c.data_root);
  std::error_code ec;
  std::vector<data::TokenBufferPtr> train, val;
  std::string name;
  int64_t vocab = 0;
  // Several token files (llm.c's FineWeb shards): a glob, pattern or list
  // of training files; validation reads the same names with "val" for
  // their last "train".
  const bool token_files = c.data_root.find_first_of("*?{,") != std::string::npos ||
                           (root.extension() == ".bin" && fs::is_regular_file(root, ec));
  if (token_files) {
    const size_t at = c.data_root.rfind("train");
    check_user(at != std::string::npos,
               "--data_root " + c.data_root + " names token files, but not as training files: the validation files "
               "are found by putting \"val\" for the last \"train\" of the name.",
               "name them as llm.c does, e.g. --data_root 'DIR/fineweb_train_*.bin' beside DIR/fineweb_val_*.bin.");
    train = data::read_token_files(c.data_root);
    val = data::read_token_files(std::string(c.data_root).replace(at, 5, "val"));
    name = "tokens " + c.data_root;
    vocab = c.flag<int>("vocab-size") > 0 ? c.flag<int>("vocab-size") : kGpt2PaddedVocab;
    tokenizer_ = "tokens";
  } else if (fs::exists(root / "train.bin", ec) || fs::exists(root / "val.bin", ec)) {
    train = {data::read_token_file((root / "train.bin").string())};
    val = {data::read_token_file((root / "val.bin").string())};
    name = "tokens " + c.data_root;
    vocab = c.flag<int>("vocab-size") > 0 ? c.flag<int>("vocab-size") : kGpt2PaddedVocab;
    tokenizer_ = "tokens";
  } else {
    auto corpus = data::read_text_corpus(c.data_root);
    train = {corpus.train};
    val = {corpus.val};
    name = c.data_root == data::kFortunesDir ? "fortunes" : c.data_root;
    name += " (bytes)";
    vocab = c.flag<int>("vocab-size") > 0 ? c.flag<int>("vocab-size") : 256;
    tokenizer_ = "bytes";
  }
  auto windows = [&](const std::vector<data::TokenBufferPtr>& t, bool random, int64_t n, const std::string& split) {
    return std::make_shared<data::TokenWindows>(t, data::TokenWindowsOptions()
                                                       .context(o.block_size())
                                                       .vocab_size(vocab)
                                                       .random(random)
                                                       .windows(n)
                                                       .name(name + " " + split));
  };
  data::Splits s;
  s.train = windows(train, true, c.train_samples, "train");
  s.test = windows(val, false, c.test_samples, "val");
  s.train_augmented = true;  // nothing to add on top of the windows
  return s;
}

ModulePtr LmTask::make_gpt(const models::GptOptions& options, const std::string& tokenizer) {
  gpt_ = models::Gpt(options);
  tokenizer_ = tokenizer;
  arch_ = models::gpt_arch(options) + "/" + tokenizer;
  return gpt_.ptr();
}

ModulePtr LmTask::make_model(const Config& c, const data::Splits& data) {
  auto o = model_options(c);
  o.vocab_size(data.train->num_classes());
  return make_gpt(o, tokenizer_);
}

void LmTask::configure_optimizer(const Config& c, OptimizerSetup& setup) {
  // GPT-2's and nanoGPT's second-moment decay, and nanoGPT's weight-decay
  // groups: matrices and embeddings decay, biases and LayerNorm weights do
  // not. The learning rate and weight decay stay what the flags say
  // (config.toml records them, so that --config repeats the run).
  if (c.optimizer != "sgd") setup.optimizer.beta2(0.95);
  setup.optimizer.no_decay_1d(true);
}

torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& targets, bool sum,
                              bool overwrite_logits) {
  namespace F = torch::nn::functional;
  auto flat = logits.reshape({-1, logits.size(-1)});
  auto flat_targets = targets.reshape({-1});
  // On CUDA, one kernel each way instead of autocast's fp32 copy of the
  // logits, log_softmax, nll_loss and their backwards (fused_cross_entropy.h).
  if (fused_cross_entropy_enabled() && fused_cross_entropy_applies(flat, flat_targets))
    return fused_cross_entropy(flat, flat_targets, sum, overwrite_logits);
  auto options = F::CrossEntropyFuncOptions();
  if (sum) options.reduction(torch::kSum);
  return F::cross_entropy(flat, flat_targets, options);
}

StepOutput LmTask::training_step(const data::Batch& batch) {
  // The logits are this step's own and feed nothing but the loss, so the
  // loss's backward may write their gradient over them.
  return next_token_loss(gpt_->forward(batch.input()), batch.target(), /*sum=*/false, /*overwrite_logits=*/true);
}

TensorMap LmTask::validation_step(const data::Batch& batch) {
  auto logits = gpt_->forward(batch.input()).to(torch::kFloat);
  const auto& y = batch.target();
  return {{"loss", next_token_loss(logits, y, /*sum=*/true).to(torch::kDouble)},
          {"tokens", torch::full({}, static_cast<double>(y.numel()), torch::kDouble)},
          {"count", torch::full({}, static_cast<double>(y.size(0)), torch::kDouble)}};
}

Metrics LmTask::validation_metrics(const Totals& t) {
  const double loss = t.at("loss").item<double>() / std::max(1.0, t.at("tokens").item<double>());
  return {{"test_loss", loss}, {"test_perplexity", std::exp(loss)}};
}

// The steps' own sample counts, not --batch x ranks from the flags: a run
// resumed on another number of ranks changes --batch after make_data (and
// tokens_per_s was halved).
void LmTask::on_step_end(const StepEnd& step) {
  last_step_end_ = std::chrono::steady_clock::now();
  if (steps_in_epoch_++ == 0) {
    first_step_end_ = last_step_end_;
    samples_after_first_ = 0;
  } else {
    samples_after_first_ += step.samples;
  }
}

void LmTask::on_epoch_end(EpochEnd& epoch) {
  const double seconds = std::chrono::duration<double>(last_step_end_ - first_step_end_).count();
  if (steps_in_epoch_ > 1 && seconds > 0)
    epoch.metrics["tokens_per_s"] = static_cast<double>(samples_after_first_ * context_) / seconds;
  steps_in_epoch_ = 0;
}

std::vector<std::string> LmTask::ignored_flags() const { return ignored_; }

// The image and classification flags this task does not read, where they
// hold another value than the default: a run's config.toml lists every flag,
// and `--config config.toml` must repeat the run.
void LmTask::note_ignored_flags(const Config& c) {
  const Config d;
  ignored_.clear();
  auto note = [&](bool differs, const char* name) {
    if (differs) ignored_.push_back(name);
  };
  note(c.loss != d.loss, "loss");
  note(c.label_smoothing != d.label_smoothing, "label-smoothing");
  note(c.stem != d.stem, "stem");
  note(c.augment != "none", "augment");
  note(c.dataset != d.dataset, "dataset");
  note(c.val_root != d.val_root, "val-root");
  note(c.image_size != d.image_size, "image-size");
  note(c.strict_data != d.strict_data, "strict-data");
}

}  // namespace ddp
