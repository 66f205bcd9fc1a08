// Loader throughput on image folders: images per second out of
// ddp::data::Loader (read, decode, transform, stack) for 0, 1, 2, 4, ...
// worker threads, with no model attached.
//
// Two folders are generated under --dir on the first run (and reused; a
// `complete` marker guards against a half-written one):
//   fmnist-png/   Fashion-MNIST's first --fmnist training images as 28 x 28
//                 grayscale PNGs, one folder per class (skipped when the
//                 dataset is not installed);
//   jpeg/         --jpegs synthetic photos-like JPEGs of 256..384 px a side
//                 (smooth colour fields plus noise, quality 90), 10 classes;
//   jpeg-WxH/     --large-jpegs of them at --large-size (2000x1500), the
//                 size of a camera photo, read twice: decoded in full and
//                 at the reduced scale the transform allows (image_codec.h).
// A count of 0 skips that folder. Each is read for one full pass per worker
// count, in a fixed shuffled order, with the training transform
// (random-resized crop + flip) at --fmnist-size and --jpeg-size; a first
// pass warms the page cache.
//
//   loader_bench [--dir D] [--jpegs N] [--fmnist N] [--large-jpegs N] [--large-size WxH] [--batch B]
//                [--max-workers W] [--intra-op-threads T]
//
// With --shards-from DIR it measures instead an image folder against the
// same images as tar shards (written once by `ddptrain shards` under --dir):
// the folder in a shuffled order (as DistributedSampler), the shards as one
// rank's stream (one stream, a 1000-sample shuffle buffer), both with the
// training transform at --jpeg-size, the best of three
// passes each, taken in turn, after a page-cache pass.
//   loader_bench --shards-from DIR [--batch B] [--max-workers W] [--jpeg-size S] [--shuffle-buffer N]
//
// With --gpu-folder DIR (a CUDA build with nvJPEG and a GPU), it measures
// instead the GPU decode path on an existing folder, with no model: the
// loader alone (files read and JPEG headers parsed, batches of bytes), then
// the loader with the device stage (nvJPEG batched decode, then the
// resample kernel) through a DeviceFeeder, with 1 and 2 batches in flight
// in nvJPEG. Each pass reads the folder once; the first warms the cache.
//   loader_bench --gpu-folder DIR [--batch B] [--max-workers W] [--jpeg-size S]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include <torch/torch.h>

#include "ddp/app.h"
#include "ddp/cmd/shards.h"
#include "ddp/data/counter_rng.h"
#include "ddp/data/device_feeder.h"
#include "ddp/data/gpu_images.h"
#include "ddp/data/idx.h"
#include "ddp/data/image_codec.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/loader.h"
#include "ddp/data/shards.h"

namespace fs = std::filesystem;
using namespace ddp::data;

namespace {

struct Args {
  std::string dir = (fs::temp_directory_path() / "ddp_loader_bench").string();
  int64_t jpegs = 2000, fmnist = 10000, batch = 64, jpeg_size = 224, fmnist_size = 28;
  int64_t large_jpegs = 200, large_width = 2000, large_height = 1500;
  int64_t max_workers = std::max(1u, std::thread::hardware_concurrency());
  int intra_op_threads = 1;
  std::string gpu_folder;
  std::string shards_from;
  int64_t shuffle_buffer = 1000;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "loader_bench: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--dir") a.dir = value();
    else if (k == "--jpegs") a.jpegs = std::stoll(value());
    else if (k == "--fmnist") a.fmnist = std::stoll(value());
    else if (k == "--large-jpegs") a.large_jpegs = std::stoll(value());
    else if (k == "--large-size") {
      const std::string v = value();
      const auto x = v.find('x');
      if (x == std::string::npos) {
        std::fprintf(stderr, "loader_bench: --large-size wants WIDTHxHEIGHT, e.g. 2000x1500, got '%s'\n", v.c_str());
        std::exit(2);
      }
      a.large_width = std::stoll(v.substr(0, x));
      a.large_height = std::stoll(v.substr(x + 1));
    }
    else if (k == "--batch") a.batch = std::stoll(value());
    else if (k == "--jpeg-size") a.jpeg_size = std::stoll(value());
    else if (k == "--fmnist-size") a.fmnist_size = std::stoll(value());
    else if (k == "--max-workers") a.max_workers = std::stoll(value());
    else if (k == "--intra-op-threads") a.intra_op_threads = std::stoi(value());
    else if (k == "--gpu-folder") a.gpu_folder = value();
    else if (k == "--shards-from") a.shards_from = value();
    else if (k == "--shuffle-buffer") a.shuffle_buffer = std::stoll(value());
    else {
      std::fprintf(stderr,
                   "usage: loader_bench [--dir D] [--jpegs N] [--fmnist N] [--large-jpegs N] [--large-size WxH] "
                   "[--batch B] [--jpeg-size S] [--fmnist-size S] [--max-workers W] [--intra-op-threads T]\n"
                   "       loader_bench --gpu-folder DIR [--batch B] [--max-workers W] [--jpeg-size S]\n");
      std::exit(k == "-h" || k == "--help" ? 0 : 2);
    }
  }
  return a;
}

void mark_complete(const std::string& dir) { std::ofstream(dir + "/complete") << "ok\n"; }
bool is_complete(const std::string& dir) { return fs::exists(dir + "/complete"); }

// A photo-like image: a few smooth colour gradients, a texture and noise,
// so that it compresses like a photograph rather than a flat colour. Of
// 256..384 px a side, or h x w when given.
torch::Tensor photo_like(int64_t index, int64_t h = 0, int64_t w = 0) {
  KeyedRandom rng(hash_words({0x62656e63, static_cast<uint64_t>(index)}));
  const int64_t drawn_h = 256 + rng.below(129), drawn_w = 256 + rng.below(129);
  if (h <= 0 || w <= 0) {
    h = drawn_h;
    w = drawn_w;
  }
  auto y = torch::linspace(0, 1, h).view({h, 1, 1});
  auto x = torch::linspace(0, 1, w).view({1, w, 1});
  std::vector<torch::Tensor> channels;
  for (int c = 0; c < 3; ++c) {
    const double a = rng.uniform(-1, 1), b = rng.uniform(-1, 1), f = rng.uniform(4, 20), p = rng.uniform(0, 6.3);
    channels.push_back(128 + 60 * (a * y + b * x) + 40 * torch::sin(f * (x + y * rng.uniform(0.2, 1.5)) + p));
  }
  auto img = torch::cat(channels, 2) + 12 * torch::randn({h, w, 3});
  return img.clamp(0, 255).to(torch::kByte).contiguous();
}

// Writes `count` JPEGs of h x w (0 x 0: of 256..384 px a side) in dir
// once; "" when count is 0.
std::string make_jpeg_folder(const std::string& dir, int64_t count, int64_t h = 0, int64_t w = 0) {
  if (count <= 0) return "";
  if (is_complete(dir)) return dir;
  std::printf("generating %lld JPEGs in %s ...\n", static_cast<long long>(count), dir.c_str());
  torch::manual_seed(0);
  for (int64_t i = 0; i < count; ++i) {
    const std::string cls = dir + "/class" + std::to_string(i % 10);
    fs::create_directories(cls);
    write_jpeg(cls + "/" + std::to_string(i) + ".jpg", photo_like(i, h, w), 90);
  }
  mark_complete(dir);
  return dir;
}

// "" when Fashion-MNIST is not installed.
std::string make_fmnist_folder(const Args& a) {
  const std::string dir = a.dir + "/fmnist-png";
  if (a.fmnist <= 0) return "";
  if (is_complete(dir)) return dir;
  if (!fs::exists(std::string(kFashionMnistRoot) + "/train-images-idx3-ubyte.gz")) {
    std::printf("Fashion-MNIST not found in %s: skipping the PNG folder\n", kFashionMnistRoot);
    return "";
  }
  std::printf("writing %lld Fashion-MNIST PNGs in %s ...\n", static_cast<long long>(a.fmnist), dir.c_str());
  auto images = read_idx_images(std::string(kFashionMnistRoot) + "/train-images-idx3-ubyte.gz");
  auto labels = read_idx_labels(std::string(kFashionMnistRoot) + "/train-labels-idx1-ubyte.gz");
  const int64_t n = std::min(a.fmnist, images.size(0));
  for (int64_t i = 0; i < n; ++i) {
    const std::string cls = dir + "/" + std::to_string(labels[i].item<int64_t>());
    fs::create_directories(cls);
    write_png(cls + "/" + std::to_string(i) + ".png", images[i].permute({1, 2, 0}).contiguous());
  }
  mark_complete(dir);
  return dir;
}

// The process's CPU time so far (every thread, user and system), seconds.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

struct Pass {
  double per_second = 0;       // images out of the loader per wall-clock second
  double cpu_ms_per_image = 0; // CPU time the pass took per image, all threads
  double first_ms = 0;         // until the first batch (a shard stream's shuffle buffer fills first)
};

Pass loader_pass(const DatasetPtr& data, const std::vector<int64_t>& order, int64_t batch, int64_t workers,
                 int64_t epoch = 0) {
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_seconds();
  Loader loader(data, order,
                LoaderOptions(batch).workers(workers).prefetch(std::max<int64_t>(2, 2 * workers)).seed(1).epoch(epoch));
  int64_t seen = 0;
  double first = 0;
  while (auto b = loader.next()) {
    if (seen == 0) first = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    seen += b->batch_size();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto n = static_cast<double>(seen);
  return {n / s, 1e3 * (cpu_seconds() - c0) / n, 1e3 * first};
}

double images_per_second(const DatasetPtr& data, const std::vector<int64_t>& order, int64_t batch, int64_t workers) {
  return loader_pass(data, order, batch, workers).per_second;
}

void bench(const std::string& name, const std::string& root, int64_t size, const Args& a, bool scaled_decode = true) {
  auto data = std::make_shared<ImageFolderDataset>(
      scan_image_folder(root),
      ImageFolderOptions().transform(ImageTransformOptions().size(size)).scaled_jpeg_decode(scaled_decode), name);
  // A fixed shuffled order, as a DistributedSampler would give one rank.
  std::vector<int64_t> order(static_cast<size_t>(data->size()));
  KeyedRandom rng(7);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
  images_per_second(data, order, a.batch, 1);  // warm the page cache
  std::vector<int64_t> counts{0};
  for (int64_t w = 1; w <= a.max_workers; w *= 2) counts.push_back(w);
  if (counts.back() != a.max_workers) counts.push_back(a.max_workers);
  double one = 0;
  for (int64_t w : counts) {
    const double rate = images_per_second(data, order, a.batch, w);
    if (w == 1) one = rate;
    std::printf("| %s | %lld | %s | %lld | %.0f | %s |\n", name.c_str(), static_cast<long long>(data->size()),
                (std::to_string(size) + " px").c_str(), static_cast<long long>(w), rate,
                w >= 1 && one > 0 ? (std::to_string(rate / one).substr(0, 4) + "x").c_str() : "-");
    std::fflush(stdout);
  }
}

// --shards-from: the folder and its shards, loader only, worker by worker.
int shards_bench(const Args& a) {
  const std::string out = a.dir + "/shards-of-" + fs::path(a.shards_from).lexically_normal().filename().string();
  if (!is_complete(out)) {
    fs::remove_all(out);
    fs::create_directories(out);
    ddp::ShardWriteOptions o;
    o.source = a.shards_from;
    o.out = out + "/s";
    ddp::write_shards(o);
    mark_complete(out);
  }
  std::vector<std::string> paths;
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().extension() == ".tar") paths.push_back(e.path().string());
  std::sort(paths.begin(), paths.end());
  const auto transform = ImageTransformOptions().size(a.jpeg_size);
  auto folder = std::make_shared<ImageFolderDataset>(scan_image_folder(a.shards_from),
                                                     ImageFolderOptions().transform(transform), "folder");
  auto shards = std::make_shared<ShardDataset>(scan_image_shards(paths), ShardDatasetOptions().transform(transform), "shards");
  std::vector<int64_t> order(static_cast<size_t>(folder->size()));
  KeyedRandom rng(7);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
  // Epochs follow one another as in training (each shard stream's next
  // epoch starts reading once the last one's samples are read), 100 ms
  // apart, where training would validate.
  int64_t epoch = 0;
  auto stream = [&] {
    return shards->epoch_order(
        StreamOrderOptions().seed(1).epoch(epoch).streams(1).shuffle_buffer(a.shuffle_buffer).next_epoch_follows(true), 0);
  };
  // Images/s follow the machine's other load; CPU time per image much less
  // so, and on a machine whose cores are all busy decoding it is what
  // decides images/s.
  std::printf("\nimage folder vs tar shards (%zu shards) of %s: batch %lld, %lld px training transform, %u hardware "
              "threads; images/s (best of three) and CPU ms per image, all threads (least of three)\n\n"
              "| workers | folder img/s | shards img/s | shards / folder | folder CPU ms | shards CPU ms | shards / folder "
              "| folder first batch ms | shards first batch ms |\n|---|---|---|---|---|---|---|---|---|\n",
              paths.size(), a.shards_from.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.jpeg_size),
              std::thread::hardware_concurrency());
  images_per_second(folder, order, a.batch, 1);  // the page cache
  images_per_second(shards, stream(), a.batch, 1);  // epoch 0
  for (int64_t w = 0; w <= a.max_workers; w = w ? 2 * w : 1) {
    // The best of three passes each, taken in turn: on a shared machine the
    // other load comes and goes.
    double f = 0, s = 0, fc = 1e30, sc = 1e30, ff = 1e30, sf = 1e30;
    for (int pass = 0; pass < 3; ++pass) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const Pass fp = loader_pass(folder, order, a.batch, w);
      ++epoch;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const Pass sp = loader_pass(shards, stream(), a.batch, w, epoch);
      f = std::max(f, fp.per_second);
      s = std::max(s, sp.per_second);
      fc = std::min(fc, fp.cpu_ms_per_image);
      sc = std::min(sc, sp.cpu_ms_per_image);
      ff = std::min(ff, fp.first_ms);
      sf = std::min(sf, sp.first_ms);
    }
    std::printf("| %lld | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f |\n", static_cast<long long>(w), f, s,
                s / f, fc, sc, sc / fc, ff, sf);
    std::fflush(stdout);
  }
  return 0;
}

// The GPU decode path on `root`: images/s out of the loader alone, and out
// of the loader plus the device stage, each over one pass of the folder in
// a fixed shuffled order, batch a.batch, a.max_workers loader threads.
int gpu_bench(const Args& a) {
  if (!gpu_jpeg_available()) {
    std::fprintf(stderr, "loader_bench: --gpu-folder needs a CUDA build with nvJPEG and a GPU\n");
    return 2;
  }
  const torch::Device device(torch::kCUDA, 0);
  std::printf("\nGPU decode path: %s, batch %lld, %lld loader threads, %lld px crops; images/s over one pass\n\n",
              a.gpu_folder.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.max_workers),
              static_cast<long long>(a.jpeg_size));
  std::printf("| what | in flight | images | s | images/s | first batch ms |\n|---|---|---|---|---|---|\n");
  const auto files = scan_image_folder(a.gpu_folder);
  struct Pass {
    bool stage;
    int64_t in_flight;
  };
  // The first pass warms the page cache and is not reported.
  const std::vector<Pass> passes{{false, 2}, {false, 2}, {true, 1}, {true, 2}};
  for (size_t pass = 0; pass < passes.size(); ++pass) {
    const bool stage = passes[pass].stage;
    const int64_t in_flight = passes[pass].in_flight;
    auto data = std::make_shared<ImageFolderDataset>(
        files,
        ImageFolderOptions()
            .transform(ImageTransformOptions().size(a.jpeg_size))
            .gpu_decode(true)
            .cpu_decode_share(0)  // nvJPEG decodes every file
            .gpu_decode_in_flight(in_flight),
        "gpu bench");
    std::vector<int64_t> order(static_cast<size_t>(data->size()));
    KeyedRandom rng(7 + pass);
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
    const auto t0 = std::chrono::steady_clock::now();
    double first_ms = 0;
    int64_t seen = 0;
    Loader loader(data, order,
                  LoaderOptions(a.batch).workers(a.max_workers).prefetch(2 * a.max_workers).pin_memory(true).seed(1));
    auto note_first = [&] {
      if (seen == 0) first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    if (stage) {
      DeviceFeeder feeder(loader, device, nullptr, data->device_stage());
      while (auto b = feeder.next()) {
        note_first();
        seen += b->batch_size();
      }
      torch::cuda::synchronize();
    } else {
      while (auto b = loader.next()) {
        note_first();
        seen += b->target().size(0);  // an encoded batch has no "input"
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (pass == 0) continue;  // the page cache's pass
    std::printf("| %s | %s | %lld | %.2f | %.0f | %.1f |\n", stage ? "loader + nvJPEG stage" : "loader only (bytes)",
                stage ? std::to_string(in_flight).c_str() : "-", static_cast<long long>(seen), s,
                static_cast<double>(seen) / s, first_ms);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::keep_freed_memory_in_heap();  // as ddptrain: a freed 36 MB image stays mapped for the next one
  const Args a = parse(argc, argv);
  torch::set_num_threads(a.intra_op_threads);
  if (!a.gpu_folder.empty()) return gpu_bench(a);
  if (!a.shards_from.empty()) return shards_bench(a);
  fs::create_directories(a.dir);
  const std::string fmnist = make_fmnist_folder(a);
  const std::string jpeg = make_jpeg_folder(a.dir + "/jpeg", a.jpegs);
  const std::string large_name = std::to_string(a.large_width) + "x" + std::to_string(a.large_height);
  const std::string large = make_jpeg_folder(a.dir + "/jpeg-" + large_name, a.large_jpegs, a.large_height, a.large_width);
  std::printf("\nloader images/s: batch %lld, training transform (random-resized crop + flip), %d intra-op "
              "thread(s), %u hardware threads; workers 0 = decode on the calling thread\n\n",
              static_cast<long long>(a.batch), a.intra_op_threads, std::thread::hardware_concurrency());
  std::printf("| folder | images | output | workers | images/s | vs 1 worker |\n|---|---|---|---|---|---|\n");
  if (!fmnist.empty()) bench("Fashion-MNIST PNG 28 px gray", fmnist, a.fmnist_size, a);
  if (!jpeg.empty()) bench("synthetic JPEG 256-384 px", jpeg, a.jpeg_size, a);
  if (!large.empty()) {
    bench("synthetic JPEG " + large_name + ", full-size decode", large, a.jpeg_size, a, false);
    bench("synthetic JPEG " + large_name + ", scaled decode", large, a.jpeg_size, a, true);
  }
  return 0;
}
