// The GPT-2-style decoder (see gpt.h for the architecture and the names).
#include "ddp/models/gpt.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <unordered_set>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/models/fused_layer_norm.h"
#include "ddp/models/fused_linear.h"

namespace ddp::models {

GptOptions gpt_preset(const std::string& name) {
  if (name == "gpt" || name == "gpt-nano") return GptOptions();
  // GPT-2's four sizes, as nanoGPT's from_pretrained names them.
  const auto gpt2 = GptOptions().block_size(1024).vocab_size(50304);
  if (name == "gpt2") return GptOptions(gpt2).n_layer(12).n_head(12).n_embd(768);
  if (name == "gpt2-medium") return GptOptions(gpt2).n_layer(24).n_head(16).n_embd(1024);
  if (name == "gpt2-large") return GptOptions(gpt2).n_layer(36).n_head(20).n_embd(1280);
  if (name == "gpt2-xl") return GptOptions(gpt2).n_layer(48).n_head(25).n_embd(1600);
  throw UserError("unknown GPT model '" + name + "'.",
                  "use --model gpt-nano, gpt2, gpt2-medium, gpt2-large, gpt2-xl or gpt (sized by --layers, --heads, "
                  "--width, --context).");
}

bool is_gpt(const std::string& name) {
  return name == "gpt" || name == "gpt-nano" || name == "gpt2" || name == "gpt2-medium" || name == "gpt2-large" ||
         name == "gpt2-xl";
}

std::string gpt_arch(const GptOptions& o) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "gpt/L%lld/H%lld/C%lld/T%lld/V%lld/bias%d/drop%g", static_cast<long long>(o.n_layer()),
                static_cast<long long>(o.n_head()), static_cast<long long>(o.n_embd()),
                static_cast<long long>(o.block_size()), static_cast<long long>(o.vocab_size()), o.bias() ? 1 : 0,
                o.dropout());
  return std::string(buf) + (o.gelu() == GptGelu::kTanh ? "/gelu-tanh" : "");
}

GptOptions gpt_from_arch(const std::string& arch) {
  long long l = 0, h = 0, c = 0, t = 0, v = 0;
  int bias = 1;
  double drop = 0;
  const bool ok = std::sscanf(arch.c_str(), "gpt/L%lld/H%lld/C%lld/T%lld/V%lld/bias%d/drop%lf", &l, &h, &c, &t, &v,
                              &bias, &drop) == 7;
  check_user(ok && l > 0 && h > 0 && c > 0 && t > 0 && v > 0, "the checkpoint's model '" + arch + "' is not a GPT.",
             "pass a checkpoint written by ddptrain --task lm.");
  const bool tanh = arch.find("/gelu-tanh/") != std::string::npos ||
                    (arch.size() >= 10 && arch.compare(arch.size() - 10, 10, "/gelu-tanh") == 0);
  return GptOptions().n_layer(l).n_head(h).n_embd(c).block_size(t).vocab_size(v).bias(bias != 0).dropout(drop).gelu(
      tanh ? GptGelu::kTanh : GptGelu::kExact);
}

// ---- LayerNorm -------------------------------------------------------------

GptLayerNormImpl::GptLayerNormImpl(int64_t width, bool with_bias) {
  weight = register_parameter("weight", torch::ones({width}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({width}));
}

torch::Tensor GptLayerNormImpl::forward(const torch::Tensor& x) {
  return torch::layer_norm(x, {weight.size(0)}, weight, bias, 1e-5);
}

// ---- attention, MLP, block -------------------------------------------------

namespace {
void check_options(const GptOptions& o) {
  check_user(o.n_layer() > 0 && o.n_head() > 0 && o.n_embd() > 0 && o.block_size() > 0 && o.vocab_size() > 0,
             "the GPT sizes must be positive (layers " + std::to_string(o.n_layer()) + ", heads " +
                 std::to_string(o.n_head()) + ", width " + std::to_string(o.n_embd()) + ", context " +
                 std::to_string(o.block_size()) + ", vocabulary " + std::to_string(o.vocab_size()) + ").",
             "pass positive --layers, --heads, --width and --context.");
  check_user(o.n_embd() % o.n_head() == 0,
             "the GPT width " + std::to_string(o.n_embd()) + " is not a multiple of its " + std::to_string(o.n_head()) +
                 " heads.",
             "pick --width as a multiple of --heads, e.g. --width " + std::to_string(o.n_head() * 32) + ".");
  check_user(o.dropout() >= 0 && o.dropout() < 1, "--dropout must be in [0, 1), got " + std::to_string(o.dropout()) + ".");
}
}  // namespace

// x W^T + b through the ATen op, not torch::nn::Linear::forward: for 3-D
// input the C++ frontend's F::linear adds the bias in place after a matmul,
// which under autocast is a separate, mixed-dtype (bf16 += fp32) pass: 4.6 ms
// of a GPT-2 124M step on the H200 (bench/RESULTS.md). at::linear casts the
// bias with the rest and folds it into the matmul, as PyTorch's nn.Linear.
namespace {
// With use_fused_linear on, the bias gradients come from ddptrain's kernels
// (fused_linear.h; with BiasGrad::kInTheAdd, from the residual add's
// LayerNorm backward), and the matmuls choose their algorithm by timing;
// the same products either way, up to the last bit.
torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x, BiasGrad bias_grad = BiasGrad::kHere) {
  return linear_bias(x, layer->weight, layer->bias, bias_grad);
}
}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptOptions& o) : n_head(o.n_head()), dropout(o.dropout()) {
  c_attn = register_module("c_attn", torch::nn::Linear(torch::nn::LinearOptions(o.n_embd(), 3 * o.n_embd()).bias(o.bias())));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(o.n_embd(), o.n_embd()).bias(o.bias())));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(o.dropout()));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x, BiasGrad c_proj_bias) {
  TORCH_CHECK(c_proj_bias == BiasGrad::kHere || dropout == 0, "attention: the bias's gradient is the add's only without dropout");
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
  // One matmul for queries, keys and values, each then B x heads x T x head_dim.
  auto qkv = linear_heads(x, c_attn->weight, c_attn->bias, 3, n_head);
  auto y = compat::causal_attention(qkv[0], qkv[1], qkv[2], dropout, is_training());
  y = y.transpose(1, 2).contiguous().view({b, t, c});
  y = linear(c_proj, y, c_proj_bias);
  return dropout > 0 ? resid_dropout(y) : y;  // p = 0 costs no kernel
}

GptMlpImpl::GptMlpImpl(const GptOptions& o) {
  c_fc = register_module("c_fc", torch::nn::Linear(torch::nn::LinearOptions(o.n_embd(), 4 * o.n_embd()).bias(o.bias())));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(4 * o.n_embd(), o.n_embd()).bias(o.bias())));
  dropout = register_module("dropout", torch::nn::Dropout(o.dropout()));
  gelu = o.gelu();
}

torch::Tensor GptMlpImpl::forward(const torch::Tensor& x, BiasGrad c_proj_bias) {
  TORCH_CHECK(c_proj_bias == BiasGrad::kHere || dropout->options.p() == 0,
              "MLP: the bias's gradient is the add's only without dropout");
  // The exact (erf) GELU, as nn.GELU(), or the tanh one, whose MLP is one
  // function so that the GELU can live in the matmuls' epilogues
  // (fused_linear.h; the exact one's is one function only as an experiment).
  auto y = mlp_gelu(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias, gelu, c_proj_bias);
  return dropout->options.p() > 0 ? dropout(y) : y;
}

GptBlockImpl::GptBlockImpl(const GptOptions& o) : recompute_mlp(o.recompute().kind == RecomputePolicy::Kind::kMlp) {
  ln_1 = register_module("ln_1", GptLayerNorm(o.n_embd(), o.bias()));
  attn = register_module("attn", CausalSelfAttention(o));
  ln_2 = register_module("ln_2", GptLayerNorm(o.n_embd(), o.bias()));
  mlp = register_module("mlp", GptMlp(o));
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  auto y = x + attn(ln_1(x));
  if (!recompute_mlp) return y + mlp(ln_2(y));
  auto branch = [this](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{mlp(ln_2(in[0]))}; };
  std::vector<torch::Tensor> params = ln_2->parameters();
  for (auto& p : mlp->parameters()) params.push_back(p);
  return y + recompute(branch, {y}, params)[0];
}

// ---- the model ---------------------------------------------------------------

GptTransformerImpl::GptTransformerImpl(const GptOptions& o) {
  wte = register_module("wte", torch::nn::Embedding(o.vocab_size(), o.n_embd()));
  wpe = register_module("wpe", torch::nn::Embedding(o.block_size(), o.n_embd()));
  drop = register_module("drop", torch::nn::Dropout(o.dropout()));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer(); ++i) h->push_back(GptBlock(o));
  ln_f = register_module("ln_f", GptLayerNorm(o.n_embd(), o.bias()));
}

TiedHeadImpl::TiedHeadImpl(const torch::Tensor& shared_weight) {
  // The same tensor, not a copy: both names refer to one parameter.
  weight = register_parameter("weight", shared_weight);
}

torch::Tensor TiedHeadImpl::forward(const torch::Tensor& x) { return linear_bias(x, weight, torch::Tensor()); }

GptImpl::GptImpl(GptOptions o) : options(std::move(o)) {
  check_options(options);
  transformer = register_module("transformer", GptTransformer(options));
  lm_head = register_module("lm_head", TiedHead(transformer->wte->weight));
  reset_parameters();
}

void GptImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double std = 0.02, residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(options.n_layer()));
  for (auto& p : named_parameters()) {
    const auto& name = p.key();
    auto& t = p.value();
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("lm_head.weight")) continue;  // the embedding, drawn once
    if (name.find(".ln_") != std::string::npos) {
      if (ends_with(".weight")) t.fill_(1.0);
      else t.zero_();
    } else if (ends_with(".bias")) {
      t.zero_();
    } else if (ends_with("c_proj.weight")) {
      t.normal_(0.0, residual_std);
    } else {
      t.normal_(0.0, std);
    }
  }
}

torch::Tensor GptImpl::forward(torch::Tensor idx) {
  const int64_t t = idx.size(1);
  check_user(t <= options.block_size(), "a sequence of " + std::to_string(t) + " tokens is longer than the model's context of " +
                                            std::to_string(options.block_size()) + ".",
             "crop the input to the last " + std::to_string(options.block_size()) + " tokens, or train with a larger --context.");
  // The positions' embeddings are the first t rows of wpe, added by
  // broadcasting: the values of wpe(arange(t)), whose gradient is a sum
  // over the batch instead of an embedding backward (a sort and several
  // kernels on CUDA).
  // The token embedding and the output head share wte's weight: with the
  // kernels, one gradient for it (fused_linear.h).
  auto ready = [this](int64_t part) {
    if (before_part) before_part(part);
  };
  ready(-1);
  models::TiedEmbedding tied(transformer->wte->weight);
  auto x = tied.embed(idx, transformer->wpe->weight.narrow(0, 0, t));
  if (options.dropout() > 0) x = transformer->drop(x);
  const auto& policy = options.recompute();
  if (!models::fused_layer_norm_applies(x, torch::Tensor(), transformer->ln_f->weight, transformer->ln_f->bias)) {
    int64_t i = 0;
    for (const auto& item : *transformer->h) {
      auto block = std::dynamic_pointer_cast<GptBlockImpl>(item);
      ready(i);
      x = policy.block(i++) ? recompute(block, x) : block->forward(x);
    }
    ready(options.n_layer());
    return tied.head(transformer->ln_f(x));
  }
  // --ln-kernel auto: each residual add is fused into the LayerNorm that
  // follows it, so a block's branch output stays pending until the next
  // LayerNorm adds it (the same sums, in the same order, as GptBlock).
  // Without dropout, and with the linear kernels (--linear-kernel native
  // keeps LibTorch's bias gradients), the branch's last bias gets its
  // gradient from that add's backward pass, not a pass of its own.
  const auto bias_grad =
      options.dropout() > 0 || !fused_linear_enabled() ? BiasGrad::kHere : BiasGrad::kInTheAdd;
  auto in_the_add = [&](const torch::nn::Linear& proj) {
    return bias_grad == BiasGrad::kInTheAdd ? proj->bias : torch::Tensor();
  };
  torch::Tensor pending, pending_bias, h;
  const double eps = 1e-5;
  // A block here takes the residual stream and the previous block's
  // pending branch (undefined before the first) and returns the new pair.
  // Everything is captured by value: under recompute it runs again in
  // backward, after this function has returned.
  auto run_block = [bias_grad, eps](GptBlockImpl& block, const torch::Tensor& x_in, const torch::Tensor& pending_in,
                                    const torch::Tensor& pending_bias_in) {
    const auto attn_bias = bias_grad == BiasGrad::kInTheAdd ? block.attn->c_proj->bias : torch::Tensor();
    torch::Tensor x_out, h_out;
    std::tie(x_out, h_out) = add_layer_norm(x_in, pending_in, block.ln_1->weight, block.ln_1->bias, eps, pending_bias_in);
    std::tie(x_out, h_out) =
        add_layer_norm(x_out, block.attn->forward(h_out, bias_grad), block.ln_2->weight, block.ln_2->bias, eps, attn_bias);
    if (!block.recompute_mlp) return std::vector<torch::Tensor>{x_out, block.mlp->forward(h_out, bias_grad)};
    auto mlp = [&block, bias_grad](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{block.mlp->forward(in[0], bias_grad)};
    };
    return std::vector<torch::Tensor>{x_out, recompute(mlp, {h_out}, block.mlp->parameters())[0]};
  };
  int64_t i = 0;
  for (const auto& item : *transformer->h) {
    auto& block = *item->as<GptBlock>();
    std::vector<torch::Tensor> out;
    ready(i);
    if (policy.block(i++)) {
      // The previous block's branch bias gets its gradient here (kInTheAdd).
      auto params = block.parameters();
      if (pending_bias.defined()) params.push_back(pending_bias);
      auto fn = [&block, run_block, pending_bias](const std::vector<torch::Tensor>& in) {
        return run_block(block, in[0], in.size() > 1 ? in[1] : torch::Tensor(), pending_bias);
      };
      out = recompute(fn, pending.defined() ? std::vector<torch::Tensor>{x, pending} : std::vector<torch::Tensor>{x},
                      params);
    } else {
      out = run_block(block, x, pending, pending_bias);
    }
    x = out[0];
    pending = out[1];
    pending_bias = in_the_add(block.mlp->c_proj);
  }
  ready(options.n_layer());
  std::tie(x, h) = add_layer_norm(x, pending, transformer->ln_f->weight, transformer->ln_f->bias, eps, pending_bias);
  return tied.head(h);
}

int64_t GptImpl::num_params(bool non_embedding) const {
  std::unordered_set<const void*> seen;
  int64_t n = 0;
  for (const auto& p : parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  if (non_embedding) n -= transformer->wpe->weight.numel();
  return n;
}

}  // namespace ddp::models
