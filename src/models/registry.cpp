// --model / --stem to a constructed network, with the user's mistakes caught
// here (unknown names, inputs too small for the chosen stem) rather than as a
// shape error deep inside the first forward pass.
#include "ddp/models/registry.h"

#include <algorithm>

#include "ddp/error.h"
#include "ddp/models/cnn.h"
#include "ddp/models/gpt.h"
#include "ddp/models/resnet.h"

namespace ddp::models {
namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

std::string hw_text(const std::vector<int64_t>& hw) {
  return std::to_string(hw[0]) + "x" + std::to_string(hw[1]);
}

// The ImageNet stem divides the input by 4 before the first stage and the
// stages by 8 more; below 32 px layer4 would see a single pixel of padding.
constexpr int64_t kMinImageNetInput = 32;
// Two 2x poolings leave a 2x2 grid at 8 px; smaller inputs leave nothing to classify.
constexpr int64_t kMinCnnInput = 8;
// The small stem keeps full resolution, three stride-2 stages leave 1x1 at 8 px.
constexpr int64_t kMinSmallStemInput = 8;

ResNetStem resolve_stem(const std::string& stem, const std::vector<int64_t>& hw) {
  if (stem == "small") return ResNetStem::kSmall;
  if (stem == "imagenet") return ResNetStem::kImageNet;
  // "auto": the ImageNet stem's 4x reduction only pays off on large images.
  return std::max(hw[0], hw[1]) <= 64 ? ResNetStem::kSmall : ResNetStem::kImageNet;
}

}  // namespace

std::vector<std::string> model_names() { return {"cnn", "resnet18", "resnet34", "resnet50"}; }

std::shared_ptr<Net> make_model(const ModelSpec& spec) {
  check_user(!is_gpt(spec.name), "--model " + spec.name + " is a language model: it reads token ids, not images.",
             "train it with --task lm --model " + spec.name + ".");
  const auto names = model_names();
  check_user(std::find(names.begin(), names.end(), spec.name) != names.end(),
             "Unknown model '" + spec.name + "'.", "Valid models: " + joined(names) + ".");
  const std::vector<std::string> stems = {"auto", "small", "imagenet"};
  check_user(std::find(stems.begin(), stems.end(), spec.stem) != stems.end(),
             "Unknown stem '" + spec.stem + "'.", "Valid stems: " + joined(stems) + ".");
  check_user(spec.in_channels > 0,
             "The model needs at least one input channel, got " + std::to_string(spec.in_channels) + ".");
  check_user(spec.num_classes > 0,
             "The model needs at least one class, got " + std::to_string(spec.num_classes) + ".");
  check_user(spec.input_hw.size() == 2 && spec.input_hw[0] > 0 && spec.input_hw[1] > 0,
             "The input size must be two positive numbers (height, width).");
  const int64_t side = std::min(spec.input_hw[0], spec.input_hw[1]);

  const RecomputePolicy recompute = parse_recompute(spec.recompute);
  if (spec.name == "cnn") {
    check_user(recompute.kind == RecomputePolicy::Kind::kNone,
               "--recompute " + spec.recompute + " applies to the ResNets and the GPTs; the cnn is too small to need it.",
               "drop --recompute, or pick a ResNet, e.g. --model resnet50 --recompute stages.");
    check_user(spec.stem == "auto", "--stem " + spec.stem + " applies to the ResNets; the cnn has no stem to choose.",
               "drop --stem, or pick a ResNet, e.g. --model resnet18 --stem " + spec.stem + ".");
    check_user(side >= kMinCnnInput,
               "Model cnn needs inputs of at least " + std::to_string(kMinCnnInput) + "x" +
                   std::to_string(kMinCnnInput) + " pixels, got " + hw_text(spec.input_hw) + ".",
               "Resize the images, or use a dataset with larger images.");
    return Cnn(CnnOptions()
                   .in_channels(spec.in_channels)
                   .num_classes(spec.num_classes)
                   .grid(std::min<int64_t>(7, side / 4)))
        .ptr();
  }

  const ResNetStem stem = resolve_stem(spec.stem, spec.input_hw);
  if (stem == ResNetStem::kImageNet) {
    check_user(side >= kMinImageNetInput,
               "Model " + spec.name + " with the imagenet stem needs inputs of at least " +
                   std::to_string(kMinImageNetInput) + "x" + std::to_string(kMinImageNetInput) +
                   " pixels, got " + hw_text(spec.input_hw) + ".",
               "use --stem small (or --stem auto) for small images.");
  } else {
    check_user(side >= kMinSmallStemInput,
               "Model " + spec.name + " needs inputs of at least " +
                   std::to_string(kMinSmallStemInput) + "x" + std::to_string(kMinSmallStemInput) +
                   " pixels, got " + hw_text(spec.input_hw) + ".",
               "Resize the images, or use a dataset with larger images.");
  }
  check_user(recompute.kind != RecomputePolicy::Kind::kMlp,
             "--recompute mlp applies to the GPTs; " + spec.name + " has no MLP.",
             "use --recompute stages (each stage), blocks (each residual block) or blocks:N (every N-th).");
  const int64_t depth = std::stoll(spec.name.substr(std::string("resnet").size()));
  return ResNet(ResNetOptions(depth)
                    .num_classes(spec.num_classes)
                    .in_channels(spec.in_channels)
                    .stem(stem)
                    .recompute(recompute))
      .ptr();
}

}  // namespace ddp::models
