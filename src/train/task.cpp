// The Task defaults, and the two built-in tasks: classification and
// regression.
#include "ddp/train/task.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ddp/app.h"
#include "ddp/data/synthetic.h"
#include "ddp/dist/world.h"
#include "ddp/error.h"
#include "ddp/models/registry.h"
#include "ddp/train/lm_task.h"

namespace ddp {

// ---- Task defaults ---------------------------------------------------------

data::Splits Task::make_data(const Config& config, World& world) {
  builtin_data_ = true;
  return load_data(config, world.is_main(), world.device());
}

namespace {

// The built-in network --model names, sized from the data: its input shape,
// and as many outputs as there are classes (or target values per sample).
std::shared_ptr<Net> builtin_net(const Config& c, const data::Splits& data, int64_t outputs, std::string& arch) {
  models::ModelSpec spec;
  spec.name = c.model;
  spec.stem = c.stem;
  spec.recompute = c.recompute;
  const auto shape = data.train->input_shape();
  check_user(shape.size() == 3, "the built-in models need C x H x W images; the dataset gives " +
                                    c10::str(c10::IntArrayRef(shape)) + ".",
             "bring your own model (Task::make_model) for other inputs.");
  spec.in_channels = shape[0];
  spec.input_hw = {shape[1], shape[2]};
  spec.num_classes = outputs;
  arch = c.model + "/" + c.stem + "/" + std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + "x" +
         std::to_string(shape[2]) + "/" + std::to_string(outputs);
  return models::make_model(spec);
}

}  // namespace

ModulePtr Task::make_model(const Config& config, const data::Splits& data) {
  builtin_model_ = true;
  return builtin_net(config, data, std::max<int64_t>(1, data.train->num_classes()), arch_);
}

Metrics Task::validation_metrics(const Totals& totals) {
  Metrics out;
  auto count = totals.find("count");
  check_user(count != totals.end(), "validation_step() returned no \"count\", so the default validation_metrics() "
                                    "cannot average its sums.",
             "return {\"count\", batch size} as well, or override validation_metrics().");
  const double n = std::max(1.0, count->second.item<double>());
  for (const auto& [name, total] : totals)
    if (name != "count" && total.numel() == 1) out["test_" + name] = total.item<double>() / n;
  return out;
}

TensorMap Task::predict_step(const data::Batch& batch) {
  auto* net = dynamic_cast<Net*>(model_.get());
  check_user(net != nullptr, "the default predict_step() runs a ddp::Net, and this task's model is another module.",
             "override predict_step(batch) in your task to return its named outputs, e.g. {{\"output\", model(b.input())}}.");
  check_user(batch.contains("input"), "the default predict_step() reads the batch's \"input\", which this data lacks.",
             "override predict_step(batch) to call your model on the tensors your dataset gives.");
  return {{"output", net->forward(batch.input())}};
}

data::DatasetPtr Task::test_split_at(const Config& config, World& world, const std::string& path) {
  Config c = config;
  c.data_root = path;
  if (std::find(c.given.begin(), c.given.end(), "data_root") == c.given.end()) c.given.push_back("data_root");
  return make_data(c, world).test;
}

data::DatasetPtr Task::make_predict_data(const Config& config, World& world, const std::string& path) {
  // A task's own make_data() makes its data, or reads it from wherever it
  // likes: nothing says it read PATH, and its own test split in PATH's place
  // would be predicted without a word. Said too where its make_data()
  // fails on PATH (e.g. PATH/train.csv missing): the fix is the same.
  const auto refusal = [&] {
    return UserError("predict --split " + path + ": this task makes its data in its own make_data(), which " +
                         "ddptrain cannot point at " + path + ".",
                     "override make_predict_data(config, world, path) in your task to return the samples in " + path +
                         " (examples/tabular does), or predict --split test, val or train.");
  };
  data::DatasetPtr data;
  try {
    data = test_split_at(config, world, path);
  } catch (const UserError&) {
    if (!builtin_data_) throw refusal();
    throw;
  }
  if (!builtin_data_) throw refusal();
  return data;
}

std::vector<std::string> Task::ignored_flags() const {
  std::vector<std::string> out = {"task", "loss", "label-smoothing"};
  if (!builtin_model_) out.insert(out.end(), {"model", "stem"});
  if (!builtin_data_)
    out.insert(out.end(), {"dataset", "val-root", "image-size", "strict-data", "image-decode", "cpu-decode-share"});
  return out;
}

void check_flags_apply(const Config& config, const Task& task) {
  std::vector<std::string> wrong;
  for (const auto& name : task.ignored_flags())
    if (config.was_given(name)) wrong.push_back("--" + name);
  if (wrong.empty()) return;
  std::string list;
  for (const auto& w : wrong) list += (list.empty() ? "" : ", ") + w;
  throw UserError(list + (wrong.size() == 1 ? " does" : " do") +
                      " not apply to this program: its task brings its own data, model or loss, and would ignore it.",
                  "drop " + list + " (see --help for the flags it reads).");
}

// ---- Classification ----------------------------------------------------------

ModulePtr ClassificationTask::make_model(const Config& config, const data::Splits& data) {
  loss_ = LossOptions().kind(config.loss).label_smoothing(config.label_smoothing);
  net_ = make_net(config, data);
  return net_;
}

std::shared_ptr<Net> ClassificationTask::make_net(const Config& config, const data::Splits& data) {
  builtin_model_ = true;
  const int64_t classes = data.train->num_classes();
  check_user(classes > 0, "the classification task needs a dataset with classes; " + data.train->name() + " has none.",
             "use --task regression for real-valued targets.");
  return builtin_net(config, data, classes, arch_);
}

StepOutput ClassificationTask::training_step(const data::Batch& batch) {
  return compute_loss(net_->forward(batch.input()), batch.target(), loss_);
}

TensorMap ClassificationTask::validation_step(const data::Batch& batch) {
  auto out = net_->forward(batch.input()).to(torch::kFloat);
  const auto& y = batch.target();
  const double n = static_cast<double>(y.size(0));
  // Validation reports the plain loss (no label smoothing), as before.
  return {{"loss", compute_loss(out, y, LossOptions().kind(loss_.kind())) * n},
          {"correct", out.argmax(1).eq(y).sum()},
          {"count", torch::full({}, n, torch::kDouble)}};
}

Metrics ClassificationTask::validation_metrics(const Totals& t) {
  const double n = std::max(1.0, t.at("count").item<double>());
  return {{"test_loss", t.at("loss").item<double>() / n}, {"test_acc", t.at("correct").item<double>() / n}};
}

std::vector<std::string> ClassificationTask::ignored_flags() const {
  auto out = Task::ignored_flags();
  out.erase(std::remove_if(out.begin(), out.end(),
                           [](const std::string& f) { return f == "task" || f == "loss" || f == "label-smoothing"; }),
            out.end());
  return out;
}

// ---- Regression --------------------------------------------------------------

void RegressionTask::add_flags(Config& config) {
  config.loss = "mse";
  config.augment = "none";  // a flip or shift may change what the target measures
}

data::Splits RegressionTask::make_data(const Config& config, World& world) {
  if (config.dataset != "auto" && config.dataset != "synthetic") return Task::make_data(config, world);
  check_user(!config.was_given("data_root"),
             "--task regression with --dataset " + config.dataset + " makes its own data, so --data_root " +
                 config.data_root + " would not be read.",
             "drop --data_root, or name the data's kind with --dataset (e.g. imagefolder), or write make_data() for "
             "your own files (examples/regression).");
  builtin_data_ = true;
  return data::make_synthetic_regression(config.train_samples > 0 ? config.train_samples : 20000,
                                         config.test_samples > 0 ? config.test_samples : 4000,
                                         static_cast<uint64_t>(config.seed));
}

std::shared_ptr<Net> RegressionTask::make_net(const Config& config, const data::Splits& data) {
  builtin_model_ = true;
  check_user(config.loss != "cross-entropy", "--loss cross-entropy is for classification.",
             "use --loss mse, l1 or huber with --task regression.");
  const auto target = data.train->get(0).target();
  return builtin_net(config, data, std::max<int64_t>(1, target.numel()), arch_);
}

StepOutput RegressionTask::training_step(const data::Batch& batch) {
  return compute_loss(net_->forward(batch.input()), batch.target(), loss_);
}

TensorMap RegressionTask::validation_step(const data::Batch& batch) {
  auto out = net_->forward(batch.input()).to(torch::kDouble);
  const auto y = batch.target().to(torch::kDouble);
  check_user(out.sizes() == y.sizes(), "the model's outputs " + c10::str(out.sizes()) + " and the targets " +
                                           c10::str(y.sizes()) + " differ in shape.",
             "make the model give one value per target value.");
  const double n = static_cast<double>(y.size(0));
  const auto diff = out - y;
  // Sums for R^2 = 1 - SSE / SST over the whole set: SST from the sums of y
  // and y^2 (double precision keeps the subtraction honest).
  return {{"loss", compute_loss(out, y, LossOptions().kind(loss_.kind())) * n},
          {"sq_error", diff.pow(2).sum()},
          {"abs_error", diff.abs().sum()},
          {"y_sum", y.sum()},
          {"y_sq_sum", y.pow(2).sum()},
          {"values", torch::full({}, static_cast<double>(y.numel()), torch::kDouble)},
          {"count", torch::full({}, n, torch::kDouble)}};
}

Metrics RegressionTask::validation_metrics(const Totals& t) {
  const double n = std::max(1.0, t.at("count").item<double>());
  const double values = std::max(1.0, t.at("values").item<double>());
  const double sse = t.at("sq_error").item<double>();
  const double mean = t.at("y_sum").item<double>() / values;
  const double sst = t.at("y_sq_sum").item<double>() - values * mean * mean;
  return {{"test_loss", t.at("loss").item<double>() / n},
          {"test_mse", sse / values},
          {"test_mae", t.at("abs_error").item<double>() / values},
          {"test_r2", sst > 0 ? 1.0 - sse / sst : std::numeric_limits<double>::quiet_NaN()}};
}

std::vector<std::string> RegressionTask::ignored_flags() const {
  auto out = ClassificationTask::ignored_flags();
  out.push_back("label-smoothing");
  return out;
}

Config builtin_task_flags() {
  Config lm;
  LmTask().add_flags(lm);
  Config out;
  out.task_flags = lm.task_flags;
  return out;
}

std::shared_ptr<Task> make_builtin_task(const std::string& name) {
  if (name == "classification") return std::make_shared<ClassificationTask>();
  if (name == "regression") return std::make_shared<RegressionTask>();
  if (name == "lm") return std::make_shared<LmTask>();
  throw UserError("unknown --task '" + name + "'.", "use --task classification, regression or lm.");
}

}  // namespace ddp
