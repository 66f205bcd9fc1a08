// Atomic checkpoint files with a versioned header.
#include "ddp/io/checkpoint.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cerrno>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "ddp/error.h"
#include "ddp/io/torch_pickle.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Moves tmp over path, then makes the rename itself durable.
void commit(const std::string& tmp, const std::string& path) {
  fsync_path(tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw UserError("cannot write " + path + ": " + why + ".", "check that --save_path is writable and has space.");
  }
  fsync_path(fs::path(path).parent_path().string());
}

std::string tmp_name(const std::string& path) { return path + ".tmp." + std::to_string(::getpid()); }

}  // namespace

void write_file_atomic(const std::string& path, const std::string& text) {
  const auto tmp = tmp_name(path);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    check_user(static_cast<bool>(f), "cannot write " + path + ": " + std::strerror(errno) + ".",
               "check that --save_path is writable.");
    f << text;
  }
  commit(tmp, path);
}

void save_checkpoint(const std::string& path, const torch::nn::Module& model,
                     const Stateful* optimizer, const CheckpointMeta& meta) {
  torch::serialize::OutputArchive archive;
  nlohmann::json header = {{"format", kCheckpointFormat}, {"arch", meta.arch},
                           {"epoch", meta.state.epoch},   {"step", meta.state.step},
                           {"best", std::isnan(meta.state.best) ? nlohmann::json() : nlohmann::json(meta.state.best)}, {"config", meta.config},
                           {"batch_in_epoch", meta.state.batch_in_epoch},
                           {"epoch_loss_sum", meta.state.epoch_loss_sum},
                           {"epoch_loss_count", meta.state.epoch_loss_count}};
  archive.write("ddptrain", c10::IValue(header.dump()));
  torch::serialize::OutputArchive model_archive;
  for (const auto& p : model.named_parameters()) model_archive.write(p.key(), p.value().detach().cpu());
  for (const auto& b : model.named_buffers()) model_archive.write(b.key(), b.value().detach().cpu(), true);
  archive.write("model", model_archive);
  if (optimizer) {
    torch::serialize::OutputArchive opt_archive;
    optimizer->save(opt_archive);
    archive.write("optimizer", opt_archive);
  }
  archive.write("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
  // The CUDA generator of the model's GPU (dropout and other random ops on
  // the device draw from it).
  const auto params = model.parameters();
  if (!params.empty() && params.front().is_cuda())
    archive.write("rng/cuda", at::globalContext().defaultGenerator(params.front().device()).get_state());
  const auto tmp = tmp_name(path);
  try {
    archive.save_to(tmp);
  } catch (const std::exception& e) {
    std::remove(tmp.c_str());
    throw UserError("cannot write checkpoint " + path + ".", "check that --save_path is writable and has space.");
  }
  commit(tmp, path);
}

bool is_checkpoint(const std::string& path) {
  try {
    torch::serialize::InputArchive a;
    a.load_from(path);
    c10::IValue v;
    return a.try_read("ddptrain", v);
  } catch (const std::exception&) {
    return false;
  }
}

CheckpointMeta load_checkpoint(const std::string& path, torch::nn::Module& model,
                               Stateful* optimizer, const torch::Device& device,
                               const std::string& expected_arch) {
  check_user(fs::exists(path), "checkpoint " + path + " does not exist.", "check the path given to --resume/--pretrain.");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path, device);
  } catch (const std::exception&) {
    throw UserError("checkpoint " + path + " is corrupt or not a ddptrain/LibTorch file.",
                    "use another checkpoint (the previous epoch's, or best.pt).");
  }
  c10::IValue hv;
  check_user(archive.try_read("ddptrain", hv), "checkpoint " + path + " has no ddptrain header.",
             "it was not written by ddptrain; pass PyTorch weights with --pretrain instead.");
  CheckpointMeta meta;
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(hv.toStringRef());
  } catch (const std::exception&) {
    throw UserError("checkpoint " + path + " has a damaged header.", "use another checkpoint.");
  }
  const int format = h.value("format", 0);
  check_user(format == kCheckpointFormat,
             "checkpoint " + path + " has format version " + std::to_string(format) + "; this ddptrain reads version " +
                 std::to_string(kCheckpointFormat) + ".",
             "load it with the ddptrain version that wrote it, or start without --resume.");
  meta.arch = h.value("arch", "");
  check_user(expected_arch.empty() || meta.arch == expected_arch,
             "checkpoint " + path + " is for model '" + meta.arch + "', but this run builds '" + expected_arch + "'.",
             "pass the same --model/--stem/data as the run that wrote it.");
  meta.state.epoch = h.value("epoch", 0);
  meta.state.step = h.value("step", 0);
  // "best" is null before the first validation; "best_acc" in format 2.
  const auto best = h.contains("best") ? h["best"] : h.value("best_acc", nlohmann::json());
  meta.state.best = best.is_number() ? best.get<double>() : std::numeric_limits<double>::quiet_NaN();
  meta.state.batch_in_epoch = h.value("batch_in_epoch", int64_t{0});
  meta.state.epoch_loss_sum = h.value("epoch_loss_sum", 0.0);
  meta.state.epoch_loss_count = h.value("epoch_loss_count", 0.0);
  meta.config = h.value("config", nlohmann::json::object());

  torch::serialize::InputArchive model_archive;
  archive.read("model", model_archive);
  torch::NoGradGuard no_grad;
  auto load_into = [&](const std::string& name, torch::Tensor& dst, bool buffer) {
    torch::Tensor src;
    check_user(model_archive.try_read(name, src, buffer), "checkpoint " + path + " lacks '" + name + "'.",
               "it was written for a different model.");
    check_user(src.sizes() == dst.sizes(),
               "checkpoint " + path + ": '" + name + "' has shape " + c10::str(src.sizes()) + ", the model expects " +
                   c10::str(dst.sizes()) + ".",
               "pass the same --model/--stem/data as the run that wrote it.");
    dst.copy_(src.to(dst.device()));
  };
  for (auto& p : model.named_parameters()) load_into(p.key(), p.value(), false);
  for (auto& b : model.named_buffers()) load_into(b.key(), b.value(), true);
  if (optimizer) {
    torch::serialize::InputArchive opt_archive;
    // The archive was mapped to `device`, so optimizer state lands next to
    // the parameters on every rank (never all on GPU 0).
    if (archive.try_read("optimizer", opt_archive)) optimizer->load(opt_archive);
  }
  torch::Tensor rng;
  if (archive.try_read("rng/cpu", rng)) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(rng.cpu());
  }
  if (device.is_cuda() && archive.try_read("rng/cuda", rng)) {
    at::Generator gen = at::globalContext().defaultGenerator(device);  // a handle to the device's generator
    gen.set_state(rng.cpu());
  }
  return meta;
}

namespace {

std::string strip_prefixes(std::string name) {
  for (bool again = true; again;) {
    again = false;
    for (const char* p : {"module.", "_orig_mod."}) {
      if (name.rfind(p, 0) == 0) {
        name = name.substr(std::strlen(p));
        again = true;
      }
    }
  }
  return name;
}

// True if the file starts like a zip archive, as torch.save's files do
// since PyTorch 1.6.
bool is_zip(const std::string& path) {
  char magic[4] = {};
  std::ifstream(path, std::ios::binary).read(magic, sizeof magic);
  return std::memcmp(magic, "PK\x03\x04", sizeof magic) == 0;
}

// name -> tensor from either file kind, in the file's order.
NamedTensors read_weights(const std::string& path) {
  NamedTensors out;
  if (is_checkpoint(path)) {
    torch::serialize::InputArchive archive, model;
    archive.load_from(path, torch::kCPU);
    archive.read("model", model);
    for (const auto& key : model.keys()) {
      torch::Tensor t;
      if (model.try_read(key, t, false) || model.try_read(key, t, true)) out.emplace_back(key, t);
    }
    return out;
  }
  check_user(is_zip(path),
             "--pretrain " + path + " is neither a ddptrain checkpoint nor a PyTorch state_dict file (not a zip archive).",
             "save weights in Python with torch.save(model.state_dict(), path) (PyTorch 1.6 or later).");
  out = read_state_dict(path);
  for (auto& named : out) named.first = strip_prefixes(named.first);
  return out;
}

}  // namespace

void export_state_dict(const torch::nn::Module& model, const std::string& path) {
  NamedTensors named;
  for (const auto& p : model.named_parameters()) named.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers()) named.emplace_back(b.key(), b.value());
  write_state_dict(path, named);
}

void export_weights(const std::string& checkpoint, const std::string& path) {
  check_user(fs::exists(checkpoint), "checkpoint " + checkpoint + " does not exist.", "pass a file such as <run>/best.pt.");
  write_state_dict(path, read_weights(checkpoint));
}

std::string PretrainReport::summary() const {
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 5; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 5) s += ", ... (" + std::to_string(v.size()) + " in all)";
    return s;
  };
  std::string s = std::to_string(loaded.size()) + " tensors loaded";
  if (!skipped.empty()) s += "; skipped: " + list(skipped);
  if (!missing.empty()) s += "; missing: " + list(missing);
  if (!unexpected.empty()) s += "; unexpected: " + list(unexpected);
  if (!mismatched.empty()) s += "; shape mismatch: " + list(mismatched);
  return s;
}

PretrainReport load_pretrained(const std::string& path, torch::nn::Module& model, const torch::Device& device,
                               const std::string& skip) {
  check_user(fs::exists(path), "--pretrain " + path + " does not exist.", "check the path.");
  std::map<std::string, torch::Tensor> weights;
  for (auto& [name, t] : read_weights(path)) weights[name] = t;
  PretrainReport r;
  auto skipped = [&](const std::string& name) { return !skip.empty() && fnmatch(skip.c_str(), name.c_str(), 0) == 0; };
  std::map<std::string, torch::Tensor> targets;
  for (auto& p : model.named_parameters()) targets[p.key()] = p.value();
  for (auto& b : model.named_buffers()) targets[b.key()] = b.value();
  torch::NoGradGuard no_grad;
  for (auto& [name, dst] : targets) {
    if (skipped(name)) { r.skipped.push_back(name); continue; }
    auto it = weights.find(name);
    if (it == weights.end()) { r.missing.push_back(name); continue; }
    if (it->second.sizes() != dst.sizes()) {
      r.mismatched.push_back(name + " " + c10::str(it->second.sizes()) + " vs " + c10::str(dst.sizes()));
      continue;
    }
    r.loaded.push_back(name);
  }
  for (const auto& [name, t] : weights)
    if (!targets.count(name) && !skipped(name)) r.unexpected.push_back(name);
  check_user(r.missing.empty() && r.unexpected.empty() && r.mismatched.empty(),
             "--pretrain " + path + " does not fit the model: " + r.summary() + ".",
             "pass --pretrain-skip 'fc.*' to keep a new head, or the --model/--stem/data that made the weights.");
  for (const auto& name : r.loaded) targets[name].copy_(weights[name].to(device));
  return r;
}

std::string find_latest_checkpoint(const std::string& dir) {
  if (!fs::exists(dir)) return "";
  static const std::regex name(R"((?:epoch_(\d+)|preempt)\.pt)");
  std::string best;
  fs::file_time_type best_time;
  long best_epoch = -1;
  for (const auto& e : fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied)) {
    if (!e.is_regular_file()) continue;
    std::smatch m;
    const std::string fname = e.path().filename().string();
    if (!std::regex_match(fname, m, name)) continue;
    if (!is_checkpoint(e.path().string())) continue;  // skip damaged files
    auto t = e.last_write_time();
    long ep = m[1].matched ? std::stol(m[1]) : 0;
    if (best.empty() || t > best_time || (t == best_time && ep > best_epoch)) {
      best = e.path().string();
      best_time = t;
      best_epoch = ep;
    }
  }
  return best;
}

}  // namespace ddp
