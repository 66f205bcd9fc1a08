// The seed template's task, as it was meant: a scalar regression trained
// with MSE, on data that can be learned.
//
// The seed regressed random images onto random numbers, with an MSE that
// broadcast a B x 1000 output against a B x 1 target, so the loss sat in the
// thousands and meant nothing. Here each image holds a few bright bars and
// the target, one number per image, is how many pixels they cover (scaled to
// about [0, 1]). The model gives one output per image, so output and target
// are both B x 1; ddptrain refuses shapes that would broadcast.
//
// It reuses the built-in RegressionTask (MSE, L1 or Huber with --loss;
// metrics test_loss, test_mse, test_mae and test_r2) and brings only its
// data and its model:
//   ./build/regression                       one CPU rank or every GPU
//   ./build/regression --loss huber --epochs 5
#include <ATen/CPUGeneratorImpl.h>
#include <ddp/app.h>
#include <ddp/io/checkpoint.h>

#include <cstdio>

// Images of 1 to 4 horizontal bars of random length; target: their area.
class BarsDataset : public ddp::data::Dataset {
 public:
  BarsDataset(int64_t size, uint64_t seed) : size_(size), seed_(seed) {}
  int64_t size() const override { return size_; }
  ddp::data::Example get(int64_t index) const override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + static_cast<uint64_t>(index));
    auto image = 0.2 * torch::randn({1, 24, 24}, gen);
    const int64_t bars = 1 + torch::randint(4, {1}, gen).item<int64_t>();
    int64_t covered = 0;
    for (int64_t b = 0; b < bars; ++b) {
      const int64_t row = 1 + 6 * b, length = 2 + torch::randint(21, {1}, gen).item<int64_t>();
      image.slice(1, row, row + 3).slice(2, 0, length) += 1.0;
      covered += 3 * length;
    }
    return {{"input", image}, {"target", torch::tensor({static_cast<float>(covered) / 200.0f})}};
  }
  std::vector<int64_t> input_shape() const override { return {1, 24, 24}; }
  std::string name() const override { return "bars"; }

 private:
  int64_t size_;
  uint64_t seed_;
};

// A small CNN with one output. Global average pooling makes the output a
// sum over the picture, which is what an area is.
struct AreaNetImpl : ddp::Net {
  AreaNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1)))),
        head(register_module("head", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(conv2(torch::relu(conv1(x))));
    return head(x.mean({2, 3}));  // B x 1, like the target
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear head;
};
TORCH_MODULE(AreaNet);

struct AreaTask : ddp::RegressionTask {
  ddp::data::Splits make_data(const ddp::Config& c, ddp::World&) override {
    ddp::data::Splits data;
    data.train = std::make_shared<BarsDataset>(c.train_samples > 0 ? c.train_samples : 20000, 1);
    data.test = std::make_shared<BarsDataset>(c.test_samples > 0 ? c.test_samples : 2000, 2);
    return data;
  }
  std::shared_ptr<ddp::Net> make_net(const ddp::Config&, const ddp::data::Splits&) override {
    arch_ = "area-net";
    return AreaNet().ptr();
  }
};

// Inference in plain C++, without ddp::main: the model as training built it,
// with a checkpoint's weights (a run with --ema gives their average, as
// export does). `predict --checkpoint RUN/best.pt --out areas.csv` does the
// same over a whole split, on every rank.
torch::Tensor predict_areas(const std::string& checkpoint, const torch::Tensor& images) {
  AreaNet net;
  ddp::load_model_weights(checkpoint, *net, torch::kCPU);
  net->eval();
  torch::NoGradGuard no_grad;
  return net->forward(images);
}

int main(int argc, char** argv) {
  // `regression areas CHECKPOINT N`: the areas predicted for the first N
  // test images, one per line.
  if (argc == 4 && std::string(argv[1]) == "areas") {
    const BarsDataset test(std::stoll(argv[3]), 2);
    std::vector<torch::Tensor> images;
    for (int64_t i = 0; i < test.size(); ++i) images.push_back(test.get(i).at("input"));
    const auto areas = predict_areas(argv[2], torch::stack(images)).reshape(-1);
    for (int64_t i = 0; i < areas.size(0); ++i) std::printf("%.9g\n", areas[i].item<float>());
    return 0;
  }
  return ddp::main(argc, argv, std::make_shared<AreaTask>());
}
