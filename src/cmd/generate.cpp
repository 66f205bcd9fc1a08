// Sampling from a trained GPT (generate.h).
#include "ddp/cmd/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ddp/cmd/subcommand.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"

namespace fs = std::filesystem;

namespace ddp {

std::vector<int64_t> sample_tokens(models::Gpt& model, const std::vector<int64_t>& prompt, const SampleOptions& o) {
  check_user(!prompt.empty(), "the prompt has no tokens.", "pass --prompt with some text.");
  check_user(o.temperature() >= 0 && std::isfinite(o.temperature()),
             "--temperature must be 0 or a positive finite number, not " + std::to_string(o.temperature()) + ".",
             "e.g. --temperature 0.8 (0: greedy).");
  check_user(o.top_k() >= 0, "--top-k must be 0 (all tokens) or positive.");
  torch::NoGradGuard no_grad;
  model->eval();
  const auto dev = model->parameters().front().device();
  const int64_t context = model->options.block_size(), vocab = model->options.vocab_size();
  for (int64_t t : prompt)
    check_user(t >= 0 && t < vocab, "prompt token " + std::to_string(t) + " is outside the model's vocabulary of " +
                                        std::to_string(vocab) + ".");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed());
  std::vector<int64_t> out = prompt;
  for (int64_t i = 0; i < o.tokens(); ++i) {
    const auto first = out.size() > static_cast<size_t>(context) ? out.end() - context : out.begin();
    auto idx = torch::tensor(std::vector<int64_t>(first, out.end()), torch::kLong).unsqueeze(0).to(dev);
    auto logits = model->forward(idx).select(1, idx.size(1) - 1).squeeze(0).to(torch::kCPU, torch::kFloat);
    int64_t next = 0;
    if (o.temperature() == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      // Less the largest first: a tiny temperature then sends the others
      // to -inf (probability 0), not every logit to +-inf (NaN).
      logits = (logits - logits.max()) / o.temperature();
      if (o.top_k() > 0 && o.top_k() < vocab) {
        const auto kth = std::get<0>(logits.topk(o.top_k())).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, 0), 1, false, gen).item<int64_t>();
    }
    out.push_back(next);
  }
  return out;
}

namespace {

constexpr const char* kGenerateUsage =
    "usage: ddptrain generate CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]";

// The architecture string in a ddptrain checkpoint's header.
std::string checkpoint_arch(const std::string& path) {
  check_user(fs::exists(path), "checkpoint " + path + " does not exist.", "pass a file such as <run>/best.pt.");
  for (const auto& [name, t] : read_state_dict(path, [](const std::string& n) { return n == "ddptrain"; })) {
    const auto header = nlohmann::json::parse(tensor_string(t), nullptr, /*allow_exceptions=*/false);
    check_user(header.is_object(), "checkpoint " + path + " has a damaged header.",
               "use another checkpoint of the run (epoch_*.pt).");
    return header.value("arch", "");
  }
  throw UserError(path + " is not a ddptrain checkpoint (no header).",
                  "pass a checkpoint that ddptrain --task lm wrote, e.g. <run>/best.pt.");
}

}  // namespace

int generate_command(const std::vector<std::string>& args) {
  CLI::App app{"ddptrain generate: sample text from a GPT that ddptrain --task lm trained."};
  std::string checkpoint, prompt;
  SampleOptions o;
  int64_t tokens = o.tokens(), top_k = o.top_k();
  double temperature = o.temperature();
  uint64_t seed = o.seed();
  app.add_option("checkpoint", checkpoint, "a checkpoint (best.pt, epoch_N.pt)")->required();
  app.add_option("--prompt", prompt, "text to continue (a model of token files: token ids, e.g. \"464 3290\")");
  app.add_option("--tokens", tokens, "tokens to generate")->capture_default_str();
  app.add_option("--temperature", temperature, "softmax temperature; 0: always the most likely token")->capture_default_str();
  app.add_option("--top-k", top_k, "sample among the K most likely tokens (0: all)")->capture_default_str();
  app.add_option("--seed", seed, "seed of the draws")->capture_default_str();
  std::string logits_out;
  app.add_option("--logits-out", logits_out,
                 "also write the prompt's logits (1 x T x vocab, float32) and ids to this file in torch.save format, "
                 "to compare with another implementation (bench/gpt_interop.py)");
  const bool parsed = parse_subcommand(app, args, kGenerateUsage, [](const std::vector<std::string>& extras) {
    for (const auto& a : extras) {
      char* end = nullptr;
      std::strtod(a.c_str(), &end);
      const bool number = end && *end == '\0';
      if (a.size() > 1 && a[0] == '-' && !number) throw UserError("unknown flag '" + a + "'.", kGenerateUsage);
    }
    std::string given;
    for (const auto& a : extras) given += (given.empty() ? "" : " ") + a;
    throw UserError("generate reads one checkpoint; also given: " + given + ".", kGenerateUsage);
  });
  if (!parsed) return exit_code::kOk;
  check_user(tokens >= 0, "--tokens must not be negative.", kGenerateUsage);
  const std::string arch = checkpoint_arch(checkpoint);
  auto model = models::Gpt(models::gpt_from_arch(arch));
  load_model_weights(checkpoint, *model, torch::kCPU);
  // One token at a time through a small model is a chain of tiny ops, which
  // extra threads only slow down (measured 7x slower with 2 threads for
  // gpt-nano on a busy 2-core machine).
  if (model->num_params() < 10'000'000) torch::set_num_threads(1);
  const bool bytes = arch.size() >= 6 && arch.compare(arch.size() - 6, 6, "/bytes") == 0;

  std::vector<int64_t> ids;
  if (bytes) {
    for (unsigned char ch : prompt.empty() ? std::string("\n") : prompt) ids.push_back(ch);
  } else {
    std::stringstream ss(prompt);
    std::string word;
    while (ss >> word) {
      check_user(word.find_first_not_of("0123456789") == std::string::npos,
                 "this model was trained on token files, so its prompt is token ids; '" + word + "' is not one.",
                 "pass ids separated by spaces, e.g. --prompt \"464 3290 318\" (GPT-2's tokenizer makes them).");
      // Longer than 18 digits would overflow; no vocabulary is that large.
      check_user(word.size() <= 18 && std::stoll(word) < model->options.vocab_size(),
                 "prompt token " + word + " is outside the model's vocabulary of " +
                     std::to_string(model->options.vocab_size()) + ".",
                 "pass token ids below " + std::to_string(model->options.vocab_size()) + ".");
      ids.push_back(std::stoll(word));
    }
    if (ids.empty()) ids.push_back(model->options.vocab_size() > 50256 ? 50256 : 0);  // GPT-2's <|endoftext|>
  }
  if (!logits_out.empty()) {
    check_output_is_no_checkpoint(logits_out, checkpoint);
    torch::NoGradGuard no_grad;
    model->eval();
    auto idx = torch::tensor(ids, torch::kLong).unsqueeze(0);
    write_state_dict(logits_out, {{"idx", idx}, {"logits", model->forward(idx).to(torch::kFloat).contiguous()}});
  }
  const auto out = sample_tokens(model, ids, o.tokens(tokens).temperature(temperature).top_k(top_k).seed(seed));
  if (bytes) {
    std::string text;
    for (int64_t t : out) text.push_back(static_cast<char>(t));
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  } else {
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%lld", i ? " " : "", static_cast<long long>(out[i]));
    std::printf("\n");
  }
  std::fflush(stdout);
  return exit_code::kOk;
}

}  // namespace ddp
