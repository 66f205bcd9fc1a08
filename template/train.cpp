// Data-parallel training template: my dataset, my model, my task, train.
//
// Copy this folder and edit the four marked parts. ddptrain brings the rest
// (the launcher, the process group, the sampler, gradient sync,
// SyncBatchNorm, mixed precision, checkpoints, logs and the command line):
//   ./build/train                      trains on every GPU (or one CPU rank)
//   ./build/train --size 4 --epochs 20 --batch 128 --lr 3e-3
//   torchrun --nproc_per_node 8 --redirects 2 --tee 2 --no_python ./build/train
// `./build/train --help` lists your task's flags and the built-in ones it
// reads; examples/ has more tasks.
#include <ATen/CPUGeneratorImpl.h>
#include <ddp/app.h>

namespace F = torch::nn::functional;

// ---------------------------------------------------------------------------
// 1. My dataset: a size, and one example per index, as named tensors.
//    This one is learnable on purpose: class k draws a bright square at a
//    place that depends on k, on a noisy background. For your own files,
//    give the constructor their folder and read one in get(): MyTask's
//    make_data below has config.data_root (--data_root) to pass.
// ---------------------------------------------------------------------------
class MyDataset : public ddp::data::Dataset {
 public:
  MyDataset(int64_t size, uint64_t seed) : size_(size), seed_(seed) {}

  int64_t size() const override { return size_; }

  ddp::data::Example get(int64_t index) const override {
    // A generator per example: the same index always gives the same image,
    // from any thread.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + static_cast<uint64_t>(index));
    const int64_t label = index % kClasses;
    auto image = 0.3 * torch::randn({3, kSide, kSide}, gen);
    const int64_t row = (label / 4) * 10 + 2, col = (label % 4) * 7 + 2;
    image.slice(1, row, row + 6).slice(2, col, col + 6) += 2.0;
    return {{"input", image}, {"target", torch::tensor(label, torch::kLong)}};
  }

  std::string name() const override { return "my-dataset"; }  // shown in logs

  static constexpr int64_t kClasses = 10, kSide = 32;

 private:
  int64_t size_;
  uint64_t seed_;
};

// ---------------------------------------------------------------------------
// 2. My model: LibTorch style (Impl + TORCH_MODULE). ddp::nn layers are
//    torch::nn's (the same options, initial weights and state_dict names)
//    whose forward runs ddptrain's CUDA kernels under --amp bf16: here each
//    batch norm takes its ReLU, and the residual block's relu(bn(x) + x),
//    in one pass. torch::nn layers work too (and --sync-bn needs
//    ddp::nn's BatchNorm); docs/speed.md says what each layer gains.
// ---------------------------------------------------------------------------
// A 3x3 convolution that keeps the size. Before a batch norm it has no
// bias: the norm's shift takes its place, and a bias there would only drift.
torch::nn::Conv2dOptions conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false);
}

struct MyModelImpl : torch::nn::Module {
  using Activation = ddp::nn::Activation;
  MyModelImpl(int64_t in_channels, int64_t classes)
      : conv1(register_module("conv1", torch::nn::Conv2d(conv3x3(in_channels, 16)))),
        bn1(register_module("bn1", ddp::nn::BatchNorm2d(16, Activation::kRelu))),
        conv2(register_module("conv2", torch::nn::Conv2d(conv3x3(16, 16)))),
        bn2(register_module("bn2", ddp::nn::BatchNorm2d(16))),
        conv3(register_module("conv3", torch::nn::Conv2d(conv3x3(16, 32)))),
        bn3(register_module("bn3", ddp::nn::BatchNorm2d(32, Activation::kRelu))),
        fc(register_module("fc", ddp::nn::Linear(32 * 4 * 4, classes))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = bn1(conv1(x));                              // conv -> batch norm + ReLU
    x = bn2->forward_relu(conv2(x), /*residual=*/x);  // a residual block's tail: relu(bn(conv(x)) + x)
    x = torch::max_pool2d(bn3(conv3(torch::max_pool2d(x, 2))), 2);
    return fc(torch::adaptive_avg_pool2d(x, {4, 4}).flatten(1));  // keeps where things are
  }

  torch::nn::Conv2d conv1;
  ddp::BatchNorm bn1;
  torch::nn::Conv2d conv2;
  ddp::BatchNorm bn2;
  torch::nn::Conv2d conv3;
  ddp::BatchNorm bn3;
  ddp::nn::Linear fc;
};
TORCH_MODULE(MyModel);

// ---------------------------------------------------------------------------
// 3. My task: the data and model it trains, the loss, and the metrics.
// ---------------------------------------------------------------------------
struct MyTask : ddp::Task {
  MyModel model{nullptr};

  // Flags of your own, e.g. config.add_flag("--aux-weight", "weight of the
  // auxiliary loss", 0.3), read with config.flag<double>("aux-weight").
  // Data of your own is not augmented: set config.augment = "standard" here
  // for the built-in crops and flips of "input" images (here a flip would
  // move the square that defines the class).
  void add_flags(ddp::Config& config) override {}

  ddp::data::Splits make_data(const ddp::Config& config, ddp::World&) override {
    ddp::data::Splits data;
    data.train = std::make_shared<MyDataset>(config.train_samples > 0 ? config.train_samples : 8000, /*seed=*/1);
    data.test = std::make_shared<MyDataset>(config.test_samples > 0 ? config.test_samples : 2000, /*seed=*/2);
    return data;
  }

  ddp::ModulePtr make_model(const ddp::Config&, const ddp::data::Splits&) override {
    arch_ = "my-model";  // --resume refuses a checkpoint of another architecture
    model = MyModel(3, MyDataset::kClasses);
    return model.ptr();
  }

  // The loss to minimise (and, optionally, named scalars to log).
  ddp::StepOutput training_step(const ddp::data::Batch& batch) override {
    return F::cross_entropy(model(batch.input()), batch.target());
  }

  // Sums over the batch; ddptrain adds them up over batches and ranks.
  ddp::TensorMap validation_step(const ddp::data::Batch& batch) override {
    auto logits = model(batch.input()).to(torch::kFloat);
    const auto& y = batch.target();
    return {{"loss", F::cross_entropy(logits, y, F::CrossEntropyFuncOptions().reduction(torch::kSum))},
            {"correct", logits.argmax(1).eq(y).sum()},
            {"count", torch::tensor(static_cast<double>(y.size(0)))}};
  }

  // The metrics, from the totals over a whole split. Named once: they are
  // reported as val_loss, val_acc on the validation split (--val-split) and
  // test_loss, test_acc on test.
  ddp::Metrics validation_metrics(const ddp::Totals& t) override {
    const double n = t.at("count").item<double>();
    return {{"loss", t.at("loss").item<double>() / n}, {"acc", t.at("correct").item<double>() / n}};
  }

  // The metric that picks best.pt, and that --stop-at, --patience and
  // --save-top-k compare against (val_acc with --val-split, else test_acc).
  ddp::Monitor monitor() const override { return {"acc", ddp::Goal::kMax}; }

  // What `./train predict --checkpoint RUN/best.pt --out preds.csv` writes
  // for each sample of the test split (or --split val, train). For files of
  // your own, `--split PATH` asks your make_predict_data(config, world, path)
  // for PATH's samples (examples/tabular reads a new CSV so).
  // In plain C++: MyModel m(3, MyDataset::kClasses);
  // ddp::load_model_weights("RUN/best.pt", *m, torch::kCPU); m->eval();
  ddp::TensorMap predict_step(const ddp::data::Batch& batch) override {
    auto logits = model(batch.input());
    return {{"class", logits.argmax(1)}, {"prob", torch::softmax(logits, 1)}};
  }

  // AdamW (the default --optimizer) decays every parameter by --weight-decay
  // (0.05), biases, norm weights and embeddings too, unless exempted here.
  // This exempts them, as timm and nanoGPT do; drop it to decay everything.
  void configure_optimizer(const ddp::Config&, ddp::OptimizerSetup& setup) override {
    ddp::decay_matrices_only(setup.optimizer, *model);
  }
};

// ---------------------------------------------------------------------------
// 4. Train.
// ---------------------------------------------------------------------------
// Your program's name and what it does: --help, errors and the commands it
// prints speak of it.
int main(int argc, char** argv) {
  return ddp::main(argc, argv, std::make_shared<MyTask>(),
                   ddp::ProgramOptions("train").description("finds the bright square in noisy images"));
}
