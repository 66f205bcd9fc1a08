// ddp_interop: the C++ half of the PyTorch interop check
// (tools/interop_check.py runs both halves on the GPU machine).
//
//   ddp_interop init    MODEL SEED WEIGHTS_OUT      seeded C++ model -> PyTorch state_dict file
//   ddp_interop forward MODEL WEIGHTS INPUT LOGITS  load weights (strict), eval forward, save logits
//
// MODEL is a built-in name with torchvision's ImageNet shape (3 channels,
// 1000 classes, ImageNet stem). INPUT is torch.save({"x": tensor}); LOGITS
// comes back as {"logits": tensor}.
#include <cstdio>
#include <fstream>
#include <iterator>

#include "ddp/io/checkpoint.h"
#include "ddp/error.h"
#include "ddp/models/registry.h"
#include "ddp/io/torch_pickle.h"

namespace {

std::shared_ptr<ddp::Net> imagenet_model(const std::string& name) {
  ddp::models::ModelSpec spec;
  spec.name = name;
  spec.stem = "imagenet";
  spec.in_channels = 3;
  spec.num_classes = 1000;
  spec.input_hw = {224, 224};
  return ddp::models::make_model(spec);
}

// INPUT and LOGITS files are state_dict-style files holding one tensor
// ("x", "logits"), read and written with the same code as weights.
torch::Tensor read_tensor(const std::string& path) {
  auto named = ddp::read_state_dict(path);
  ddp::check_user(named.size() == 1, path + " should hold exactly one tensor.");
  return named.front().second;
}

void write_tensor(const torch::Tensor& t, const std::string& path) {
  ddp::write_state_dict(path, {{"logits", t.detach().cpu()}});
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "init" && argc == 5) {
      torch::manual_seed(std::stoll(argv[3]));
      ddp::export_state_dict(*imagenet_model(argv[2]), argv[4]);
      return 0;
    }
    if (mode == "forward" && argc == 6) {
      const torch::Device device = torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
      // Plain fp32 on both sides of the comparison.
      at::globalContext().setAllowTF32CuDNN(false);
      at::globalContext().setAllowTF32CuBLAS(false);
      auto model = imagenet_model(argv[2]);
      model->to(device);
      auto report = ddp::load_pretrained(argv[3], *model, device);
      std::fprintf(stderr, "ddp_interop: %s\n", report.summary().c_str());
      model->eval();
      torch::NoGradGuard no_grad;
      write_tensor(model->forward(read_tensor(argv[4]).to(device)), argv[5]);
      return 0;
    }
    std::fprintf(stderr, "usage: ddp_interop init MODEL SEED OUT | forward MODEL WEIGHTS INPUT LOGITS\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_interop: error: %s\n", e.what());
    return 1;
  }
}
