// torch.save files: read what PyTorch (Python) wrote, write what it reads.
// The .pt files and their expected values come from
// tools/gen_torch_pickle_testdata.py (PyTorch 1.13).
#include <caffe2/serialize/inline_container.h>

#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "ddp/io/checkpoint.h"
#include "ddp/error.h"
#include "ddp/io/torch_pickle.h"
#include "support/testing.h"

namespace {

const std::string kData = DDP_TEST_DATA_DIR;

std::string python_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return c10::toString(t);
  }
}

std::vector<int64_t> vec(c10::IntArrayRef a) { return a.vec(); }

// Names, order, dtype, shape, strides, offsets and every value, exactly.
class PyTorchFile : public ::testing::TestWithParam<std::string> {};

TEST_P(PyTorchFile, ReadsExactlyWhatPythonSaved) {
  const auto file = GetParam();
  std::ifstream f(kData + "/pickle_expected.json");
  const auto expected = nlohmann::json::parse(f)["files"][file];
  const auto got = ddp::read_state_dict(kData + "/" + file);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t k = 0; k < got.size(); ++k) {
    const auto& [name, t] = got[k];
    const auto& e = expected[k];
    SCOPED_TRACE(file + " " + name);
    EXPECT_EQ(name, e["name"].get<std::string>());
    EXPECT_EQ(python_dtype(t.scalar_type()), e["dtype"].get<std::string>());
    EXPECT_EQ(vec(t.sizes()), e["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(vec(t.strides()), e["stride"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.storage_offset(), e["offset"].get<int64_t>());
    EXPECT_TRUE(t.device().is_cpu());
    const auto flat = t.flatten();
    ASSERT_EQ(flat.numel(), static_cast<int64_t>(e["values"].size()));
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const auto& v = e["values"][static_cast<size_t>(i)];
      if (t.scalar_type() == c10::kLong) EXPECT_EQ(flat[i].item<int64_t>(), v.get<int64_t>()) << i;
      else if (t.scalar_type() == c10::kBool) EXPECT_EQ(flat[i].item<bool>(), v.get<bool>()) << i;
      else EXPECT_EQ(flat[i].item<double>(), v.get<double>()) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Files, PyTorchFile,
                         ::testing::Values("pickle_bn.pt", "pickle_proto4.pt", "pickle_plain.pt", "pickle_half.pt",
                                           "pickle_views.pt", "pickle_cuda.pt"),
                         [](const auto& info) {
                           auto n = info.param.substr(7, info.param.size() - 10);  // pickle_<n>.pt
                           return n;
                         });

// model.state_dict(): an OrderedDict with _metadata, BatchNorm's int64
// counter beyond 32 bits; names keep the module order.
TEST(TorchPickle, BatchNormStateDictKeepsOrderAndInt64) {
  const auto sd = ddp::read_state_dict(kData + "/pickle_bn.pt");
  std::vector<std::string> names;
  for (const auto& [name, t] : sd) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                              "1.running_var", "1.num_batches_tracked", "3.weight", "3.bias"}));
  EXPECT_EQ(sd[6].second.scalar_type(), c10::kLong);
  EXPECT_EQ(sd[6].second.item<int64_t>(), 12345678901);
}

// Views saved together come back as views of one storage, as in Python.
TEST(TorchPickle, ViewsShareTheirStorage) {
  auto sd = ddp::read_state_dict(kData + "/pickle_views.pt");
  ASSERT_EQ(sd.size(), 5u);
  auto base = sd[0].second;
  for (size_t k = 1; k < 4; ++k)
    EXPECT_TRUE(sd[k].second.storage().is_alias_of(base.storage())) << sd[k].first;
  EXPECT_FALSE(sd[4].second.storage().is_alias_of(base.storage()));
  EXPECT_TRUE(torch::equal(sd[1].second, base.t()));
  EXPECT_TRUE(torch::equal(sd[3].second, base.slice(0, 1, 3).slice(1, 0, 6, 2)));
  base.fill_(-1);
  EXPECT_EQ(sd[2].second.sum().item<float>(), -4);  // the column saw the write
}

// A PyTorch OrderedDict state_dict loads into the same model built in C++.
TEST(TorchPickle, PretrainLoadsAnOrderedDictStateDict) {
  torch::nn::Sequential model(torch::nn::Conv2d(1, 2, 3), torch::nn::BatchNorm2d(2), torch::nn::Flatten(),
                              torch::nn::Linear(8, 3));
  auto report = ddp::load_pretrained(kData + "/pickle_bn.pt", *model, torch::kCPU);
  EXPECT_EQ(report.loaded.size(), 9u) << report.summary();
  const auto sd = ddp::read_state_dict(kData + "/pickle_bn.pt");
  const auto params = model->named_parameters();
  const auto buffers = model->named_buffers();
  for (const auto& [name, t] : sd) {
    auto* dst = params.find(name) ? params.find(name) : buffers.find(name);
    ASSERT_TRUE(dst) << name;
    EXPECT_TRUE(torch::equal(*dst, t)) << name;
  }
}

ddp::NamedTensors assorted_tensors() {
  auto base = torch::arange(24, torch::kFloat).reshape({4, 6});
  return {
      {"f32", torch::randn({2, 3})},
      {"transposed", torch::arange(12, torch::kFloat).reshape({3, 4}).t()},  // non-contiguous
      {"slice", base.slice(0, 1, 3)},                                          // offset 6 into a larger storage
      {"f64", torch::randn({3}, torch::kDouble)},
      {"f16", torch::randn({2, 2}).to(torch::kHalf)},
      {"bf16", torch::tensor({1.5, -2.25, 1e10}).to(torch::kBFloat16)},
      {"i64", torch::tensor({-(int64_t(1) << 40), int64_t(1) << 62, int64_t(-5)})},
      {"i32", torch::tensor({INT32_MIN, INT32_MAX}, torch::kInt)},
      {"i16", torch::tensor({-7, 300}, torch::kShort)},
      {"i8", torch::tensor({-128, 127}, torch::kChar)},
      {"u8", torch::tensor({0, 255}, torch::kByte)},
      {"flag", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(3.25)},
      {"empty", torch::zeros({0, 5})},
      {"z.last", torch::ones({1, 1, 1})},  // not in alphabetical order
      {"a.first", torch::full({70000}, 2.0)},  // a large numel (BININT for sizes)
  };
}

TEST(TorchPickle, WriteThenReadGivesTheSameNamesOrderAndValues) {
  const auto path = ddp::testing::temp_dir("pickle") + "/round.pt";
  const auto written = assorted_tensors();
  ddp::write_state_dict(path, written);
  const auto read = ddp::read_state_dict(path);
  ASSERT_EQ(read.size(), written.size());
  for (size_t k = 0; k < read.size(); ++k) {
    EXPECT_EQ(read[k].first, written[k].first);
    EXPECT_EQ(read[k].second.scalar_type(), written[k].second.scalar_type()) << read[k].first;
    EXPECT_TRUE(read[k].second.is_contiguous()) << read[k].first;
    EXPECT_TRUE(torch::equal(read[k].second, written[k].second)) << read[k].first;
  }
  ddp::write_state_dict(path, {});
  EXPECT_TRUE(ddp::read_state_dict(path).empty());
}

TEST(TorchPickle, ExportWeightsOfACheckpointRoundTrips) {
  const auto dir = ddp::testing::temp_dir("pickle_export");
  torch::nn::Sequential model(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2));
  ddp::CheckpointMeta meta;
  ddp::save_checkpoint(dir + "/ck.pt", *model, nullptr, meta);
  ddp::export_weights(dir + "/ck.pt", dir + "/w.pt");
  const auto sd = ddp::read_state_dict(dir + "/w.pt");
  EXPECT_EQ(sd.size(), 7u);
  const auto params = model->named_parameters();
  const auto buffers = model->named_buffers();
  for (const auto& [name, t] : sd) {
    auto* p = params.find(name);
    auto* b = buffers.find(name);
    ASSERT_TRUE(p || b) << name;
    EXPECT_TRUE(torch::equal(p ? *p : *b, t)) << name;
  }
}

// Python's torch.load(weights_only=True) reads what we write, and
// load_state_dict(strict=True) accepts it.
TEST(TorchPickle, PythonTorchLoadsWhatWeWrite) {
  const std::string python = "/usr/bin/python3";
  if (ddp::testing::run_process({python, "-c", "import torch"}, {}, 120).exit_code != 0)
    GTEST_SKIP() << python << " has no torch module (as on CI): cannot check that PyTorch reads our files";
  const auto dir = ddp::testing::temp_dir("pickle_python");
  torch::nn::Sequential model(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2));
  {
    torch::NoGradGuard no_grad;
    auto params = model->named_parameters();
    auto buffers = model->named_buffers();
    params["0.weight"].copy_(torch::arange(6, torch::kFloat).reshape({2, 3}) / 10);
    params["0.bias"].copy_(torch::tensor({-1.0f, 1.0f}));
    buffers["1.running_mean"].copy_(torch::tensor({0.5f, -0.5f}));
    buffers["1.num_batches_tracked"].fill_(int64_t(1) << 33);
  }
  ddp::export_state_dict(*model, dir + "/model.pt");
  auto assorted = assorted_tensors();
  ddp::write_state_dict(dir + "/assorted.pt", assorted);
  const std::string script = R"(
import collections, sys, torch
sd = torch.load(sys.argv[1], weights_only=True)
assert type(sd) is collections.OrderedDict, type(sd)
assert list(sd) == ['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean', '1.running_var',
                    '1.num_batches_tracked'], list(sd)
m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
m.load_state_dict(sd, strict=True)
assert torch.equal(m[0].weight, torch.arange(6.).reshape(2, 3) / 10)
assert torch.equal(m[0].bias, torch.tensor([-1., 1.]))
assert torch.equal(m[1].running_mean, torch.tensor([0.5, -0.5]))
assert m[1].num_batches_tracked.item() == 2 ** 33
d = torch.load(sys.argv[2], weights_only=True)
assert list(d)[:3] == ['f32', 'transposed', 'slice'] and list(d)[-2:] == ['z.last', 'a.first'], list(d)
assert torch.equal(d['transposed'], torch.arange(12.).reshape(3, 4).t())
assert torch.equal(d['slice'], torch.arange(6., 18.).reshape(2, 6))
assert d['bf16'].dtype == torch.bfloat16 and d['bf16'].float().tolist() == [1.5, -2.25, 9999220736.0]
assert d['f16'].dtype == torch.float16 and d['f64'].dtype == torch.float64
assert d['i64'].tolist() == [-2 ** 40, 2 ** 62, -5]
assert d['i32'].tolist() == [-2 ** 31, 2 ** 31 - 1] and d['i32'].dtype == torch.int32
assert d['i16'].tolist() == [-7, 300] and d['i8'].tolist() == [-128, 127] and d['u8'].tolist() == [0, 255]
assert d['flag'].tolist() == [True, False, True]
assert d['scalar'].shape == () and d['scalar'].item() == 3.25
assert d['empty'].shape == (0, 5) and d['z.last'].shape == (1, 1, 1)
assert d['a.first'].shape == (70000,) and bool((d['a.first'] == 2).all())
print('python read the files:', torch.__version__)
)";
  auto r = ddp::testing::run_process({python, "-c", script, dir + "/model.pt", dir + "/assorted.pt"}, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("python read the files"), std::string::npos) << r.output;
}

// ---- bad input: a UserError that names the file and says what was wrong ----

void expect_user_error(const std::string& path, const std::string& what) {
  try {
    ddp::read_state_dict(path);
    FAIL() << "no error for " << path;
  } catch (const ddp::UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find(what), std::string::npos) << m;
    EXPECT_NE(m.find("Hint: "), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

// Reading some entries reads only their storages: a damaged record of
// another entry goes unnoticed (it is not even paged in), while a full read
// refuses the file. So finding the checkpoint to resume from, which reads
// each candidate's header, costs kilobytes per file, not its gigabytes.
TEST(TorchPickle, ReadingSomeEntriesReadsOnlyTheirStorages) {
  const auto dir = ddp::testing::temp_dir("pickle_some");
  const auto header = torch::arange(16, torch::kUInt8), big = torch::randn({1000, 100}),
             tied = torch::arange(10, torch::kFloat);
  ddp::write_state_dict(dir + "/f.pt", {{"head", header}, {"big", big}, {"a", tied}, {"b", tied}});
  // Damage the middle of big's record (400,000 bytes: the file's bulk).
  auto bytes = ddp::testing::read_file(dir + "/f.pt");
  const auto at = bytes.size() / 2;
  bytes[at] = static_cast<char>(bytes[at] ^ 0x55);
  std::ofstream(dir + "/f.pt", std::ios::binary | std::ios::trunc) << bytes;
  const auto some = ddp::read_state_dict(dir + "/f.pt", [](const std::string& n) { return n != "big"; });
  ASSERT_EQ(some.size(), 3u);
  EXPECT_EQ(some[0].first, "head");
  EXPECT_TRUE(torch::equal(some[0].second, header));
  EXPECT_TRUE(torch::equal(some[1].second, tied));
  EXPECT_TRUE(torch::equal(some[2].second, tied));
  EXPECT_EQ(some[1].second.data_ptr(), some[2].second.data_ptr()) << "a shared storage is still shared";
  const auto msg = ddp::testing::user_error([&] { ddp::read_state_dict(dir + "/f.pt"); });
  EXPECT_NE(msg.find("damaged (CRC mismatch)"), std::string::npos) << msg;
}

TEST(TorchPickle, TruncatedZipIsAUserError) {
  const auto path = ddp::testing::temp_dir("pickle_bad") + "/truncated.pt";
  const auto bytes = ddp::testing::read_file(kData + "/pickle_bn.pt");
  std::ofstream(path, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  expect_user_error(path, "not a complete PyTorch zip file");
}

TEST(TorchPickle, ZipWithoutDataPklIsAUserError) {
  const auto path = ddp::testing::temp_dir("pickle_bad") + "/other.pt";
  {
    caffe2::serialize::PyTorchStreamWriter zip(path);
    zip.writeRecord("notes.txt", "hello", 5);
    zip.writeEndOfFile();
  }
  expect_user_error(path, "no data.pkl");
}

TEST(TorchPickle, UnsupportedGlobalIsAUserError) {
  expect_user_error(kData + "/pickle_bad_global.pt", "the global 'torch.device'");
}

TEST(TorchPickle, ACheckpointDictIsAUserErrorNamingTheKey) {
  expect_user_error(kData + "/pickle_nested.pt", "'model' holds a dict, not a tensor");
}

TEST(TorchPickle, DamagedPickleIsAUserError) {
  // A valid zip whose data.pkl is cut short.
  const auto path = ddp::testing::temp_dir("pickle_bad") + "/short.pt";
  {
    caffe2::serialize::PyTorchStreamWriter zip(path);
    const char pkl[] = "\x80\x02}q\x00(X\x01\x00\x00";
    zip.writeRecord("data.pkl", pkl, sizeof pkl - 1);
    zip.writeEndOfFile();
  }
  expect_user_error(path, "the pickle ends early");
}

TEST(TorchPickle, PretrainOfANonZipNamesTheFile) {
  const auto path = ddp::testing::temp_dir("pickle_bad") + "/legacy.pt";
  std::ofstream(path) << "not a zip";
  torch::nn::Sequential model(torch::nn::Linear(3, 2));
  try {
    ddp::load_pretrained(path, *model, torch::kCPU);
    FAIL();
  } catch (const ddp::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--pretrain " + path + " is neither a ddptrain checkpoint nor a PyTorch"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
