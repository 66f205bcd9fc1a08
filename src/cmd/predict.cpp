// `predict`: the task's predict_step() over a split, sharded over the ranks,
// gathered in the dataset's order and written as .csv or .npy.
#include "ddp/cmd/predict.h"

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "ddp/data/loader.h"
#include "ddp/data/sampler.h"
#include "ddp/dist/world.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/train/validation.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Element i of a contiguous tensor as text: the fewest digits that read
// back to it exactly.
std::string cell(const torch::Tensor& t, int64_t i) {
  char buf[64];
  std::to_chars_result r{};
  switch (t.scalar_type()) {
    case torch::kDouble: r = std::to_chars(buf, buf + sizeof buf, t.data_ptr<double>()[i]); break;
    case torch::kFloat: r = std::to_chars(buf, buf + sizeof buf, t.data_ptr<float>()[i]); break;
    case torch::kLong: r = std::to_chars(buf, buf + sizeof buf, t.data_ptr<int64_t>()[i]); break;
    default: TORCH_CHECK(false, "cell() got ", t.scalar_type());
  }
  return std::string(buf, r.ptr);
}

// The dtypes the files hold: float32/64 and int64 as they are; the rest
// widened exactly (bf16 and fp16 to float32, bool and small ints to int64).
torch::Tensor widened(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble || t.scalar_type() == torch::kLong) return t;
  return t.to(t.is_floating_point() ? torch::kFloat : torch::kLong);
}

// Rows of every rank, each at its index in the dataset, on every rank: the
// rows another rank holds are zeros here, and a sum of the values' bits as
// integers places each exactly.
torch::Tensor gather_rows(World& world, const torch::Tensor& local, const std::vector<int64_t>& indices, int64_t n,
                          const std::string& name) {
  auto shape = local.sizes().vec();
  shape[0] = n;
  const auto bits_type = local.element_size() == 8 ? torch::kLong : torch::kInt;  // float32 -> int32
  auto all = torch::zeros(shape, local.options().dtype(bits_type));
  all.index_copy_(0, torch::tensor(indices, torch::kLong), local.contiguous().view(bits_type));
  auto on_device = all.to(world.device());
  world.all_reduce(on_device, "predict: gathering '" + name + "'");
  return on_device.cpu().view(local.scalar_type());
}

// The same names, per-sample shapes and dtypes on every rank, or an error
// on every rank (a gather of different sizes would hang).
void check_same_on_every_rank(World& world, const TensorMap& outputs) {
  double signature = 0;
  for (const auto& [name, t] : outputs)
    signature += static_cast<double>(std::hash<std::string>{}(name + c10::str(t.sizes().slice(1), t.scalar_type())) %
                                     1000003);
  auto header = torch::tensor({signature}, torch::kDouble).to(world.device());
  world.all_reduce(header, "predict: comparing outputs");
  check_user(header.cpu().item<double>() == signature * world.size(),
             "predict_step() returned other names, per-sample shapes or dtypes on another rank.",
             "return the same names, each of the same shape per sample, for every batch.");
}

}  // namespace

Config predict_config(const Config& now) {
  check_user(!now.checkpoint.empty(), "predict needs --checkpoint.", "e.g. predict --checkpoint RUN/best.pt --out preds.csv.");
  check_user(fs::is_regular_file(now.checkpoint), "--checkpoint " + now.checkpoint + " does not exist.",
             "pass a checkpoint of a run, e.g. RUN/best.pt.");
  check_user(ends_with(now.out, ".csv") || ends_with(now.out, ".npy"),
             "--out '" + now.out + "' names no .csv or .npy file.", "e.g. --out preds.csv or --out preds.npy.");
  check_output_is_no_checkpoint(now.out, now.checkpoint);
  const auto saved = read_checkpoint_meta(now.checkpoint).config;
  // Flags that build the model or its data are the run's; a path may
  // differ (the data on another machine: --data_root is not kSame).
  Config copy = now;
  const auto given = config_to_json(now);
  for (const auto& f : flag_table(copy)) {
    const std::string key = f.key();
    if (f.on_resume != OnResume::kSame || !now.was_given(key) || !saved.contains(key) || saved[key] == given[key])
      continue;
    throw UserError("--" + key + " " + given[key].dump() + " differs from the run's " + saved[key].dump() +
                        ": predict builds the model and data of the run that wrote " + now.checkpoint + ".",
                    "drop --" + key + "; to predict other data, pass it as --split FILE.");
  }
  Config c = resumed_config(now, saved, now.checkpoint);
  return c;
}

int run_predict(const Config& c, World& world, Task& task) {
  const auto dev = world.device();
  data::DatasetPtr data;
  data::Splits splits;
  if (c.split == "train" || c.split == "val" || c.split == "test") {
    // The splits as the run had them: train less what --val-split carved.
    splits = task.make_data(c, world);
    add_validation_split(splits, c);
    data = c.split == "train" ? splits.train : c.split == "val" ? splits.val : splits.test;
    check_user(data != nullptr || c.split != "val", "--split val: the run had no validation split.",
               "predict --split test or train, or train with --val-split.");
  } else {
    check_user(fs::exists(c.split), "--split " + c.split + " is neither train, val, test nor an existing file or folder.",
               "pass --split test, --split val, --split train, or the path of data of the kind --data_root takes.");
    data = task.make_predict_data(c, world, c.split);
    splits.train = splits.test = data;
  }
  check_user(data != nullptr, "predict: the task gave no data for --split " + c.split + ".",
             "return it from make_data() (or make_predict_data() for a file).");
  const int64_t n = data->size();
  check_user(n >= world.size(), "--split " + c.split + " has " + std::to_string(n) + " samples, fewer than the " +
                                    std::to_string(world.size()) + " ranks.",
             "predict with fewer ranks (--size 1).");
  auto model = task.make_model(c, splits);
  check_user(model != nullptr, "make_model() returned no model.", "return your model's .ptr().");
  const auto arch = read_checkpoint_meta(c.checkpoint).arch;
  check_user(arch == task.arch(), "checkpoint " + c.checkpoint + " is for model '" + arch + "', but this program builds '" +
                                      task.arch() + "'.",
             "predict with the program (and task) that trained it.");
  model->to(dev);
  load_model_weights(c.checkpoint, *model, dev);
  model->eval();
  task.set_model(model);
  torch::NoGradGuard no_grad;

  // Each sample on exactly one rank (no padding), rows kept with their index.
  const auto indices = shard_without_padding(n, world.rank(), world.size());
  data::Loader loader(data, indices, data::LoaderOptions(c.batch * 2).workers(c.workers).pin_memory(dev.is_cuda()));
  std::map<std::string, std::vector<torch::Tensor>> parts;
  const auto stage = data->device_stage();
  while (auto batch = loader.next()) {
    if (stage) stage->run(*batch, dev);
    for (auto& [name, t] : *batch) t = t.to(dev, true);
    const int64_t rows = batch->batch_size();
    for (auto& [name, t] : task.predict_step(*batch)) {
      check_user(t.defined() && t.dim() >= 1 && t.size(0) == rows,
                 "predict_step() returned '" + name + "' of shape " + (t.defined() ? c10::str(t.sizes()) : "none") +
                     " for a batch of " + std::to_string(rows) + ".",
                 "return one row per sample: a tensor whose first dimension is the batch size.");
      parts[name].push_back(widened(t.detach()).cpu());
    }
  }
  check_user(!parts.empty(), "predict_step() returned no tensors.", "return at least one, e.g. {\"output\", y}.");
  TensorMap local;
  for (auto& [name, p] : parts) local[name] = torch::cat(p);
  check_same_on_every_rank(world, local);
  TensorMap all;
  for (const auto& [name, t] : local) all[name] = gather_rows(world, t, indices, n, name);
  if (world.is_main()) {
    if (ends_with(c.out, ".npy")) {
      check_user(all.size() == 1, "predict_step() returned " + std::to_string(all.size()) + " names, and a .npy file holds one array.",
                 "write them all with --out " + c.out.substr(0, c.out.size() - 4) + ".csv, or return one name.");
      write_npy(c.out, all.begin()->second);
    } else {
      write_csv(c.out, all);
    }
    std::string names;
    for (const auto& [name, t] : all) names += (names.empty() ? "" : ", ") + name + " " + c10::str(t.sizes().slice(1));
    std::printf("predict: wrote %s: %lld rows of %s (%s, weights of %s)\n", c.out.c_str(), static_cast<long long>(n),
                data->name().c_str(), names.c_str(), c.checkpoint.c_str());
    std::fflush(stdout);
  }
  world.barrier("predict: the file is written");
  return exit_code::kOk;
}

void write_npy(const std::string& path, const torch::Tensor& tensor) {
  auto t = tensor.scalar_type() == torch::kBFloat16 ? tensor.to(torch::kFloat) : tensor;
  t = t.contiguous().cpu();
  std::string descr;
  switch (t.scalar_type()) {
    case torch::kFloat: descr = "<f4"; break;
    case torch::kDouble: descr = "<f8"; break;
    case torch::kHalf: descr = "<f2"; break;
    case torch::kLong: descr = "<i8"; break;
    case torch::kInt: descr = "<i4"; break;
    case torch::kShort: descr = "<i2"; break;
    case torch::kChar: descr = "|i1"; break;
    case torch::kByte: descr = "|u1"; break;
    case torch::kBool: descr = "|b1"; break;
    default: throw UserError("predict: a tensor of " + std::string(c10::toString(t.scalar_type())) + " has no .npy type.",
                             "return float, double or integer tensors from predict_step().");
  }
  std::string shape = "(";
  for (int64_t d = 0; d < t.dim(); ++d) shape += std::to_string(t.size(d)) + (t.dim() == 1 || d + 1 < t.dim() ? "," : "");
  shape += ")";
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  // The magic, version, header length and header take a multiple of 64
  // bytes, the header ending in a newline (NumPy's format 1.0).
  const size_t unpadded = 6 + 2 + 2 + header.size() + 1;
  header += std::string((64 - unpadded % 64) % 64, ' ') + "\n";
  std::string file = std::string("\x93NUMPY\x01\x00", 8);
  file += static_cast<char>(header.size() & 0xff);
  file += static_cast<char>((header.size() >> 8) & 0xff);
  file += header;
  file.append(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * t.element_size());
  write_file_atomic(path, file);  // little-endian: the hosts LibTorch runs on
}

void write_csv(const std::string& path, const TensorMap& columns) {
  std::string out;
  std::vector<torch::Tensor> flat;
  int64_t rows = -1;
  for (const auto& [name, t] : columns) {
    auto f = t.reshape({t.size(0), -1}).contiguous();
    TORCH_CHECK(rows < 0 || f.size(0) == rows, "write_csv: columns of different lengths");
    rows = f.size(0);
    for (int64_t j = 0; j < f.size(1); ++j)
      out += (out.empty() ? "" : ",") + (f.size(1) == 1 ? name : name + "_" + std::to_string(j));
    flat.push_back(widened(f).contiguous());
  }
  out += "\n";
  for (int64_t i = 0; i < rows; ++i) {
    bool first = true;
    for (const auto& f : flat) {
      const int64_t width = f.size(1);
      for (int64_t j = 0; j < width; ++j) {
        if (!first) out += ",";
        out += cell(f, i * width + j);
        first = false;
      }
    }
    out += "\n";
  }
  write_file_atomic(path, out);
}

}  // namespace ddp
