// Config (h): a user's own ResNet-50 and GPT-2 124M, each written twice as
// a program built from template/ would write it: with torch::nn layers, and
// with ddp::nn layers (the fast way to write a block). `bench` times the
// task's own training step (bench/user_models.sh runs it beside
// torch.compile of the same architecture).
//   ./user_models bench --arch resnet50 --layers torch --batch 256 --amp bf16 --cuda-graph
//   ./user_models bench --arch gpt2 --layers ddp --batch 16 --amp bf16 --cuda-graph
// --layers torch with --convert-layers on (the default) measures the plain
// model after ddptrain's automatic conversion; off, the plain model as built.
#include <ATen/CPUGeneratorImpl.h>
#include <ddp/app.h>
#include <ddp/compat.h>

#include <type_traits>

namespace F = torch::nn::functional;
using ddp::nn::Activation;

// ---------------------------------------------------------------------------
// 1. Data: random ImageNet-shaped images or GPT-2 token windows, the same
//    for every index set (a benchmark of the step, not of the data).
// ---------------------------------------------------------------------------
class RandomImages : public ddp::data::Dataset {
 public:
  explicit RandomImages(int64_t size) : size_(size) {}
  int64_t size() const override { return size_; }
  ddp::data::Example get(int64_t index) const override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(index) + 1);
    return {{"input", torch::randn({3, 224, 224}, gen)}, {"target", torch::tensor(index % 1000, torch::kLong)}};
  }
  std::string name() const override { return "random 224px images"; }

 private:
  int64_t size_;
};

class RandomTokens : public ddp::data::Dataset {
 public:
  explicit RandomTokens(int64_t size) : size_(size) {}
  int64_t size() const override { return size_; }
  ddp::data::Example get(int64_t index) const override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(index) + 1);
    auto window = torch::randint(0, 50257, {1025}, gen, torch::kLong);
    return {{"input", window.slice(0, 0, 1024)}, {"target", window.slice(0, 1, 1025)}};
  }
  std::string name() const override { return "random GPT-2 tokens"; }

 private:
  int64_t size_;
};

// ---------------------------------------------------------------------------
// 2. Models. kFast: ddp::nn layers; else torch::nn's.
// ---------------------------------------------------------------------------
torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

template <bool kFast>
using LinearOf = std::conditional_t<kFast, ddp::nn::Linear, torch::nn::Linear>;
template <bool kFast>
using MaxPoolOf = std::conditional_t<kFast, ddp::nn::MaxPool2d, torch::nn::MaxPool2d>;
template <bool kFast>
using BatchNormOf = std::conditional_t<kFast, ddp::BatchNorm, torch::nn::BatchNorm2d>;

template <bool kFast>
BatchNormOf<kFast> batch_norm(int64_t c, bool relu) {
  if constexpr (kFast) return ddp::nn::BatchNorm2d(c, relu ? Activation::kRelu : Activation::kNone);
  else return torch::nn::BatchNorm2d(c);
}

// bn(x), then its ReLU (inside the layer with ddp::nn).
template <bool kFast>
torch::Tensor bn_relu(BatchNormOf<kFast>& bn, const torch::Tensor& x) {
  if constexpr (kFast) return bn(x);
  else return torch::relu(bn(x));
}

template <bool kFast>
struct BottleneckImpl : torch::nn::Module {
  BottleneckImpl(int64_t in, int64_t planes, int64_t stride)
      : conv1(register_module("conv1", conv(in, planes, 1, 1))),
        bn1(register_module("bn1", batch_norm<kFast>(planes, true))),
        conv2(register_module("conv2", conv(planes, planes, 3, stride))),
        bn2(register_module("bn2", batch_norm<kFast>(planes, true))),
        conv3(register_module("conv3", conv(planes, planes * 4, 1, 1))),
        bn3(register_module("bn3", batch_norm<kFast>(planes * 4, false))) {
    if (stride != 1 || in != planes * 4)
      downsample = register_module("downsample", torch::nn::Sequential(conv(in, planes * 4, 1, stride),
                                                                       batch_norm<kFast>(planes * 4, false)));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto y = conv3(bn_relu<kFast>(bn2, conv2(bn_relu<kFast>(bn1, conv1(x)))));
    auto shortcut = downsample.is_empty() ? x : downsample->forward(x);
    if constexpr (kFast) return bn3->forward_relu(y, shortcut);  // relu(bn3(y) + shortcut), one pass
    else return torch::relu(bn3(y) + shortcut);
  }

  torch::nn::Conv2d conv1, conv2, conv3;
  BatchNormOf<kFast> bn1, bn2, bn3;
  torch::nn::Sequential downsample{nullptr};
};

template <bool kFast>
struct ResNet50Impl : torch::nn::Module {
  ResNet50Impl()
      : conv1(register_module("conv1", conv(3, 64, 7, 2))),
        bn1(register_module("bn1", batch_norm<kFast>(64, true))),
        pool(register_module("pool", MaxPoolOf<kFast>(torch::nn::MaxPool2dOptions(3).stride(2).padding(1)))),
        fc(register_module("fc", LinearOf<kFast>(2048, 1000))) {
    int64_t in = 64;
    const int64_t blocks[] = {3, 4, 6, 3};
    for (int s = 0; s < 4; ++s) {
      torch::nn::Sequential stage;
      const int64_t planes = 64 << s;
      for (int64_t b = 0; b < blocks[s]; ++b) {
        stage->push_back(torch::nn::ModuleHolder<BottleneckImpl<kFast>>(in, planes, b == 0 && s > 0 ? 2 : 1));
        in = planes * 4;
      }
      layers.push_back(register_module("layer" + std::to_string(s + 1), stage));
    }
  }

  torch::Tensor forward(torch::Tensor x) {
    x = pool(bn_relu<kFast>(bn1, conv1(x)));
    for (auto& stage : layers) x = stage->forward(x);
    return fc(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }

  torch::nn::Conv2d conv1;
  BatchNormOf<kFast> bn1;
  MaxPoolOf<kFast> pool;
  std::vector<torch::nn::Sequential> layers;
  LinearOf<kFast> fc;
};

template <bool kFast>
using LayerNormOf = std::conditional_t<kFast, ddp::nn::LayerNorm, torch::nn::LayerNorm>;
template <bool kFast>
using EmbeddingOf = std::conditional_t<kFast, ddp::nn::Embedding, torch::nn::Embedding>;

constexpr int64_t kEmbd = 768, kHeads = 12, kLayers = 12, kVocab = 50304, kContext = 1024;

// A pre-norm transformer block, nanoGPT's.
template <bool kFast>
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln_1(register_module("ln_1", LayerNormOf<kFast>(torch::nn::LayerNormOptions({kEmbd})))),
        c_attn(register_module("c_attn", LinearOf<kFast>(kEmbd, 3 * kEmbd))),
        attn_proj(register_module("attn_proj", LinearOf<kFast>(kEmbd, kEmbd))),
        ln_2(register_module("ln_2", LayerNormOf<kFast>(torch::nn::LayerNormOptions({kEmbd})))),
        c_fc(register_module("c_fc", make_fc())),
        mlp_proj(register_module("mlp_proj", LinearOf<kFast>(4 * kEmbd, kEmbd))) {}

  static LinearOf<kFast> make_fc() {
    if constexpr (kFast) return ddp::nn::Linear(kEmbd, 4 * kEmbd, Activation::kGelu);  // the GELU in the matmul
    else return torch::nn::Linear(kEmbd, 4 * kEmbd);
  }

  torch::Tensor attention(const torch::Tensor& h) {
    const int64_t B = h.size(0), T = h.size(1);
    auto qkv = c_attn(h).split(kEmbd, 2);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, kHeads, kEmbd / kHeads}).transpose(1, 2); };
    auto y = ddp::compat::causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), 0.0, is_training());
    return attn_proj(y.transpose(1, 2).contiguous().view({B, T, kEmbd}));
  }
  torch::Tensor mlp(const torch::Tensor& h) {
    if constexpr (kFast) return mlp_proj(c_fc(h));
    else return mlp_proj(torch::gelu(c_fc(h)));
  }

  // x: the residual stream. With ddp::nn, each residual add goes into the
  // next LayerNorm's pass (forward_add); `normed` carries it between blocks.
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + attention(ln_1(x));
    return h + mlp(ln_2(h));
  }
  std::pair<torch::Tensor, torch::Tensor> forward_fast(const torch::Tensor& x, const torch::Tensor& normed) {
    auto [h, n2] = ln_2->forward_add(x, attention(normed));
    return {h, mlp(n2)};  // the stream so far, and the branch still to add
  }

  LayerNormOf<kFast> ln_1;
  LinearOf<kFast> c_attn, attn_proj;
  LayerNormOf<kFast> ln_2;
  LinearOf<kFast> c_fc, mlp_proj;
};

template <bool kFast>
struct Gpt2Impl : torch::nn::Module {
  Gpt2Impl()
      : wte(register_module("wte", EmbeddingOf<kFast>(kVocab, kEmbd))),
        wpe(register_module("wpe", torch::nn::Embedding(kContext, kEmbd))),
        ln_f(register_module("ln_f", LayerNormOf<kFast>(torch::nn::LayerNormOptions({kEmbd})))) {
    for (int64_t i = 0; i < kLayers; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), torch::nn::ModuleHolder<BlockImpl<kFast>>()));
  }

  // Logits [B, T, V] for tokens [B, T]; the output head is tied to wte.
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte(idx) + wpe(torch::arange(idx.size(1), idx.options()));
    if constexpr (kFast) {
      auto normed = blocks[0]->ln_1(x);
      torch::Tensor branch;
      for (size_t i = 0; i < blocks.size(); ++i) {
        auto [h, b] = blocks[i]->forward_fast(x, normed);
        auto& next_ln = i + 1 < blocks.size() ? blocks[i + 1]->ln_1 : ln_f;
        std::tie(x, normed) = next_ln->forward_add(h, b);
      }
      return wte->head(normed);
    } else {
      for (auto& block : blocks) x = block->forward(x);
      return F::linear(ln_f(x), wte->weight);
    }
  }

  EmbeddingOf<kFast> wte;
  torch::nn::Embedding wpe;
  LayerNormOf<kFast> ln_f;
  std::vector<torch::nn::ModuleHolder<BlockImpl<kFast>>> blocks;
};

// ---------------------------------------------------------------------------
// 3. The task: cross-entropy over the classes or the next tokens.
// ---------------------------------------------------------------------------
struct UserModelsTask : ddp::Task {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  ddp::nn::CrossEntropyLoss fast_loss;
  bool fast = false;

  void add_flags(ddp::Config& config) override {
    config.add_flag("--arch", "the model: torchvision's ResNet-50 or GPT-2 124M", "resnet50", {"resnet50", "gpt2"});
    config.add_flag("--layers", "written with torch::nn layers (torch) or ddp::nn layers (ddp)", "ddp", {"torch", "ddp"});
  }

  ddp::data::Splits make_data(const ddp::Config& config, ddp::World&) override {
    const int64_t n = std::max<int64_t>(config.batch, 64);
    ddp::data::Splits data;
    if (config.flag<std::string>("arch") == "gpt2") {
      data.train = std::make_shared<RandomTokens>(n);
      data.test = std::make_shared<RandomTokens>(n);
    } else {
      data.train = std::make_shared<RandomImages>(n);
      data.test = std::make_shared<RandomImages>(n);
    }
    return data;
  }

  ddp::ModulePtr make_model(const ddp::Config& config, const ddp::data::Splits&) override {
    const auto arch = config.flag<std::string>("arch"), layers = config.flag<std::string>("layers");
    fast = layers == "ddp";
    arch_ = arch + "-" + layers;
    auto make = [&](auto model) -> ddp::ModulePtr {
      forward = [model](const torch::Tensor& x) mutable { return model->forward(x); };
      return model;
    };
    if (arch == "gpt2")
      return fast ? make(std::make_shared<Gpt2Impl<true>>()) : make(std::make_shared<Gpt2Impl<false>>());
    return fast ? make(std::make_shared<ResNet50Impl<true>>()) : make(std::make_shared<ResNet50Impl<false>>());
  }

  ddp::StepOutput training_step(const ddp::data::Batch& batch) override {
    auto out = forward(batch.input());
    auto logits = out.dim() == 3 ? out.flatten(0, 1) : out;
    auto target = batch.target().flatten();
    return fast ? fast_loss(logits, target) : F::cross_entropy(logits, target);
  }

  ddp::TensorMap validation_step(const ddp::data::Batch& batch) override {
    auto out = forward(batch.input()).to(torch::kFloat);
    auto logits = out.dim() == 3 ? out.flatten(0, 1) : out;
    auto target = batch.target().flatten();
    return {{"loss", F::cross_entropy(logits, target, F::CrossEntropyFuncOptions().reduction(torch::kSum))},
            {"count", torch::tensor(static_cast<double>(target.size(0)))}};
  }

  ddp::Metrics validation_metrics(const ddp::Totals& t) override {
    return {{"loss", t.at("loss").item<double>() / t.at("count").item<double>()}};
  }
  ddp::Monitor monitor() const override { return {"loss", ddp::Goal::kMin}; }
};

// ---------------------------------------------------------------------------
// 4. Train (or `bench`).
// ---------------------------------------------------------------------------
int main(int argc, char** argv) {
  return ddp::main(argc, argv, std::make_shared<UserModelsTask>(),
                   ddp::ProgramOptions("user_models").description("a user's ResNet-50 and GPT-2, two ways each"));
}
