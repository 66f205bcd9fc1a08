// Linear layers with kernel-made bias gradients (fused_linear.h).

#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/models/fused_linear.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "ddp/compat.h"
#include "ddp/dist/param_slots.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include <mutex>

#include <ATen/cuda/CUDAContext.h>

#include "ddp/cuda/embedding.h"
#include "ddp/cuda/gemm_gelu.h"
#include "ddp/cuda/linear_bias.h"
#include "ddp/cuda/side_stream.h"
#endif

namespace ddp::models {
namespace {

std::atomic<bool> g_fused_linear{false};

// [B, T, C] -> `parts` column blocks of [B, heads, T, C / (parts heads)]:
// views, as the model's split, view and transpose give.
std::vector<torch::Tensor> split_heads(const torch::Tensor& y, int64_t parts, int64_t heads) {
  const int64_t b = y.size(0), t = y.size(1), width = y.size(2) / parts;
  std::vector<torch::Tensor> out;
  for (auto& m : y.split(width, 2)) out.push_back(m.view({b, t, heads, width / heads}).transpose(1, 2));
  return out;
}

#ifdef DDP_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A parameter in bf16 for a matmul: the training step's bf16 copy where
// there is one (param_slots.h), else a cast (outside autograd's tape: the
// functions below take the fp32 parameters and return fp32 gradients).
torch::Tensor in_bf16(const torch::Tensor& p) {
  auto copy = param_slots::bf16_copy(p);
  return copy.defined() ? copy : p.to(torch::kBFloat16);
}

// A parameter's gradient of its own: a fresh fp32 tensor of its shape.
torch::Tensor fresh_gradient(const torch::Tensor& param) {
  return torch::empty(param.sizes(), param.options().dtype(torch::kFloat));
}

// Where a parameter's gradient goes: its slot in the flat gradient buffer
// when it has one (param_slots.h), else a fresh fp32 tensor of its shape.
torch::Tensor gradient_home(const torch::Tensor& param) {
  auto slot = param_slots::take_gradient_slot(param);
  return slot.defined() ? slot : fresh_gradient(param);
}

// dW = g^T x in fp32, into W's gradient slot where it has one. Nothing in
// the backward reads a slot, so there the matmul runs off the critical
// path, on the side stream while a training step's backward has one open
// (side_stream.h).
torch::Tensor weight_grad(const torch::Tensor& param, const torch::Tensor& g2, const torch::Tensor& x2) {
  auto slot = param_slots::take_gradient_slot(param);
  if (slot.defined()) {
    // The work holds an alias, not the slot: autograd adopts the slot as
    // .grad without a copy only while nothing else holds it.
    cuda::aside([g2, x2, out = slot.detach()] { cuda::weight_grad(g2, x2, out); });
    return slot;
  }
  // No slot: the parameter has none, or this is its second use in this
  // backward, whose gradient autograd will add to the first, which may
  // still be in the making on the side stream: wait for it first.
  cuda::join_side_work();
  auto dw = fresh_gradient(param);
  cuda::weight_grad(g2, x2, dw);
  return dw;
}

// A bias's gradient: the column sums of g (with the GELU's backward first
// when `gelu` is given, its result written into `dh_out` where given), into
// the bias's slot where it has one (no bias: undefined, and the sums are
// thrown away). {g', db}. A plain sum into a slot goes aside, as
// weight_grad's matmul.
std::vector<torch::Tensor> bias_grad(const torch::Tensor& param, const torch::Tensor& g, const torch::Tensor& pre,
                                     std::optional<cuda::Gelu> gelu, const torch::Tensor& dh_out = {}) {
  auto slot = param.defined() ? param_slots::take_gradient_slot(param) : torch::Tensor();
  if (slot.defined() && !gelu) {
    cuda::aside([g, out = slot.detach()] { cuda::column_sum(g, out); });  // an alias: see weight_grad
    return {g, slot};
  }
  if (!slot.defined()) cuda::join_side_work();  // as in weight_grad
  auto db = slot.defined() || !param.defined() ? slot : fresh_gradient(param);
  if (gelu) return cuda::gelu_backward_column_sum(g, pre, *gelu, db, dh_out);
  return {g, cuda::column_sum(g, db)};
}

// x W^T (+ b), bf16: cuda::linear where it takes the operands, else
// at::linear. The result is not a view for autograd (as at::linear's is not
// without a bias): the loss may overwrite the logits in place.
torch::Tensor linear16(const torch::Tensor& x, const torch::Tensor& w16, const torch::Tensor& b16) {
  if (x.is_contiguous() && x.dim() >= 2 && w16.is_contiguous() && (!b16.defined() || b16.is_contiguous())) {
    auto y = cuda::linear(x.view({-1, x.size(-1)}), w16, b16);
    if (y.defined()) {
      auto sizes = x.sizes().vec();
      sizes.back() = w16.size(0);
      return at::_unsafe_view(y, sizes);
    }
  }
  return b16.defined() ? at::linear(x, w16, b16) : at::linear(x, w16);
}

// g W for a [rows, N] g, bf16: cuda::matmul where it takes the operands,
// else at::mm.
torch::Tensor mm16(const torch::Tensor& g, const torch::Tensor& w16) {
  auto y = g.is_contiguous() && w16.is_contiguous() ? cuda::matmul(g, w16) : torch::Tensor();
  return y.defined() ? y : at::mm(g, w16);
}

// A bf16 [.., C] gradient as the contiguous [rows, C] matrix the kernels take.
torch::Tensor as_rows(const torch::Tensor& grad, int64_t cols) {
  auto g = grad.to(torch::kBFloat16).reshape({-1, cols}).contiguous();
  return cuda::column_sum_supported(g) ? g : g.clone();  // a view at an unaligned offset
}

// y = x W^T (+ b) (then gelu(y) with `gelu`), x in bf16 (cast by the
// caller, as autocast would), W and b the fp32 parameters, read in bf16.
// The matmuls are cuBLASLt's (linear16, mm16, weight_grad: algorithms chosen
// by timing). Backward: dx = g W in bf16, as autograd's for at::linear; dW = g^T x
// and db = the column sums of g, both in fp32 (weight_grad, column_sum);
// with `gelu`, g is first the GELU's backward, in the same pass as db.
// Without a bias (the GPT's output head), `b` is W again and unused. With
// bias_grad false (BiasGrad::kInTheAdd) b gets no gradient here.
struct LinearBiasFn : torch::autograd::Function<LinearBiasFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w, torch::Tensor b, bool has_bias,
                               bool gelu, bool bias_grad) {
    auto w16 = in_bf16(w);
    auto h = linear16(x, w16, has_bias ? in_bf16(b) : torch::Tensor());
    ctx->saved_data["bias"] = has_bias && bias_grad;  // no bias gradient here without both
    ctx->saved_data["gelu"] = gelu;
    if (!gelu) {
      ctx->save_for_backward({x, w16, w, b});
      return h;
    }
    ctx->save_for_backward({x, w16, w, b, h});
    return at::gelu(h);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w16 = s[1], &w = s[2], &b = s[3];
    const int64_t out = w16.size(0), in = w16.size(1);
    auto g = as_rows(grads[0], out);
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const auto bias = has_bias && ctx->needs_input_grad(2) ? b : torch::Tensor();
    torch::Tensor db;
    if (ctx->saved_data["gelu"].toBool()) {
      auto r = bias_grad(bias, g, as_rows(s[4], out), cuda::Gelu::kErf);
      g = r[0];
      db = r[1];
    } else if (bias.defined()) {
      db = bias_grad(bias, g, torch::Tensor(), std::nullopt)[1];
    }
    auto x2 = x.reshape({-1, in}).contiguous();
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = mm16(g, w16).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = weight_grad(w, g, x2);
    return {dx, dw, has_bias ? db : torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, bool gelu,
                    BiasGrad bias_grad = BiasGrad::kHere) {
  return LinearBiasFn::apply(x.to(torch::kBFloat16), weight, bias.defined() ? bias : weight, bias.defined(), gelu,
                             bias_grad == BiasGrad::kHere);
}

// The attention's projection split into heads: linear_bias's forward, then
// split_heads. Backward: the heads' gradients side by side (the split's
// cat) with the bias's column sums in one pass (heads_column_sum), then
// dW = g^T x and dx = g W as LinearBiasFn's. Without a bias, `b` is W again
// and unused.
struct LinearHeadsFn : torch::autograd::Function<LinearHeadsFn> {
  static variable_list forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w, torch::Tensor b, bool has_bias,
                               int64_t parts, int64_t heads) {
    auto w16 = in_bf16(w);
    auto y = linear16(x, w16, has_bias ? in_bf16(b) : torch::Tensor());
    ctx->saved_data["bias"] = has_bias;
    ctx->saved_data["heads"] = heads;
    ctx->save_for_backward({x, w16, w, b});
    return split_heads(y, parts, heads);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w16 = s[1], &w = s[2], &b = s[3];
    const int64_t in = w16.size(1);
    const auto bias = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2) ? b : torch::Tensor();
    std::vector<torch::Tensor> dparts;
    for (size_t i = 0; i < grads.size(); ++i) {  // an unused part: zeros of its shape
      if (grads[i].defined()) {
        dparts.push_back(grads[i].to(torch::kBFloat16));
      } else {
        const int64_t heads = ctx->saved_data["heads"].toInt();
        const int64_t width = w16.size(0) / static_cast<int64_t>(grads.size());
        dparts.push_back(torch::zeros({x.size(0), heads, x.size(1), width / heads}, w16.options()));
      }
    }
    auto r = cuda::heads_column_sum(dparts, bias.defined() ? gradient_home(bias) : torch::Tensor());
    const auto& g = r[0];
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = mm16(g, w16).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = weight_grad(w, g, x.reshape({-1, in}).contiguous());
    return {dx, dw, bias.defined() ? r[1] : torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// z = gelu_tanh(x W1^T + b1) W2^T + b2, x in bf16 (cast by the caller), the
// weights and biases the fp32 parameters, read in bf16. Forward: the first
// matmul with cuBLASLt's GELU_AUX_BIAS epilogue (it keeps pre = x W1^T +
// b1), the second as linear16. Backward: db2 = column sums of g; dW2 =
// g^T y; dh = (g W2) * gelu'(pre) in the matmul's DGELU epilogue, then
// db1, its column sums; dW1 = dh^T x; dx = dh W1. The weight and bias
// gradients in fp32, into their slots where they have them. With b2_grad
// false (BiasGrad::kInTheAdd) b2 gets no gradient here.
struct MlpGeluFn : torch::autograd::Function<MlpGeluFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w1, torch::Tensor b1,
                               torch::Tensor w2, torch::Tensor b2, bool b2_grad) {
    const int64_t in = x.size(-1);
    auto x2 = x.reshape({-1, in}).contiguous();
    auto w1_16 = in_bf16(w1), w2_16 = in_bf16(w2), b1_16 = in_bf16(b1);
    auto r = cuda::linear_gelu_tanh(x2, w1_16, b1_16);
    const torch::Tensor y = r[0], pre = r[1];  // the output and the pre-activation
    auto z = linear16(y, w2_16, in_bf16(b2));
    ctx->save_for_backward({x2, w1_16, w2_16, y, w1, b1, w2, b2, pre});
    ctx->saved_data["b2_grad"] = b2_grad;
    auto sizes = x.sizes().vec();
    sizes.back() = w2.size(0);
    return z.view(sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &x2 = s[0], &w1_16 = s[1], &w2_16 = s[2], &y = s[3];
    const auto &w1 = s[4], &b1 = s[5], &w2 = s[6], &b2 = s[7], &pre = s[8];
    auto g = as_rows(grads[0], w2_16.size(0));
    torch::Tensor db2, dw2, dw1;
    if (ctx->needs_input_grad(4) && ctx->saved_data["b2_grad"].toBool())
      db2 = bias_grad(b2, g, torch::Tensor(), std::nullopt)[1];
    if (ctx->needs_input_grad(3)) dw2 = weight_grad(w2, g, y);
    if (!ctx->needs_input_grad(0) && !ctx->needs_input_grad(1) && !ctx->needs_input_grad(2))
      return {torch::Tensor(), torch::Tensor(), torch::Tensor(), dw2, db2, torch::Tensor()};
    const auto b1_wanted = ctx->needs_input_grad(2) ? b1 : torch::Tensor();
    torch::Tensor dh, db1;
    // dh out of the matmul's epilogue where cuBLASLt has it (db1 then in a
    // column sum of its own), else the matmul, then one pass for both.
    dh = cuda::matmul_gelu_tanh_backward(g, w2_16, pre);
    if (dh.defined()) {
      if (b1_wanted.defined()) db1 = bias_grad(b1_wanted, dh, torch::Tensor(), std::nullopt)[1];
    } else {
      auto r = bias_grad(b1_wanted, mm16(g, w2_16), pre, cuda::Gelu::kTanh);
      dh = r[0];
      db1 = r[1];
    }
    if (ctx->needs_input_grad(1)) dw1 = weight_grad(w1, dh, x2);
    torch::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      auto sizes = grads[0].sizes().vec();
      sizes.back() = w1_16.size(1);
      dx = mm16(dh, w1_16).view(sizes);
    }
    return {dx, dw1, ctx->needs_input_grad(2) ? db1 : torch::Tensor(), dw2, db2, torch::Tensor()};
  }
};

// ---- the tied embedding and head (TiedEmbedding) ----------------------------

// The head's weight gradient, from its backward to the embedding's.
struct TiedGradient : torch::CustomClassHolder {
  explicit TiedGradient(torch::Tensor w) : weight(std::move(w)) {}
  torch::Tensor weight;  // the parameter: its slot is found by it
  std::mutex mu;
  torch::Tensor dw;  // set by the head's backward, taken by the embedding's
};

c10::intrusive_ptr<TiedGradient> tied_gradient(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<TiedGradient>(ctx->saved_data["tie"].toCapsule());
}

// The embedding's weight gradient: the head's where its backward left one,
// else the weight's slot (zeroed) or zeros, with the lookup's rows (grad,
// [.., C]) added; the weight's one gradient.
torch::Tensor tied_embedding_gradient(AutogradContext* ctx, const torch::Tensor& grad) {
  auto idx = ctx->get_saved_variables()[0];
  auto tie = tied_gradient(ctx);
  torch::Tensor dw;
  {
    std::lock_guard<std::mutex> lock(tie->mu);
    dw = std::move(tie->dw);
    tie->dw = torch::Tensor();
  }
  // The head's weight gradient may still be in the making on the side stream.
  cuda::join_side_work();
  if (!dw.defined()) dw = gradient_home(tie->weight).zero_();  // the head took LibTorch's path, or is not in this graph
  const int64_t c = tie->weight.size(1);
  cuda::embedding_backward_add(grad.to(torch::kFloat).reshape({-1, c}).contiguous(), idx.reshape({-1}), dw);
  return dw;
}

// weight[idx] (fp32). Backward: tied_embedding_gradient.
struct TiedEmbedFn : torch::autograd::Function<TiedEmbedFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor weight, torch::Tensor idx,
                               c10::intrusive_ptr<torch::CustomClassHolder> tie) {
    ctx->saved_data["tie"] = c10::IValue::make_capsule(std::move(tie));
    ctx->save_for_backward({idx});
    return at::embedding(weight, idx);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {tied_embedding_gradient(ctx, grads[0]), torch::Tensor(), torch::Tensor()};
  }
};

// x W^T for the tied weight W, which is not an input here (so autograd
// gives it no second gradient): the backward computes dx, and leaves
// dW = g^T x (fp32, in W's slot where it has one) for TiedEmbedFn.
struct TiedHeadFn : torch::autograd::Function<TiedHeadFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, c10::intrusive_ptr<torch::CustomClassHolder> tie) {
    auto t = c10::static_intrusive_pointer_cast<TiedGradient>(tie);
    auto w16 = in_bf16(t->weight);
    ctx->saved_data["tie"] = c10::IValue::make_capsule(std::move(tie));
    ctx->save_for_backward({x, w16});
    return linear16(x, w16, torch::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w16 = s[1];
    auto tie = tied_gradient(ctx);
    auto g = as_rows(grads[0], w16.size(0));
    auto dw = weight_grad(tie->weight, g, x.reshape({-1, w16.size(1)}).contiguous());
    {
      std::lock_guard<std::mutex> lock(tie->mu);
      // A second backward through this graph (retain_graph) before the
      // embedding's took the first: both count.
      if (tie->dw.defined()) {
        cuda::join_side_work();
        tie->dw.add_(dw);
      }
      else tie->dw = dw;
    }
    return {mm16(g, w16).view(x.sizes()), torch::Tensor()};
  }
};
#endif

}  // namespace

TiedEmbedding::TiedEmbedding(torch::Tensor weight) : weight_(std::move(weight)) {}

torch::Tensor TiedEmbedding::embed(const torch::Tensor& idx, const torch::Tensor& pos) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (g_fused_linear.load() && torch::GradMode::is_enabled() && weight_.requires_grad() && weight_.is_cuda() &&
      weight_.dim() == 2 && weight_.scalar_type() == torch::kFloat && idx.is_cuda() &&
      idx.scalar_type() == torch::kLong) {
    meeting_ = c10::make_intrusive<TiedGradient>(weight_);
    auto x = TiedEmbedFn::apply(weight_, idx, meeting_);
    return pos.defined() ? x + pos : x;
  }
#endif
  auto x = torch::embedding(weight_, idx);
  return pos.defined() ? x + pos : x;
}

torch::Tensor TiedEmbedding::head(const torch::Tensor& x) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (meeting_ && fused_linear_applies(x, weight_, torch::Tensor())) {
    // One head per embedding: a second would leave its gradient where the
    // first's goes, and the embedding's backward takes only one.
    TORCH_CHECK(!head_taken_, "TiedEmbedding::head() called twice; make one TiedEmbedding per forward pass");
    head_taken_ = true;
    return TiedHeadFn::apply(x.to(torch::kBFloat16), meeting_);
  }
#endif
  return linear_bias(x, weight_, torch::Tensor());
}

void use_fused_linear(bool on) { g_fused_linear.store(on); }
bool fused_linear_enabled() { return g_fused_linear.load(); }

bool fused_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  return g_fused_linear.load() && x.is_cuda() && x.dim() >= 2 && (!bias.defined() || bias.scalar_type() == torch::kFloat) &&
         weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.size(0) % 8 == 0 &&
         x.size(-1) == weight.size(1) && compat::autocast_dtype(c10::DeviceType::CUDA) == torch::kBFloat16 &&
         cuda::gemm_gelu_available();
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

torch::Tensor linear_bias(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          BiasGrad bias_grad) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, weight, bias)) return apply(x, weight, bias, false, bias_grad);
#endif
  return torch::linear(x, weight, bias_grad == BiasGrad::kHere || !bias.defined() ? bias : bias.detach());
}

std::vector<torch::Tensor> linear_heads(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                        int64_t parts, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && parts > 0 && heads > 0 && weight.dim() == 2 && weight.size(0) % (parts * heads) == 0,
              "linear_heads: x must be [B, T, C] and the weight's rows a multiple of parts x heads, got x ", x.sizes(),
              ", weight ", weight.sizes(), ", ", parts, " parts of ", heads, " heads");
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, weight, bias) && parts <= 3 && (weight.size(0) / (parts * heads)) % 8 == 0)
    return LinearHeadsFn::apply(x.to(torch::kBFloat16), weight, bias.defined() ? bias : weight, bias.defined(), parts,
                                heads);
#endif
  return split_heads(linear_bias(x, weight, bias), parts, heads);
}

torch::Tensor mlp_gelu(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                       const torch::Tensor& b2, MlpGelu gelu, BiasGrad b2_grad) {
  const bool tanh = gelu == MlpGelu::kTanh;
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, w1, b1) && x.numel() > 0 && x.size(-1) % 8 == 0 && b1.defined() && b2.defined() &&
      b2.scalar_type() == torch::kFloat && w2.dim() == 2 && w2.scalar_type() == torch::kFloat && w2.size(0) % 8 == 0 &&
      w2.size(1) == w1.size(0) && tanh)
    return MlpGeluFn::apply(x.to(torch::kBFloat16), w1, b1, w2, b2, b2_grad == BiasGrad::kHere);
#endif
  // linear_bias takes b2 itself (not detached: its bf16 copy is found by the
  // parameter) and leaves it no gradient under kInTheAdd.
  if (!tanh) return linear_bias(linear_gelu(x, w1, b1), w2, b2, b2_grad);
  return torch::linear(torch::gelu(torch::linear(x, w1, b1), "tanh"), w2,
                       b2_grad == BiasGrad::kHere || !b2.defined() ? b2 : b2.detach());
}

torch::Tensor linear_gelu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_linear_applies(x, weight, bias)) return apply(x, weight, bias, true);
#endif
  return torch::gelu(torch::linear(x, weight, bias));
}

}  // namespace ddp::models
