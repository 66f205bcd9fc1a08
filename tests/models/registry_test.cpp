// make_model(): names, the "auto" stem rule, and the UserErrors for unknown
// names and inputs too small for the model, which must name the bad value and
// say what to do.
#include "ddp/error.h"
#include "ddp/models/registry.h"
#include "support/testing.h"

namespace ddp::models {
namespace {

using Shape = std::vector<int64_t>;

ModelSpec spec(std::string name, std::string stem, int64_t channels, std::vector<int64_t> hw) {
  ModelSpec s;
  s.name = std::move(name);
  s.stem = std::move(stem);
  s.in_channels = channels;
  s.num_classes = 10;
  s.input_hw = std::move(hw);
  return s;
}

Shape conv1_shape(Net& net) {
  auto* w = net.named_parameters().find("conv1.weight");
  return w ? w->sizes().vec() : Shape{};
}

// The UserError's message, or "" if make_model did not throw one.
std::string user_error(const ModelSpec& s) {
  try {
    make_model(s);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(ModelRegistryTest, NamesAndForward) {
  EXPECT_EQ(model_names(), (std::vector<std::string>{"cnn", "resnet18", "resnet34", "resnet50"}));
  torch::NoGradGuard no_grad;
  for (const auto& name : model_names()) {
    SCOPED_TRACE(name);
    auto net = make_model(spec(name, "auto", 1, {28, 28}));
    ASSERT_NE(net, nullptr);
    net->eval();
    EXPECT_EQ(net->forward(torch::randn({2, 1, 28, 28})).sizes().vec(), (Shape{2, 10}));
  }
}

TEST(ModelRegistryTest, AutoStemIsSmallUpTo64Pixels) {
  EXPECT_EQ(conv1_shape(*make_model(spec("resnet18", "auto", 1, {28, 28}))), (Shape{64, 1, 3, 3}));
  EXPECT_EQ(conv1_shape(*make_model(spec("resnet18", "auto", 3, {64, 64}))), (Shape{64, 3, 3, 3}));
  EXPECT_EQ(conv1_shape(*make_model(spec("resnet18", "auto", 3, {48, 65}))), (Shape{64, 3, 7, 7}));
  EXPECT_EQ(conv1_shape(*make_model(spec("resnet18", "auto", 3, {224, 224}))), (Shape{64, 3, 7, 7}));
  EXPECT_EQ(conv1_shape(*make_model(spec("resnet18", "small", 3, {224, 224}))), (Shape{64, 3, 3, 3}));
  EXPECT_EQ(conv1_shape(*make_model(spec("resnet18", "imagenet", 3, {32, 32}))), (Shape{64, 3, 7, 7}));
}

TEST(ModelRegistryTest, SmallCnnInputsGetASmallerGrid) {
  torch::NoGradGuard no_grad;
  auto net = make_model(spec("cnn", "auto", 3, {8, 12}));
  EXPECT_EQ(net->forward(torch::randn({2, 3, 8, 12})).sizes().vec(), (Shape{2, 10}));
}

TEST(ModelRegistryTest, UnknownNamesAreUserErrors) {
  auto msg = user_error(spec("resnet101", "auto", 3, {32, 32}));
  EXPECT_NE(msg.find("'resnet101'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cnn, resnet18, resnet34, resnet50"), std::string::npos) << msg;

  msg = user_error(spec("resnet18", "tiny", 3, {32, 32}));
  EXPECT_NE(msg.find("'tiny'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("auto, small, imagenet"), std::string::npos) << msg;
}

// The cnn has no stem to choose: --stem small or imagenet with it was
// accepted and did nothing.
TEST(ModelRegistryTest, StemWithTheCnnIsAUserError) {
  for (const char* stem : {"small", "imagenet"}) {
    auto msg = user_error(spec("cnn", stem, 1, {28, 28}));
    EXPECT_NE(msg.find(std::string("--stem ") + stem), std::string::npos) << msg;
    EXPECT_NE(msg.find("Hint:"), std::string::npos) << msg;
  }
  EXPECT_EQ(user_error(spec("cnn", "auto", 1, {28, 28})), "");
}

TEST(ModelRegistryTest, InputsTooSmallAreUserErrors) {
  auto msg = user_error(spec("resnet18", "imagenet", 1, {28, 28}));
  EXPECT_NE(msg.find("28x28"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--stem small"), std::string::npos) << msg;

  msg = user_error(spec("cnn", "auto", 1, {4, 4}));
  EXPECT_NE(msg.find("4x4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Hint:"), std::string::npos) << msg;
  EXPECT_NE(user_error(spec("cnn", "auto", 1, {7, 28})), "");
  EXPECT_NE(user_error(spec("resnet50", "small", 1, {6, 6})), "");
  EXPECT_NE(user_error(spec("cnn", "auto", 0, {28, 28})), "");
  EXPECT_NE(user_error(spec("cnn", "auto", 1, {28})), "");
  EXPECT_EQ(user_error(spec("cnn", "auto", 1, {8, 8})), "");
}

}  // namespace
}  // namespace ddp::models
