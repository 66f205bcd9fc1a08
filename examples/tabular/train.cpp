// Tabular regression from a CSV: 8 numeric features and a store id, an MLP
// with an embedding for the store, Huber loss, and MAE, RMSE and R^2 with
// MAE as the monitor:
//   ./build/tabular --data_root DIR                  DIR/train.csv and DIR/test.csv
//   ./build/tabular --data_root DIR --size 2 --val-split 0.1 --epochs 10
//   ./build/tabular predict --checkpoint RUN/best.pt --split NEW.csv --out sales.csv
// Each CSV has the header x0,...,x7,store,sales; store is an integer id from
// 0. The data is read into named tensors held in memory (ddp::data::read_csv,
// NamedTensorDataset); --val-split holds out a validation split that chooses
// best.pt, and test is evaluated on best.pt at the end. On 3000 rows, 2 CPU
// ranks, --epochs 4 --lr 1e-2 --batch 16 reach R^2 >= 0.9 on test (0.94
// measured; tests/train/task_test.cpp), in about 2 s. The same CSVs as tar
// shards, streamed (each sample a record's .csv field, decoded into the same
// named tensors):
//   ./build/ddptrain shards DIR/train.csv DIR/train && ./build/ddptrain shards DIR/test.csv DIR/test
//   ./build/tabular --train-shards DIR/train-000000.tar --test-shards DIR/test-000000.tar --size 2
#include <ddp/app.h>
#include <ddp/data/csv.h>
#include <ddp/data/shards.h>
#include <ddp/data/tensor_dataset.h>
#include <ddp/error.h>

#include <algorithm>
#include <numeric>

namespace F = torch::nn::functional;

// ---------------------------------------------------------------------------
// 1. My data: a CSV file as named tensors ("input", "store", "target"); or
//    the same CSV written as tar shards (ddptrain shards train.csv OUT),
//    streamed: each sample's .csv field (its header and record) becomes the
//    same named tensors.
// ---------------------------------------------------------------------------
const std::vector<std::string> kFeatures{"x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7"};
const auto kSalesCsv = ddp::data::CsvOptions().categories({"store"});

ddp::data::TensorDict read_sales(const std::string& path) {
  const auto table = ddp::data::read_csv(path, kSalesCsv);
  return {{"input", table.floats(kFeatures)},
          {"store", table.column("store")},
          {"target", table.column("sales").unsqueeze(1)}};
}

// A sample of the shards, its features standardised with (mean, std).
ddp::data::FieldDecoder sales_record(torch::Tensor mean, torch::Tensor std) {
  return [record = ddp::data::csv_field(kSalesCsv), mean, std](const std::vector<uint8_t>& bytes,
                                                               const std::string& where) {
    auto row = record(bytes, where);
    std::vector<torch::Tensor> x;
    for (const auto& name : kFeatures) x.push_back(row.at(name));
    return ddp::data::TensorDict{{"input", (torch::stack(x) - mean) / std},
                                 {"store", row.at("store")},
                                 {"target", row.at("sales").unsqueeze(0)}};
  };
}

// Shards named by `pattern` as a dataset whose samples `decode` makes.
std::shared_ptr<ddp::data::ShardDataset> sales_shards(const std::string& pattern, ddp::data::FieldDecoder decode,
                                                      bool skip_bad) {
  auto index = ddp::data::scan_shards(ddp::data::expand_shard_pattern(pattern),
                                      ddp::data::ShardScanOptions().image(false).fields({"csv"}).skip_incomplete(skip_bad));
  return std::make_shared<ddp::data::ShardDataset>(
      std::move(index), ddp::data::ShardDatasetOptions().image(false).fields({{"csv", decode}}).skip_bad(skip_bad),
      "sales shards " + pattern);
}

// Every record of the shards, in the CSV's order (their keys are its record
// numbers): what read_sales gives for the CSV they were written from.
ddp::data::TensorDict read_sales_shards(const std::string& pattern, bool skip_bad) {
  const auto shards = sales_shards(pattern, sales_record(torch::zeros({8}), torch::ones({8})), skip_bad);
  std::vector<int64_t> ids(static_cast<size_t>(shards->size()));
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
    return shards->index().keys[static_cast<size_t>(a)] < shards->index().keys[static_cast<size_t>(b)];
  });
  return shards->get_batch(ids);
}

// ---------------------------------------------------------------------------
// 2. My model: the store's embedding beside the features, then an MLP. The
//    MLP is plain LibTorch layers in a Sequential: at start ddptrain turns
//    its Linears into ddp::nn::Linear, each ReLU folded into the Linear
//    before it (--convert-layers; the start line says so), with the same
//    state_dict names and values.
// ---------------------------------------------------------------------------
struct SalesMlpImpl : torch::nn::Module {
  SalesMlpImpl(int64_t stores, int64_t embedding, int64_t hidden)
      : store(register_module("store", torch::nn::Embedding(stores, embedding))),
        mlp(register_module("mlp", torch::nn::Sequential(torch::nn::Linear(8 + embedding, hidden), torch::nn::ReLU(),
                                                         torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                                         torch::nn::Linear(hidden, 1)))) {}

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& store_id) {
    return mlp->forward(torch::cat({x, store(store_id)}, 1));  // B x 1, like the target
  }

  torch::nn::Embedding store;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(SalesMlp);

// ---------------------------------------------------------------------------
// 3. My task: standardised features, Huber loss (plus a penalty on the
//    embeddings, under its own flag), MAE/RMSE/R^2 from sums.
// ---------------------------------------------------------------------------
struct SalesTask : ddp::Task {
  SalesMlp model{nullptr};
  int64_t stores = 0;

  void add_flags(ddp::Config& config) override {
    config.add_flag("--hidden", "width of the MLP's hidden layers", 64);
    config.add_flag("--train-shards", "tar shards of the training CSV (ddptrain shards train.csv OUT), streamed "
                    "instead of DIR/train.csv, e.g. 'OUT-{000000..000003}.tar'", "");
    config.add_flag("--test-shards", "tar shards of the test CSV, with --train-shards", "");
    config.add_flag("--embedding-penalty", "weight of the mean square of the store embeddings in the loss", 1e-4);
  }

  ddp::data::Splits make_data(const ddp::Config& config, ddp::World&) override {
    const auto train_shards = config.flag<std::string>("train-shards");
    if (!train_shards.empty()) return shards_data(train_shards, config.flag<std::string>("test-shards"), config);
    auto train = read_sales(config.data_root + "/train.csv"), test = read_sales(config.data_root + "/test.csv");
    // Standardise with the training set's statistics, for train and test alike.
    feature_mean = train.input().mean(0), feature_std = train.input().std(0).clamp_min(1e-6);
    for (auto* split : {&train, &test}) split->input() = (split->input() - feature_mean) / feature_std;
    stores = 1 + std::max(train.at("store").max().item<int64_t>(), test.at("store").max().item<int64_t>());
    ddp::data::Splits data;
    data.train = std::make_shared<ddp::data::NamedTensorDataset>(train, "sales train.csv");
    data.test = std::make_shared<ddp::data::NamedTensorDataset>(test, "sales test.csv");
    return data;
  }

  // The shards, streamed; the statistics from one pass over the training
  // records in the CSV's order (so the same as from the CSV).
  ddp::data::Splits shards_data(const std::string& train_pattern, const std::string& test_pattern,
                                const ddp::Config& config) {
    ddp::check_user(!test_pattern.empty(), "--train-shards needs --test-shards.", "write test.csv as shards too.");
    const auto train = read_sales_shards(train_pattern, config.skip_bad_samples);
    const auto test = read_sales_shards(test_pattern, config.skip_bad_samples);
    feature_mean = train.input().mean(0), feature_std = train.input().std(0).clamp_min(1e-6);
    stores = 1 + std::max(train.at("store").max().item<int64_t>(), test.at("store").max().item<int64_t>());
    ddp::data::Splits data;
    data.train = sales_shards(train_pattern, sales_record(feature_mean, feature_std), config.skip_bad_samples);
    data.test = sales_shards(test_pattern, sales_record(feature_mean, feature_std), config.skip_bad_samples);
    return data;
  }

  // What `tabular predict --split NEW.csv` predicts: NEW.csv's rows (no
  // sales column needed), standardised as the run's data was. The run's
  // data comes first: its statistics, and the stores the model was made for.
  ddp::data::DatasetPtr make_predict_data(const ddp::Config& config, ddp::World& world,
                                          const std::string& path) override {
    make_data(config, world);
    auto columns = kFeatures;
    columns.push_back("store");
    const auto table = ddp::data::read_csv(path, ddp::data::CsvOptions(kSalesCsv).columns(columns));
    const auto store = table.column("store");
    const int64_t top = table.rows > 0 ? store.max().item<int64_t>() : 0;
    ddp::check_user(top < stores, path + ": store " + std::to_string(top) + " is not one of the " +
                                      std::to_string(stores) + " stores the model was trained on.",
                    "predict rows of the stores in the run's train.csv and test.csv.");
    ddp::data::TensorDict rows{{"input", (table.floats(kFeatures) - feature_mean) / feature_std}, {"store", store}};
    return std::make_shared<ddp::data::NamedTensorDataset>(rows, path);
  }

  ddp::ModulePtr make_model(const ddp::Config& config, const ddp::data::Splits&) override {
    const int hidden = config.flag<int>("hidden");
    arch_ = "sales-mlp/" + std::to_string(stores) + "/" + std::to_string(hidden);
    model = SalesMlp(stores, 4, hidden);
    penalty = config.flag<double>("embedding-penalty");
    return model.ptr();
  }

  ddp::StepOutput training_step(const ddp::data::Batch& batch) override {
    const auto huber = F::huber_loss(model(batch.input(), batch.at("store")), batch.target());
    const auto embedding = model->store->weight.pow(2).mean();
    return {huber + penalty * embedding, {{"train_huber", huber.detach()}}};
  }

  // Sums over the batch; ddptrain adds them up over batches and ranks.
  ddp::TensorMap validation_step(const ddp::data::Batch& batch) override {
    const auto y = batch.target().to(torch::kDouble);
    const auto error = model(batch.input(), batch.at("store")).to(torch::kDouble) - y;
    return {{"abs_error", error.abs().sum()}, {"sq_error", error.pow(2).sum()}, {"y", y.sum()},
            {"y_sq", y.pow(2).sum()}, {"count", torch::tensor(static_cast<double>(y.size(0)), torch::kDouble)}};
  }

  // Named once, without a split: ddptrain reports them as val_* and test_*.
  ddp::Metrics validation_metrics(const ddp::Totals& t) override {
    const double n = t.at("count").item<double>(), sse = t.at("sq_error").item<double>();
    const double sst = t.at("y_sq").item<double>() - t.at("y").item<double>() * t.at("y").item<double>() / n;
    return {{"mae", t.at("abs_error").item<double>() / n},
            {"rmse", std::sqrt(sse / n)},
            {"r2", sst > 0 ? 1.0 - sse / sst : std::nan("")}};
  }

  ddp::Monitor monitor() const override { return {"mae", ddp::Goal::kMin}; }

  // What `tabular predict --checkpoint RUN/best.pt --out preds.csv` writes per row.
  ddp::TensorMap predict_step(const ddp::data::Batch& batch) override {
    return {{"sales", model(batch.input(), batch.at("store")).squeeze(1)}};
  }

  double penalty = 0;
  torch::Tensor feature_mean, feature_std;  // the training set's (make_data)
};

// ---------------------------------------------------------------------------
// 4. Train.
// ---------------------------------------------------------------------------
int main(int argc, char** argv) {
  return ddp::main(argc, argv, std::make_shared<SalesTask>(),
                   ddp::ProgramOptions("tabular").description("predicts sales from a CSV"));
}
