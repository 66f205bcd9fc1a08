// The GPT's linear layers with kernel-made bias gradients
// (src/models/fused_linear.cpp, src/cuda/linear_bias.cu): off by default and
// on CPU tensors they are LibTorch's ops; on a GPU the column sums match
// float64, the GELU's backward matches ATen's within bf16 rounding, the
// layers' gradients match LibTorch's, and a GPT trains as with LibTorch's.
#include "ddp/models/fused_linear.h"

#include <ATen/record_function.h>

#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "ddp/compat.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/models/fused_layer_norm.h"
#include "ddp/models/gpt.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/train_step.h"
#include "support/small_gpt.h"
#include "support/testing.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/gemm_gelu.h"
#include "ddp/cuda/linear_bias.h"
#endif

namespace ddp::models {
namespace {

using ddp::testing::FusedLayerNormOn;
using ddp::testing::FusedLinearOn;

TEST(FusedLinear, OffByDefaultAndCpuTensorsTakeLibTorchsOps) {
  EXPECT_FALSE(fused_linear_enabled());
  FusedLinearOn on;
  torch::manual_seed(3);
  auto x = torch::randn({2, 3, 8}), w = torch::randn({16, 8}), b = torch::randn({16});
  EXPECT_FALSE(fused_linear_applies(x, w, b));
  EXPECT_TRUE(torch::equal(linear_bias(x, w, b), torch::linear(x, w, b)));
  EXPECT_TRUE(torch::equal(linear_gelu(x, w, b), torch::gelu(torch::linear(x, w, b))));
  auto w2 = torch::randn({8, 16}), b2 = torch::randn({8});
  EXPECT_TRUE(torch::equal(mlp_gelu(x, w, b, w2, b2, MlpGelu::kTanh),
                           torch::linear(torch::gelu(torch::linear(x, w, b), "tanh"), w2, b2)));
  EXPECT_TRUE(torch::equal(mlp_gelu(x, w, b, w2, b2, MlpGelu::kExact),
                           torch::linear(torch::gelu(torch::linear(x, w, b)), w2, b2)));
  auto heads = linear_heads(x, w, b, 2, 2);  // 16 outputs: two parts of two heads of 4
  ASSERT_EQ(heads.size(), 2u);
  auto y = torch::linear(x, w, b);
  EXPECT_TRUE(torch::equal(heads[1], y.narrow(2, 8, 8).reshape({2, 3, 2, 4}).transpose(1, 2)));
  EXPECT_EQ(heads[1].sizes(), (std::vector<int64_t>{2, 2, 3, 4}));
  EXPECT_THROW(linear_heads(x, w, b, 3, 2), c10::Error);  // 16 rows are not 3 x 2 heads
}

#ifdef DDP_WITH_CUDA_KERNELS
double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kDouble), r = want.to(torch::kDouble);
  return ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item<double>();
}

// Column sums of bf16 matrices against float64, at GPT-2's widths and odd
// row counts, 2-D and 3-D; deterministic.
TEST(FusedLinear, ColumnSumMatchesFloat64_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(5);
  for (auto shape : std::vector<std::vector<int64_t>>{{16384, 768}, {4, 1024, 2304}, {37, 3072}, {1, 8}, {5, 3, 24}}) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    auto g = torch::randn(shape, opts).to(torch::kBFloat16);
    ASSERT_TRUE(cuda::column_sum_supported(g));
    auto got = cuda::column_sum(g);
    EXPECT_EQ(got.scalar_type(), torch::kFloat);
    auto want = g.to(torch::kDouble).reshape({-1, shape.back()}).sum(0);
    // fp32 sums of up to 16k terms of size ~1: well within 1e-5 of the
    // largest column sum's magnitude (~sqrt(rows)).
    EXPECT_LE(rel_err(got, want), 1e-5);
    EXPECT_TRUE(torch::equal(got, cuda::column_sum(g))) << "deterministic";
  }
  EXPECT_FALSE(cuda::column_sum_supported(torch::randn({4, 12}, opts).to(torch::kBFloat16)));  // width % 8
  EXPECT_FALSE(cuda::column_sum_supported(torch::randn({4, 16}, opts)));                        // fp32
}

// Both GELUs' backward against ATen's, and their column sums.
TEST(FusedLinear, GeluBackwardMatchesATen_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(6);
  for (auto form : {cuda::Gelu::kErf, cuda::Gelu::kTanh}) {
    const std::string approximate = form == cuda::Gelu::kTanh ? "tanh" : "none";
    for (auto shape : std::vector<std::vector<int64_t>>{{2048, 3072}, {3, 17, 64}}) {
      SCOPED_TRACE(approximate + " " + ::testing::PrintToString(shape));
      auto dy = torch::randn(shape, opts).to(torch::kBFloat16);
      auto h = (torch::randn(shape, opts) * 3).to(torch::kBFloat16);
      auto r = cuda::gelu_backward_column_sum(dy, h, form);
      auto want = at::gelu_backward(dy, h, approximate);
      ASSERT_EQ(r[0].scalar_type(), torch::kBFloat16);
      // Within one unit of bf16 rounding of each element (the same formula in
      // fp32; erf, exp and tanh may round differently in the last fp32 bit).
      auto diff = (r[0].to(torch::kFloat) - want.to(torch::kFloat)).abs();
      auto bound = want.to(torch::kFloat).abs() * (1.0 / 128) + 1e-30;
      EXPECT_TRUE(diff.le(bound).all().item<bool>()) << diff.max().item<double>();
      // The other GELU's gradient differs by more than that somewhere.
      auto other = at::gelu_backward(dy, h, form == cuda::Gelu::kTanh ? "none" : "tanh");
      EXPECT_FALSE((r[0].to(torch::kFloat) - other.to(torch::kFloat)).abs().le(bound).all().item<bool>());
      auto sums = r[0].to(torch::kDouble).reshape({-1, shape.back()}).sum(0);
      EXPECT_LE(rel_err(r[1], sums), 1e-5) << "the sums of the bf16 result it wrote";
    }
  }
}

// Attention's q, k and v gradients side by side with their column sums:
// the cat of the transposed parts to the bit, the sums against float64,
// for parts at ATen's dense layouts (B, T, H, D order, as cuDNN writes
// them, and B, H, T, D), strided views into one buffer, odd part counts
// and sizes, and parts that must be copied first (a stride not a multiple
// of 8, a start 2 bytes off 16-byte alignment).
TEST(FusedLinear, HeadsColumnSumIsTheCatAndItsSums_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(6);
  struct Case {
    std::string name;
    std::vector<torch::Tensor> parts;
  };
  auto bthd = [&](int64_t b, int64_t h, int64_t t, int64_t d) {  // [B, H, T, D] at B, T, H, D strides
    return torch::randn({b, t, h, d}, opts).to(torch::kBFloat16).transpose(1, 2);
  };
  auto bhtd = [&](int64_t b, int64_t h, int64_t t, int64_t d) {
    return torch::randn({b, h, t, d}, opts).to(torch::kBFloat16);
  };
  auto of_one = torch::randn({3, 5, 3 * 2 * 16}, opts).to(torch::kBFloat16);  // [B, T, 3C]: q, k, v views
  std::vector<torch::Tensor> views;
  for (auto& m : of_one.split(32, 2)) views.push_back(m.view({3, 5, 2, 16}).transpose(1, 2));
  auto odd_stride = torch::randn({2, 4, 7, 20}, opts).to(torch::kBFloat16).narrow(3, 0, 16);  // D's stride 1, T's 20
  std::vector<Case> cases{
      {"gpt2 bthd", {bthd(4, 12, 256, 64), bthd(4, 12, 256, 64), bthd(4, 12, 256, 64)}},
      {"bhtd", {bhtd(2, 3, 37, 8), bhtd(2, 3, 37, 8), bhtd(2, 3, 37, 8)}},
      {"mixed, two parts", {bthd(1, 4, 130, 16), bhtd(1, 4, 130, 16)}},
      {"views of one projection", views},
      {"T's stride 20: copied first", {odd_stride, bhtd(2, 4, 7, 16)}},
      {"an unaligned start: copied first",
       {torch::randn({2 * 3 * 5 * 16 + 1}, opts).to(torch::kBFloat16).narrow(0, 1, 2 * 3 * 5 * 16).view({2, 3, 5, 16})}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto& p = c.parts[0];
    auto r = cuda::heads_column_sum(c.parts);
    std::vector<torch::Tensor> rows;
    for (const auto& t : c.parts) rows.push_back(t.transpose(1, 2).reshape({p.size(0) * p.size(2), -1}));
    auto want = torch::cat(rows, 1);
    ASSERT_EQ(r[0].sizes(), want.sizes());
    EXPECT_TRUE(torch::equal(r[0], want)) << "the cat, bit for bit";
    EXPECT_EQ(r[1].scalar_type(), torch::kFloat);
    EXPECT_LE(rel_err(r[1], want.to(torch::kDouble).sum(0)), 1e-5);
    EXPECT_TRUE(torch::equal(r[1], cuda::column_sum(want))) << "the same sums as column_sum of the cat";
    auto slot = torch::full({want.size(1)}, 7.0f, opts);
    EXPECT_EQ(cuda::heads_column_sum(c.parts, slot)[1].data_ptr(), slot.data_ptr()) << "into the slot given";
    EXPECT_TRUE(torch::equal(slot, r[1]));
  }
  EXPECT_THROW(cuda::heads_column_sum({bthd(1, 2, 3, 12)}), c10::Error);                      // head_dim % 8
  EXPECT_THROW(cuda::heads_column_sum({bthd(1, 2, 3, 16), bthd(1, 2, 4, 16)}), c10::Error);  // shapes differ
}

// linear_heads under bf16 autocast against the model's split of
// torch::linear: q, k and v of the same layout and products within bf16
// rounding (the tuned matmul may round a last bit otherwise), and gradients
// within bf16 rounding through a causal attention, for x and, with a bias and
// without, the weight and bias; the fused function's node on the tape.
TEST(FusedLinear, LinearHeadsMatchesTheSplitOfLibTorchsLinear_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  FusedLinearOn on;
  for (bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "bias" : "no bias");
    torch::manual_seed(9);
    const int64_t B = 2, T = 48, C = 64, H = 4;
    auto x = torch::randn({B, T, C}, opts).requires_grad_();
    auto w = (torch::randn({3 * C, C}, opts) * 0.1).requires_grad_();
    auto b = with_bias ? torch::randn({3 * C}, opts).requires_grad_() : torch::Tensor();
    auto rx = x.detach().clone().requires_grad_(), rw = w.detach().clone().requires_grad_();
    auto rb = with_bias ? b.detach().clone().requires_grad_() : torch::Tensor();
    auto g = torch::randn({B, H, T, C / H}, opts).to(torch::kBFloat16);
    std::vector<torch::Tensor> y, ry;
    torch::Tensor out, rout;
    {
      compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
      y = linear_heads(x, w, b, 3, H);
      out = compat::causal_attention(y[0], y[1], y[2], 0.0, true);
      auto all = torch::linear(rx, rw, rb);
      for (auto& m : all.split(C, 2)) ry.push_back(m.view({B, T, H, C / H}).transpose(1, 2));
      rout = compat::causal_attention(ry[0], ry[1], ry[2], 0.0, true);
    }
    ASSERT_EQ(y.size(), 3u);
    for (int i = 0; i < 3; ++i) {  // the same products; the tuned algorithm may round the last bit otherwise
      EXPECT_EQ(y[i].sizes(), ry[i].sizes());
      EXPECT_EQ(y[i].strides(), ry[i].strides()) << "part " << i;
      EXPECT_LE(rel_err(y[i], ry[i]), 1.0 / 128) << "part " << i;
    }
    ASSERT_TRUE(y[0].grad_fn());
    EXPECT_NE(y[0].grad_fn()->name().find("LinearHeadsFn"), std::string::npos) << y[0].grad_fn()->name();
    EXPECT_LE(rel_err(out, rout), 1.0 / 64);
    (out.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
    (rout.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
    EXPECT_LE(rel_err(x.grad(), rx.grad()), 1.0 / 128);
    EXPECT_LE(rel_err(w.grad(), rw.grad()), 1.0 / 128);
    if (with_bias) {
      EXPECT_LE(rel_err(b.grad(), rb.grad()), 1.0 / 128);
      EXPECT_EQ(b.grad().scalar_type(), torch::kFloat);
    }
  }
  // Only q used: k and v get zero gradients, as the split's backward gives.
  torch::manual_seed(10);
  auto x = torch::randn({1, 8, 32}, opts).requires_grad_();
  auto w = torch::randn({96, 32}, opts).requires_grad_(), b = torch::randn({96}, opts).requires_grad_();
  {
    compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
    auto y = linear_heads(x, w, b, 3, 2);
    y[0].to(torch::kFloat).sum().backward();
  }
  EXPECT_TRUE(torch::equal(b.grad().narrow(0, 32, 64), torch::zeros({64}, opts)));
  EXPECT_TRUE(torch::equal(b.grad().narrow(0, 0, 32), torch::full({32}, 8.0f, opts)));
}

// One backward of a GPT with the kernels (the LayerNorm at width 128 takes
// the vectorised kernels, whose backward sums the c_proj biases; the qkv
// split's backward sums c_attn's) against the same GPT on LibTorch's ops:
// every bias gets its own gradient, within bf16 rounding of LibTorch's, and
// none is zero. A bias summed twice, missed or handed to the wrong add would
// be off by its whole size.
TEST(FusedLinear, GptBiasGradientsMatchLibTorchsOps_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const torch::Device gpu(torch::kCUDA, 0);
  const auto o = GptOptions().n_layer(2).n_head(4).n_embd(128).block_size(32).vocab_size(97).gelu(GptGelu::kTanh);
  torch::manual_seed(12);
  auto idx = torch::randint(0, 97, {4, 32}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
  auto targets = torch::randint(0, 97, {4, 32}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
  std::vector<std::map<std::string, torch::Tensor>> grads;
  for (bool kernels : {true, false}) {
    torch::manual_seed(13);
    Gpt model(o);
    model->to(gpu);
    use_fused_linear(kernels);
    use_fused_layer_norm(kernels);
    {
      compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
      auto logits = model->forward(idx);
      torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, 97}), targets.view({-1})).backward();
    }
    use_fused_linear(false);
    use_fused_layer_norm(false);
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad();
    grads.push_back(g);
  }
  int biases = 0;
  for (const auto& [name, want] : grads[1]) {
    if (name.size() < 5 || name.compare(name.size() - 5, 5, ".bias") != 0) continue;
    SCOPED_TRACE(name);
    ++biases;
    const auto& got = grads[0].at(name);
    ASSERT_TRUE(got.defined() && want.defined());
    EXPECT_GT(want.abs().max().item<double>(), 0);
    EXPECT_LE(rel_err(got, want), 2e-2);
  }
  EXPECT_EQ(biases, 2 * 6 + 1) << "per block: ln_1, c_attn, c_proj, ln_2, c_fc, c_proj; and ln_f";
}

// linear_bias and linear_gelu under bf16 autocast against LibTorch's ops:
// the same products (cuBLASLt's, with the algorithm chosen by timing, so the
// last bit may differ from LibTorch's choice), and the gradients, the bias's
// in fp32, within the bf16 rounding of LibTorch's.
TEST(FusedLinear, LayersMatchLibTorchUnderAutocast_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  FusedLinearOn on;
  for (bool gelu : {false, true}) {
    SCOPED_TRACE(gelu ? "linear_gelu" : "linear_bias");
    torch::manual_seed(7);
    auto x = torch::randn({4, 64, 96}, opts).requires_grad_();
    auto w = (torch::randn({256, 96}, opts) * 0.1).requires_grad_();
    auto b = torch::randn({256}, opts).requires_grad_();
    auto g = torch::randn({4, 64, 256}, opts).to(torch::kBFloat16);
    auto rx = x.detach().clone().requires_grad_(), rw = w.detach().clone().requires_grad_(),
         rb = b.detach().clone().requires_grad_();
    torch::Tensor y, ry;
    {
      compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
      ASSERT_TRUE(fused_linear_applies(x, w, b));
      y = gelu ? linear_gelu(x, w, b) : linear_bias(x, w, b);
      use_fused_linear(false);
      ry = gelu ? torch::gelu(torch::linear(rx, rw, rb)) : torch::linear(rx, rw, rb);
      use_fused_linear(true);
    }
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    ASSERT_TRUE(y.grad_fn());
    EXPECT_NE(y.grad_fn()->name().find("LinearBiasFn"), std::string::npos) << y.grad_fn()->name();
    EXPECT_LE(rel_err(y, ry), 1.0 / 128);
    (y.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
    (ry.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
    EXPECT_LE(rel_err(x.grad(), rx.grad()), 1.0 / 128);
    EXPECT_LE(rel_err(w.grad(), rw.grad()), 1.0 / 128);
    EXPECT_LE(rel_err(b.grad(), rb.grad()), 1.0 / 128);
    EXPECT_EQ(b.grad().scalar_type(), torch::kFloat);
  }
}

// The tanh GELU's MLP in one function (cuBLASLt's epilogues) under bf16
// autocast against LibTorch's linear, gelu and linear. Outputs within bf16
// rounding (the epilogue rounds the GELU of the fp32 sum once, LibTorch
// rounds the pre-activation first), gradients within 2^-7 of the largest.
TEST(FusedLinear, MlpMatchesLibTorchUnderAutocast_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  ASSERT_TRUE(cuda::gemm_gelu_available());
  FusedLinearOn on;
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(8);
  auto x = torch::randn({4, 64, 96}, opts).requires_grad_();
  auto w1 = (torch::randn({384, 96}, opts) * 0.1).requires_grad_(), b1 = torch::randn({384}, opts).requires_grad_();
  auto w2 = (torch::randn({96, 384}, opts) * 0.05).requires_grad_(), b2 = torch::randn({96}, opts).requires_grad_();
  std::vector<torch::Tensor> ref;
  for (const auto& t : {x, w1, b1, w2, b2}) ref.push_back(t.detach().clone().requires_grad_());
  auto g = torch::randn({4, 64, 96}, opts).to(torch::kBFloat16);
  torch::Tensor y, ry;
  {
    compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
    y = mlp_gelu(x, w1, b1, w2, b2, MlpGelu::kTanh);
    ry = torch::linear(torch::gelu(torch::linear(ref[0], ref[1], ref[2]), "tanh"), ref[3], ref[4]);
  }
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  ASSERT_EQ(y.sizes(), ry.sizes());
  ASSERT_TRUE(y.grad_fn());
  EXPECT_NE(y.grad_fn()->name().find("MlpGeluFn"), std::string::npos) << "the fused MLP, not LibTorch's ops";
  EXPECT_LE(rel_err(y, ry), 1.0 / 64);
  (y.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  (ry.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  const char* names[] = {"x", "w1", "b1", "w2", "b2"};
  const std::vector<torch::Tensor> got{x, w1, b1, w2, b2};
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].grad().defined()) << names[i];
    EXPECT_LE(rel_err(got[i].grad(), ref[i].grad()), 1.0 / 128) << names[i];
  }
  EXPECT_EQ(b1.grad().scalar_type(), torch::kFloat);
  // Frozen weights and biases: the input's gradient alone, the same.
  auto x2 = x.detach().clone().requires_grad_();
  {
    compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
    y = mlp_gelu(x2, w1.detach(), b1.detach(), w2.detach(), b2.detach(), MlpGelu::kTanh);
  }
  (y.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  EXPECT_LE(rel_err(x2.grad(), x.grad()), 1e-6) << "the same kernels on the same values";
}

// ATen ops dispatched while `fn` runs, by name.
std::map<std::string, int> ops_during(const std::function<void()>& fn) {
  static std::mutex mu;
  static std::map<std::string, int>* seen = nullptr;
  std::map<std::string, int> out;
  {
    std::lock_guard<std::mutex> lock(mu);
    seen = &out;
  }
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback([](const at::RecordFunction& f) -> std::unique_ptr<at::ObserverContext> {
    std::lock_guard<std::mutex> lock(mu);
    if (seen) ++(*seen)[f.name()];
    return nullptr;
  }));
  fn();
  at::removeCallback(handle);
  std::lock_guard<std::mutex> lock(mu);
  seen = nullptr;
  return out;
}

// Under a training step's GradSync, the GPT's linear and LayerNorm kernels
// write every weight, bias and LayerNorm gradient straight into its slot of
// the flat buffer, read the step's bf16 copies of the weights, and give the
// gradients, to the bit, that the same kernels give without the slots (with
// casts and fresh tensors): the same fp32 matmuls on the same bf16 values.
// Both GELUs: the tanh one's MLP in one function, the exact one's as two
// layers. With the copies made, each
// forward casts the same tensors (no parameter: a cast more is a copy
// missed).
TEST(FusedLinear, GptGradientsGoStraightIntoTheFlatBuffer_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  FusedLinearOn on;
  FusedLayerNormOn ln_on;
  const torch::Device gpu(torch::kCUDA, 0);
  std::vector<int> casts;  // the second step's forward's, by case
  for (auto gelu : {GptGelu::kTanh, GptGelu::kExact}) {
    SCOPED_TRACE(ddp::testing::mlp_case_name(gelu));
    const auto options = GptOptions().n_layer(2).n_head(2).n_embd(64).block_size(32).vocab_size(96).gelu(gelu);
    torch::manual_seed(21);
    Gpt model(options), plain(options);
    ddp::testing::copy_parameters(*model, *plain);
    model->to(gpu);
    plain->to(gpu);
    auto idx = torch::randint(0, 96, {4, 32}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
    auto target = torch::randint(0, 96, {4 * 32}, idx.options());
    auto loss_of = [&](Gpt& m) {
      compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
      return torch::nn::functional::cross_entropy(m->forward(idx).view({-1, 96}).to(torch::kFloat), target);
    };
    auto world = ddp::testing::one_rank_world(true);
    GradSync sync(*model, *world);
    for (int step = 0; step < 2; ++step) {  // the first step asks for the bf16 copies, the second has them
      SCOPED_TRACE("step " + std::to_string(step));
      sync.zero_grad(/*set_to_none=*/true);
      sync.bf16_copies(true);
      torch::Tensor loss;
      auto ops = ops_during([&] { loss = loss_of(model); });
      if (step == 1) casts.push_back(ops["aten::_to_copy"]);
      loss.backward();
      const size_t slots = sync.gradient_slots_taken();
      sync.bf16_copies(false);
      sync.finish();
      // Each block: 4 weights, 4 biases, 2 LayerNorms of 2; ln_f's 2; wte,
      // taken by the head's backward (the embedding's adds to it: TiedEmbedding).
      // Not wpe (a slice of it is added: autograd's sum).
      EXPECT_EQ(slots, 2u * (4 + 4 + 4) + 2 + 1);
    }
    EXPECT_TRUE(sync.has_bf16_copies());
    loss_of(plain).backward();
    auto got = model->named_parameters();
    for (const auto& p : plain->named_parameters()) {
      if (p.key() == "lm_head.weight") continue;  // the same tensor as wte
      ASSERT_TRUE(got[p.key()].grad().defined()) << p.key();
      EXPECT_TRUE(torch::equal(got[p.key()].grad(), p.value().grad()))
          << p.key() << ": " << (got[p.key()].grad() - p.value().grad()).abs().max().item<double>();
    }
  }
  ASSERT_EQ(casts.size(), 2u);
  EXPECT_GT(casts[0], 0) << "the logits' cast, at least: the count is seen";
  for (size_t i = 1; i < casts.size(); ++i) EXPECT_EQ(casts[i], casts[0]) << "case " << i;
}

// The tied embedding and head: the weight's gradient matches LibTorch's
// embedding + linear under autocast (within the bf16 rounding LibTorch's
// weight gradient takes), without ATen's dense embedding backward or a
// sum of two [V, C] gradients; deterministic; a second backward adds.
TEST(FusedLinear, TiedEmbeddingGivesItsWeightOneGradient_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  FusedLinearOn on;
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(31);
  const int64_t v = 200, c = 64;
  auto w = (torch::randn({v, c}, opts) * 0.1).requires_grad_();
  auto rw = w.detach().clone().requires_grad_();
  auto idx = torch::randint(0, 24, {4, 33}, opts.dtype(torch::kLong));  // repeats; most rows unused
  auto target = torch::randint(0, v, {4 * 33}, idx.options());
  auto loss_of = [&](const torch::Tensor& weight, bool tied) {
    compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
    TiedEmbedding t(weight);
    auto x = (tied ? t.embed(idx) : torch::embedding(weight, idx)) * 2.0;
    auto logits = tied ? t.head(x) : torch::linear(x, weight);
    return torch::nn::functional::cross_entropy(logits.view({-1, v}).to(torch::kFloat), target);
  };
  auto loss = loss_of(w, true);
  auto ours = ops_during([&] { loss.backward(); });
  use_fused_linear(false);
  loss = loss_of(rw, false);
  auto theirs = ops_during([&] { loss.backward(); });
  use_fused_linear(true);
  // The control: LibTorch's backward has both.
  EXPECT_GT(theirs["aten::embedding_dense_backward"], 0);
  EXPECT_GT(theirs["aten::add"] + theirs["aten::add_"], 0);
  EXPECT_EQ(ours["aten::embedding_dense_backward"], 0);
  EXPECT_EQ(ours["aten::add"] + ours["aten::add_"], 0) << "no sum of the two gradients";
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);
  EXPECT_LE(rel_err(w.grad(), rw.grad()), 1.0 / 128);
  auto first = w.grad().clone();
  w.mutable_grad() = torch::Tensor();
  loss_of(w, true).backward();
  EXPECT_TRUE(torch::equal(w.grad(), first)) << "deterministic";
  loss_of(w, true).backward();  // .grad is there: autograd adds
  EXPECT_TRUE(torch::equal(w.grad(), first * 2));
  compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
  TiedEmbedding t(w);
  auto x = t.embed(idx);
  t.head(x);
  EXPECT_THROW(t.head(x), c10::Error) << "one head per embedding";
}

// Whenever GradSync calls the bf16 copies current (so a window skips the
// cast), they hold the parameters: across CUDA graph replays, which move no
// version counter, and an eager step of a smaller batch between them; with
// an optimizer that writes the copies (AdamW: ddptrain's kernel) and one
// that does not (SGD, whose replays leave them a step behind).
TEST(FusedLinear, Bf16CopiesHoldTheParametersAcrossGraphReplays_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  FusedLinearOn on;
  FusedLayerNormOn ln_on;
  const torch::Device gpu(torch::kCUDA, 0);
  for (const std::string name : {"sgd", "adamw"}) {
    SCOPED_TRACE(name);
    auto world = ddp::testing::one_rank_world(true);
    torch::manual_seed(11);
    ddp::LmTask task;
    auto model = task.make_gpt(GptOptions().n_layer(2).n_head(2).n_embd(64).block_size(32).vocab_size(96), "tokens");
    model->to(gpu);
    model->train();
    ddp::TrainStep step(task, *model, *world,
                        ddp::TrainStepOptions().amp("bf16").cuda_graph(true).optimizer(
                            ddp::FlatOptimizerOptions().name(name).lr(1e-2)));
    auto batch = [&](int64_t rows) {
      auto x = torch::randint(0, 96, {rows, 32}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
      return ddp::data::Batch{{"input", x}, {"target", (x * 7 + 3).remainder(96)}};
    };
    const auto full = batch(8), smaller = batch(3);
    int checked = 0;
    auto check = [&](const std::string& when) {
      auto& sync = step.sync();
      ASSERT_TRUE(sync.has_bf16_copies()) << when;
      if (!sync.bf16_copies_current()) return;
      ++checked;
      for (size_t k = 0; k < sync.flat_params().size(); ++k)
        if (auto c = sync.bf16_flat(k); c.defined())
          EXPECT_TRUE(torch::equal(c, sync.flat_params()[k].to(torch::kBFloat16))) << when << ", flat buffer " << k;
    };
    step.run(full, true, 1e-2);  // asks for the copies
    for (int i = 1; i < 8; ++i) {
      step.run(full, true, 1e-2);
      check("step " + std::to_string(i));
    }
    EXPECT_TRUE(step.graphed()) << step.graph_fallback();
    step.run(smaller, true, 1e-2);  // another shape: eager
    check("the smaller batch");
    for (int i = 0; i < 3; ++i) {
      step.run(full, true, 1e-2);
      check("a replay after it");
    }
    if (name == "adamw" && compat::kHasFusedOptimizers) EXPECT_GT(checked, 5) << "the kernel's copies are current";
  }
}

std::vector<double> linear_gpt_losses(bool fused, bool graph, int steps, GptGelu gelu = GptGelu::kExact) {
  use_fused_linear(fused);
  auto losses = ddp::testing::small_gpt_bf16_losses(
      GptOptions().n_layer(3).n_head(4).n_embd(64).block_size(32).vocab_size(97).gelu(gelu), graph, steps);
  use_fused_linear(false);
  return losses;
}

// A GPT with the tanh GELU trains with the epilogues as with LibTorch's
// ops, eager and graphed.
TEST(FusedLinear, TanhGptTrainsAsWithLibTorchsOps_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto fused = linear_gpt_losses(true, false, 12, GptGelu::kTanh);
  auto native = linear_gpt_losses(false, false, 12, GptGelu::kTanh);
  EXPECT_LT(fused.back(), fused.front()) << ::testing::PrintToString(fused);
  EXPECT_LE(ddp::testing::max_rel_diff(fused, native), 2e-2) << ::testing::PrintToString(fused) << " vs "
                                               << ::testing::PrintToString(native);
  auto graphed = linear_gpt_losses(true, true, 8, GptGelu::kTanh);
  fused.resize(8);
  EXPECT_LE(ddp::testing::max_rel_diff(graphed, fused), 2e-2) << ::testing::PrintToString(graphed) << " vs "
                                                << ::testing::PrintToString(fused);
}

using ddp::testing::max_rel_diff;

// The same first loss to bf16 rounding (the same products; a tuned matmul
// may round a last bit otherwise), then trajectories that follow each other
// while the loss falls; graphed equals eager.
TEST(FusedLinear, GptTrainsAsWithLibTorchsOps_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto fused = linear_gpt_losses(true, false, 12);
  auto native = linear_gpt_losses(false, false, 12);
  EXPECT_LT(fused.back(), fused.front()) << ::testing::PrintToString(fused);
  EXPECT_NEAR(fused[0], native[0], 1e-3 * native[0]);
  EXPECT_LE(max_rel_diff(fused, native), 2e-2) << ::testing::PrintToString(fused) << " vs "
                                               << ::testing::PrintToString(native);
  auto graphed = linear_gpt_losses(true, true, 8);
  fused.resize(8);
  EXPECT_LE(max_rel_diff(graphed, fused), 2e-2) << ::testing::PrintToString(graphed) << " vs "
                                                << ::testing::PrintToString(fused);
}
#endif

}  // namespace
}  // namespace ddp::models
