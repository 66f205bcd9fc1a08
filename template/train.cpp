// Data-parallel training template: my dataset, my model, train.
//
// Copy this folder, then edit the three marked parts. Everything else (the
// launcher, the process group, the sampler, gradient sync, SyncBatchNorm,
// checkpoints, metrics and the command line) comes from ddptrain, so
//   ./build/train                      trains on every GPU (or 2 CPU ranks)
//   ./build/train --size 4 --epochs 20 --batch 128 --lr 3e-3
//   torchrun --nproc-per-node 8 --no-python ./build/train
// work as they are. `./build/train --help` lists every flag.
#include <ATen/CPUGeneratorImpl.h>
#include <ddp/app.h>
#include <ddp/dist/sync_batchnorm.h>

// ---------------------------------------------------------------------------
// 1. My dataset: a size, and one (input, target) example per index.
//    This one is learnable on purpose: class k draws a bright square at a
//    position that depends on k, on a noisy background. Replace it with
//    your own files (see ddp/data/idx.h for a real reader).
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
    return {image, torch::tensor(label, torch::kLong)};
  }

  std::vector<int64_t> input_shape() const override { return {3, kSide, kSide}; }
  int64_t num_classes() const override { return kClasses; }
  std::string name() const override { return "my-dataset"; }

  static constexpr int64_t kClasses = 10, kSide = 32;

 private:
  int64_t size_;
  uint64_t seed_;
};

// ---------------------------------------------------------------------------
// 2. My model: LibTorch style (Impl + TORCH_MODULE), deriving from ddp::Net.
//    Use ddp::BatchNorm2d so that --sync-bn can synchronise it across ranks.
//    Or use a built-in one: ddp::models::make_model({"resnet18", ...}).
// ---------------------------------------------------------------------------
struct MyModelImpl : ddp::Net {
  MyModelImpl(int64_t in_channels, int64_t classes)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, 16, 3).padding(1)))),
        bn1(register_module("bn1", ddp::BatchNorm2d(16))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        bn2(register_module("bn2", ddp::BatchNorm2d(32))),
        fc(register_module("fc", torch::nn::Linear(32 * 4 * 4, classes))) {}

  torch::Tensor forward(torch::Tensor x) override {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);
    return fc(torch::adaptive_avg_pool2d(x, {4, 4}).flatten(1));  // keeps where things are
  }

  torch::nn::Conv2d conv1;
  ddp::BatchNorm bn1;
  torch::nn::Conv2d conv2;
  ddp::BatchNorm bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(MyModel);

// ---------------------------------------------------------------------------
// 3. Train: hand the model and the data to ddptrain. The loss is chosen with
//    --loss (cross-entropy, mse, l1); --help shows the rest.
// ---------------------------------------------------------------------------
int main(int argc, char** argv) {
  return ddp::main(argc, argv, [](const ddp::Config& config, ddp::World&) {
    const int64_t n_train = config.train_samples > 0 ? config.train_samples : 8000;
    const int64_t n_test = config.test_samples > 0 ? config.test_samples : 2000;
    ddp::Parts parts;
    parts.data.train = std::make_shared<MyDataset>(n_train, /*seed=*/1);
    parts.data.test = std::make_shared<MyDataset>(n_test, /*seed=*/2);
    parts.model = MyModel(3, MyDataset::kClasses).ptr();
    parts.arch = "my-model";
    return parts;
  });
}
