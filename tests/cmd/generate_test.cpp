// `ddptrain generate` (src/cmd/generate.cpp) on a checkpoint of the tiny
// GPT whose logits PyTorch wrote (tests/testdata/make_gpt_reference.py):
// the logits it writes and its greedy token are PyTorch's, the context
// slides over long prompts, and files that are not checkpoints are errors.
#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "ddp/cmd/generate.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"
#include "support/testing.h"

namespace {

using ddp::testing::run_process;

const std::string kGptTinyStateDict = std::string(DDP_TEST_DATA_DIR) + "/gpt_tiny_state_dict.pt";
const std::string kArch = "gpt/L2/H2/C16/T8/V32/bias1/drop0/tokens";

nlohmann::json generate_reference() {
  std::ifstream f(std::string(DDP_TEST_DATA_DIR) + "/gpt_tiny_expected.json");
  return nlohmann::json::parse(f);
}

ddp::models::Gpt tiny_model() {
  ddp::models::Gpt model(ddp::models::gpt_from_arch(kArch));
  ddp::load_pretrained(kGptTinyStateDict, *model, torch::kCPU);
  return model;
}

// A ddptrain checkpoint holding PyTorch's weights.
std::string tiny_checkpoint() {
  const auto path = ddp::testing::temp_dir("generate") + "/tiny.pt";
  auto model = tiny_model();
  ddp::save_checkpoint(path, *model, nullptr, ddp::CheckpointMeta{ddp::TrainState(), kArch, {}});
  return path;
}

TEST(Generate, LogitsAndGreedyTokenArePyTorchs) {
  const auto ref = generate_reference();
  std::string prompt;
  std::vector<int64_t> first;
  for (const auto& id : ref["idx"][0]) {
    first.push_back(id.get<int64_t>());
    prompt += (prompt.empty() ? "" : " ") + std::to_string(first.back());
  }
  const auto dir = ddp::testing::temp_dir("generate_logits");
  auto r = run_process({DDPTRAIN_EXE, "generate", tiny_checkpoint(), "--prompt", prompt, "--tokens", "1",
                        "--temperature", "0", "--logits-out", dir + "/logits.pt"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  torch::Tensor logits;
  for (const auto& [name, t] : ddp::read_state_dict(dir + "/logits.pt"))
    if (name == "logits") logits = t;
  ASSERT_TRUE(logits.defined());
  auto expected = torch::tensor(ref["logits"].get<std::vector<double>>(), torch::kFloat).reshape({2, 8, 32})[0];
  EXPECT_LE((logits[0] - expected).abs().max().item<double>(), 1e-5);
  // Greedy: the prompt, then the argmax of PyTorch's last row.
  EXPECT_EQ(r.output, prompt + " " + std::to_string(expected[7].argmax().item<int64_t>()) + "\n");
}

TEST(Generate, ContextSlidesOverPromptsLongerThanIt) {
  auto model = tiny_model();
  std::vector<int64_t> prompt(20, 3);
  const auto out = ddp::sample_tokens(model, prompt, ddp::SampleOptions().tokens(5).seed(1));
  ASSERT_EQ(out.size(), 25u);
  for (size_t i = 20; i < out.size(); ++i) EXPECT_TRUE(out[i] >= 0 && out[i] < 32);
  EXPECT_EQ(ddp::sample_tokens(model, prompt, ddp::SampleOptions().tokens(5).seed(1)), out) << "same seed, same draws";
  // top-k 1 is greedy.
  EXPECT_EQ(ddp::sample_tokens(model, prompt, ddp::SampleOptions().tokens(5).top_k(1).seed(2)),
            ddp::sample_tokens(model, prompt, ddp::SampleOptions().tokens(5).temperature(0)));
  EXPECT_NE(ddp::testing::user_error([&] { ddp::sample_tokens(model, {40}, ddp::SampleOptions()); })
                .find("prompt token 40 is outside the model's vocabulary of 32"),
            std::string::npos);
}

TEST(Generate, AFileThatIsNoCheckpointIsAnError) {
  auto r = run_process({DDPTRAIN_EXE, "generate", kGptTinyStateDict, "--prompt", "1 2"});
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_NE(r.output.find(kGptTinyStateDict + " is not a ddptrain checkpoint"), std::string::npos) << r.output;
  auto missing = run_process({DDPTRAIN_EXE, "generate", "/nonexistent.pt"});
  EXPECT_EQ(missing.exit_code, ddp::exit_code::kUsage) << missing.output;
  EXPECT_NE(missing.output.find("checkpoint /nonexistent.pt does not exist"), std::string::npos) << missing.output;
  auto usage = run_process({DDPTRAIN_EXE, "generate"});
  EXPECT_EQ(usage.exit_code, ddp::exit_code::kUsage) << usage.output;
}

// Bad values get one line and exit 2, not an internal error or garbage: a
// temperature so small that dividing by it overflows is still (nearly)
// greedy; an infinite one is refused; a prompt id too long for int64; a
// header that does not parse; --logits-out naming the checkpoint itself.
TEST(Generate, BadValuesAreOneLineErrors) {
  const auto ck = tiny_checkpoint();
  auto one_line_usage = [](const ddp::testing::ProcessResult& r, const std::string& what) {
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
    EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
  };
  auto tiny = run_process({DDPTRAIN_EXE, "generate", ck, "--prompt", "1 2", "--tokens", "3", "--temperature", "1e-40"});
  auto greedy = run_process({DDPTRAIN_EXE, "generate", ck, "--prompt", "1 2", "--tokens", "3", "--temperature", "0"});
  EXPECT_EQ(tiny.exit_code, 0) << tiny.output;
  EXPECT_EQ(tiny.output, greedy.output);
  one_line_usage(run_process({DDPTRAIN_EXE, "generate", ck, "--prompt", "1", "--temperature", "inf"}), "--temperature");
  one_line_usage(run_process({DDPTRAIN_EXE, "generate", ck, "--prompt", "99999999999999999999999"}),
                 "prompt token 99999999999999999999999 is outside the model's vocabulary of 32");
  one_line_usage(run_process({DDPTRAIN_EXE, "generate", ck, "--prompt", "1", "--logits-out", ck}),
                 "is the checkpoint being read");
  EXPECT_TRUE(ddp::is_checkpoint(ck)) << "--logits-out wrote over the checkpoint";
  // The header entry, damaged: the JSON no longer parses.
  auto tensors = ddp::read_state_dict(ck);
  for (auto& [name, t] : tensors)
    if (name == "ddptrain") t = t.narrow(0, 0, t.numel() / 2).clone();
  const auto damaged = ddp::testing::temp_dir("generate_damaged") + "/damaged.pt";
  ddp::write_state_dict(damaged, tensors);
  one_line_usage(run_process({DDPTRAIN_EXE, "generate", damaged, "--prompt", "1"}), "has a damaged header");
}

// generate's errors speak of generate, not of training: flags in the order
// given, a checkpoint whose weights do not fit the model its header names
// (no --pretrain-skip hint), an output that cannot be written (no
// --save_path hint).
TEST(Generate, ErrorsNameGeneratesOwnArguments) {
  const auto ck = tiny_checkpoint();
  auto unknown = run_process({DDPTRAIN_EXE, "generate", ck, "--foo", "1", "--bar", "2"});
  EXPECT_EQ(unknown.exit_code, ddp::exit_code::kUsage) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown flag '--foo'"), std::string::npos) << unknown.output;
  auto extra = run_process({DDPTRAIN_EXE, "generate", ck, "b.pt", "c.pt"});
  EXPECT_EQ(extra.exit_code, ddp::exit_code::kUsage) << extra.output;
  EXPECT_NE(extra.output.find("b.pt c.pt"), std::string::npos) << extra.output;
  auto negative = run_process({DDPTRAIN_EXE, "generate", ck, "b.pt", "--top-k", "-1"});  // a value, not a flag
  EXPECT_NE(negative.output.find("also given: b.pt."), std::string::npos) << negative.output;

  auto tensors = ddp::read_state_dict(ck);
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [](const auto& e) {
                                 const std::string name = "transformer.ln_f.weight";  // under "model/"
                                 return e.first.size() >= name.size() &&
                                        e.first.compare(e.first.size() - name.size(), name.size(), name) == 0;
                               }),
                tensors.end());
  const auto short_of_one = ddp::testing::temp_dir("generate_short") + "/short.pt";
  ddp::write_state_dict(short_of_one, tensors);
  auto unfit = run_process({DDPTRAIN_EXE, "generate", short_of_one, "--prompt", "1"});
  EXPECT_EQ(unfit.exit_code, ddp::exit_code::kUsage) << unfit.output;
  EXPECT_NE(unfit.output.find("checkpoint " + short_of_one + " does not hold the weights of the model it names"),
            std::string::npos) << unfit.output;
  EXPECT_NE(unfit.output.find("missing: transformer.ln_f.weight"), std::string::npos) << unfit.output;
  EXPECT_EQ(unfit.output.find("--pretrain"), std::string::npos) << unfit.output;

  auto unwritable = run_process({DDPTRAIN_EXE, "generate", ck, "--prompt", "1", "--tokens", "1", "--logits-out",
                                 "/proc/ddp_forbidden/logits.pt"});
  EXPECT_EQ(unwritable.exit_code, ddp::exit_code::kUsage) << unwritable.output;
  EXPECT_NE(unwritable.output.find("cannot write /proc/ddp_forbidden/logits.pt"), std::string::npos)
      << unwritable.output;
  EXPECT_EQ(unwritable.output.find("--save_path"), std::string::npos) << unwritable.output;
  EXPECT_NE(unwritable.output.find("create its directory first"), std::string::npos) << unwritable.output;  // not "free space"
}

}  // namespace
