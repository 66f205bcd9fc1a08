// Atomic checkpoint files with a versioned header.
#include "ddp/io/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <sys/stat.h>
#include <fnmatch.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "ddp/error.h"
#include "ddp/io/torch_pickle.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "";
  return host;
}

// <path>.tmp.<pid>.<host>: the host says whose pid it is, so that a start
// cleans only what a dead process of its own host left (remove_stale_temp_files).
std::string tmp_name(const std::string& path) {
  static const std::string host = host_name();
  return path + ".tmp." + std::to_string(::getpid()) + (host.empty() ? "" : "." + host);
}

// Every step of a write can fail with a full or broken disk (ENOSPC, EFBIG,
// EIO), at write() or only at fsync() or close(): each one is checked, so
// that a truncated file is never renamed over a good one.
[[noreturn]] void write_failed(const std::string& path, const std::string& tmp, int err) {
  if (!tmp.empty()) ::unlink(tmp.c_str());
  const bool full = err == ENOSPC || err == EDQUOT || err == EFBIG;
  const bool missing = err == ENOENT || err == ENOTDIR;
  throw UserError("cannot write " + path + ": " + std::strerror(err) + ".",
                  full      ? "free space on that file system, or choose a path on another one."
                  : missing ? "create its directory first, or choose a path in an existing one."
                            : "choose a path that you can write to.");
}

// The rename is durable only once the directory is synced. File systems
// that cannot sync a directory say EINVAL; that is not an error.
void fsync_dir(const std::string& path) {
  std::string dir = fs::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) write_failed(path, "", errno);
  const int err = ::fsync(fd) == 0 || errno == EINVAL ? 0 : errno;
  ::close(fd);
  if (err) write_failed(path, "", err);
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& text) {
  const auto tmp = tmp_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) write_failed(path, "", errno);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      write_failed(path, tmp, err);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    write_failed(path, tmp, err);
  }
  if (::close(fd) != 0) write_failed(path, tmp, errno);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) write_failed(path, tmp, errno);
  fsync_dir(path);
}

namespace {

// The counters, as they appear in the checkpoint's JSON header. New fields
// go here and nowhere else; a missing field reads as its default.
nlohmann::json state_to_json(const TrainState& s) {
  return {{"epoch", s.epoch},
          {"step", s.step},
          {"best", std::isnan(s.best) ? nlohmann::json() : nlohmann::json(s.best)},  // JSON has no NaN
          {"batch_in_epoch", s.batch_in_epoch},
          {"epoch_loss_sum", s.epoch_loss_sum},
          {"epoch_loss_count", s.epoch_loss_count},
          {"epoch_log_sums", s.epoch_log_sums},
          {"patience_best", std::isnan(s.patience_best) ? nlohmann::json() : nlohmann::json(s.patience_best)},
          {"patience_wait", s.patience_wait},
          {"monitored", std::isnan(s.monitored) ? nlohmann::json() : nlohmann::json(s.monitored)}};
}

TrainState state_from_json(const nlohmann::json& j) {
  TrainState s;
  s.epoch = j.value("epoch", s.epoch);
  s.step = j.value("step", s.step);
  const auto best = j.contains("best") ? j["best"] : nlohmann::json();
  if (best.is_number()) s.best = best.get<double>();
  if (j.contains("patience_best") && j["patience_best"].is_number()) s.patience_best = j["patience_best"].get<double>();
  s.patience_wait = j.value("patience_wait", s.patience_wait);
  if (j.contains("monitored") && j["monitored"].is_number()) s.monitored = j["monitored"].get<double>();
  s.batch_in_epoch = j.value("batch_in_epoch", s.batch_in_epoch);
  s.epoch_loss_sum = j.value("epoch_loss_sum", s.epoch_loss_sum);
  s.epoch_loss_count = j.value("epoch_loss_count", s.epoch_loss_count);
  if (j.contains("epoch_log_sums") && j["epoch_log_sums"].is_object())
    for (const auto& [name, v] : j["epoch_log_sums"].items())
      if (v.is_number()) s.epoch_log_sums[name] = v.get<double>();
  return s;
}

// True if the file starts like a zip archive, as torch.save's files do
// since PyTorch 1.6.
bool is_zip(const std::string& path) {
  char magic[4] = {};
  std::ifstream(path, std::ios::binary).read(magic, sizeof magic);
  return std::memcmp(magic, "PK\x03\x04", sizeof magic) == 0;
}

// The name of the JSON header among a checkpoint's tensors.
const char* const kHeader = "ddptrain";

// With header_only, the header entry alone is read (see read_state_dict):
// finding and checking the checkpoint to resume from reads kilobytes of
// each candidate, not its gigabytes.
std::map<std::string, torch::Tensor> read_checkpoint_file(const std::string& path, bool header_only = false) {
  check_user(fs::exists(path), "checkpoint " + path + " does not exist.", "check the path given to --resume/--pretrain.");
  check_user(is_zip(path), "checkpoint " + path + " is corrupt or not a ddptrain file (not a zip archive).",
             "use another checkpoint (the previous epoch's, or best.pt).");
  std::map<std::string, torch::Tensor> out;
  auto header = [](const std::string& name) { return name == kHeader; };
  for (auto& [name, t] : header_only ? read_state_dict(path, header) : read_state_dict(path)) out[name] = t;
  return out;
}

nlohmann::json header_of(const std::string& path, const std::map<std::string, torch::Tensor>& tensors) {
  auto it = tensors.find(kHeader);
  check_user(it != tensors.end(), "checkpoint " + path + " has no ddptrain header.",
             "it was not written by ddptrain; pass PyTorch weights with --pretrain instead.");
  try {
    return nlohmann::json::parse(tensor_string(it->second));
  } catch (const std::exception&) {
    throw UserError("checkpoint " + path + " has a damaged header.", "use another checkpoint.");
  }
}

// The entries under "<prefix>/", with the prefix taken off.
TensorMap under(const std::map<std::string, torch::Tensor>& tensors, const std::string& prefix) {
  TensorMap out;
  for (auto it = tensors.lower_bound(prefix + "/"); it != tensors.end() && it->first.rfind(prefix + "/", 0) == 0; ++it)
    out[it->first.substr(prefix.size() + 1)] = it->second;
  return out;
}

}  // namespace

torch::Tensor string_tensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string tensor_string(const torch::Tensor& t) {
  check_user(t.scalar_type() == torch::kUInt8 && t.dim() == 1, "a text entry of a checkpoint is not a byte tensor.",
             "use another checkpoint.");
  auto c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

void save_checkpoint(const std::string& path, const torch::nn::Module& model,
                     const Stateful* optimizer, const CheckpointMeta& meta) {
  // One flat state_dict in torch.save's format (torch_pickle.h), so that
  // the same bounded reader opens it and Python's torch.load(path,
  // weights_only=True) does too: "ddptrain" (the JSON header as bytes),
  // "model/<name>", "optimizer/<name>" (with --ema also the weights' average,
  // "optimizer/ema/<name>"), "rng/cpu" and "rng/cuda".
  nlohmann::json header = {
      {"format", kCheckpointFormat}, {"arch", meta.arch},         {"state", state_to_json(meta.state)},
      {"config", meta.config},         {"world_size", meta.world_size}};
  if (!meta.data.is_null()) header["data"] = meta.data;
  NamedTensors tensors{{kHeader, string_tensor(header.dump())}};
  for (const auto& p : model.named_parameters()) tensors.emplace_back("model/" + p.key(), p.value());
  for (const auto& b : model.named_buffers()) tensors.emplace_back("model/" + b.key(), b.value());
  if (optimizer) {
    TensorMap state;
    optimizer->save(state);
    for (auto& [name, t] : state) tensors.emplace_back("optimizer/" + name, t);
  }
  tensors.emplace_back("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
  // The CUDA generator of the model's GPU (dropout and other random ops on
  // the device draw from it).
  const auto params = model.parameters();
  if (!params.empty() && params.front().is_cuda())
    tensors.emplace_back("rng/cuda", at::globalContext().defaultGenerator(params.front().device()).get_state());
  write_state_dict(path, tensors);
}

bool is_checkpoint(const std::string& path) {
  try {
    return header_of(path, read_checkpoint_file(path)).value("format", 0) == kCheckpointFormat;  // every record's CRC
  } catch (const std::exception&) {
    return false;
  }
}

namespace {

CheckpointMeta meta_of(const std::string& path, const std::map<std::string, torch::Tensor>& tensors) {
  const auto h = header_of(path, tensors);
  const int format = h.value("format", 0);
  check_user(format == kCheckpointFormat,
             "checkpoint " + path + " has format version " + std::to_string(format) + "; this ddptrain reads version " +
                 std::to_string(kCheckpointFormat) + ".",
             "load it with the ddptrain version that wrote it, or start without --resume.");
  CheckpointMeta meta;
  meta.arch = h.value("arch", "");
  meta.state = state_from_json(h.value("state", nlohmann::json::object()));
  meta.config = h.value("config", nlohmann::json::object());
  meta.world_size = h.value("world_size", 0);
  if (h.contains("data")) meta.data = h["data"];
  return meta;
}

}  // namespace

CheckpointMeta read_checkpoint_meta(const std::string& path) {
  return meta_of(path, read_checkpoint_file(path, /*header_only=*/true));
}

std::string resume_checkpoint(const std::string& resume, const std::string& save_path) {
  if (resume.empty()) return "";
  if (resume == "auto") return find_latest_checkpoint(save_path);
  check_user(fs::exists(resume), "--resume " + resume + " does not exist.",
             "pass a run directory or a checkpoint in it, or --resume auto for the newest under --save_path.");
  if (!fs::is_directory(resume)) return resume;
  const std::string newest = find_latest_checkpoint(resume);
  check_user(!newest.empty(), "--resume " + resume + " holds no checkpoint (epoch_N.pt or preempt.pt).",
             "pass the run directory that ddptrain printed at the end of the run (run dir: ...).");
  return newest;
}

CheckpointMeta load_checkpoint(const std::string& path, torch::nn::Module& model,
                               Stateful* optimizer, const torch::Device& device,
                               const std::string& expected_arch) {
  const auto tensors = read_checkpoint_file(path);
  CheckpointMeta meta = meta_of(path, tensors);
  check_user(expected_arch.empty() || meta.arch == expected_arch,
             "checkpoint " + path + " is for model '" + meta.arch + "', but this run builds '" + expected_arch + "'.",
             "pass the same --model/--stem/data as the run that wrote it.");

  const auto weights = under(tensors, "model");
  torch::NoGradGuard no_grad;
  auto load_into = [&](const std::string& name, torch::Tensor& dst) {
    auto it = weights.find(name);
    check_user(it != weights.end(), "checkpoint " + path + " lacks '" + name + "'.",
               "it was written for a different model.");
    const auto& src = it->second;
    check_user(src.sizes() == dst.sizes(),
               "checkpoint " + path + ": '" + name + "' has shape " + c10::str(src.sizes()) + ", the model expects " +
                   c10::str(dst.sizes()) + ".",
               "pass the same --model/--stem/data as the run that wrote it.");
    dst.copy_(src.to(dst.device()));
  };
  for (auto& p : model.named_parameters()) load_into(p.key(), p.value());
  for (auto& b : model.named_buffers()) load_into(b.key(), b.value());
  // The optimizer copies each state tensor into its own, which lives next
  // to the parameters on every rank (never all on GPU 0).
  if (optimizer) {
    auto state = under(tensors, "optimizer");
    // Before ddptrain recorded the optimizer state's layout, the flat
    // buffers held the writer's memory format: channels-last where its
    // --channels-last resolved on (auto: on a GPU, where the CUDA
    // generator was saved too).
    if (!state.empty() && state.count("layout") == 0) {
      const std::string flag = meta.config.value("channels-last", "auto");
      const bool on = flag == "on" || (flag == "auto" && tensors.count("rng/cuda") > 0);
      state["layout"] = string_tensor(on ? "channels_last" : "contiguous");
    }
    optimizer->load(state);
  }
  auto rng = tensors.find("rng/cpu");
  if (rng != tensors.end()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(rng->second);
  }
  rng = tensors.find("rng/cuda");
  if (device.is_cuda() && rng != tensors.end()) {
    at::Generator gen = at::globalContext().defaultGenerator(device);  // a handle to the device's generator
    gen.set_state(rng->second);
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

// name -> tensor from a checkpoint (its model/ entries) or a state_dict
// file, in the file's order.
NamedTensors read_weights(const std::string& path) {
  check_user(is_zip(path),
             "--pretrain " + path + " is neither a ddptrain checkpoint nor a PyTorch state_dict file (not a zip archive).",
             "save weights in Python with torch.save(model.state_dict(), path) (PyTorch 1.6 or later).");
  NamedTensors all = read_state_dict(path), out;
  const bool checkpoint = std::any_of(all.begin(), all.end(), [](const auto& n) { return n.first == kHeader; });
  // A run with --ema keeps each parameter's average beside it
  // (optimizer/ema/<name>, train/ema.h): the weights that validation judged
  // and best.pt was chosen by, so the ones to export, predict with or
  // start from.
  const std::string kAverage = "optimizer/ema/";
  std::map<std::string, torch::Tensor> averaged;
  for (auto& [name, t] : all)
    if (checkpoint && name.rfind(kAverage, 0) == 0) averaged[name.substr(kAverage.size())] = t;
  for (auto& [name, t] : all) {
    if (!checkpoint) {
      out.emplace_back(strip_prefixes(name), t);
    } else if (name.rfind("model/", 0) == 0) {
      auto average = averaged.find(name.substr(6));
      out.emplace_back(name.substr(6), average != averaged.end() ? average->second : t);
    }
  }
  return out;
}

}  // namespace

void export_state_dict(const torch::nn::Module& model, const std::string& path) {
  NamedTensors named;
  for (const auto& p : model.named_parameters()) named.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers()) named.emplace_back(b.key(), b.value());
  write_state_dict(path, named);
}

void check_output_is_no_checkpoint(const std::string& out, const std::string& input) {
  if (!fs::exists(out)) return;
  std::error_code ec;
  check_user(!fs::equivalent(out, input, ec),
             "the output " + out + " is the checkpoint being read; writing it would destroy that checkpoint.",
             "name another output file, e.g. weights.pt.");
  bool checkpoint = false;
  try {
    checkpoint = header_of(out, read_checkpoint_file(out, /*header_only=*/true)).contains("format");
  } catch (const std::exception&) {
  }
  check_user(!checkpoint, "the output " + out + " is a ddptrain checkpoint; writing over it would lose it.",
             "name another output file, e.g. weights.pt.");
}

void export_weights(const std::string& checkpoint, const std::string& path) {
  check_user(fs::exists(checkpoint), "checkpoint " + checkpoint + " does not exist.", "pass a file such as <run>/best.pt.");
  check_output_is_no_checkpoint(path, checkpoint);
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

namespace {

// The weights of `path` matched against `model` by name and shape (names
// matching the glob `skip` left out); loaded only if `fits` accepts the match.
PretrainReport load_matching(const std::string& path, torch::nn::Module& model, const torch::Device& device,
                             const std::string& skip, const std::function<void(const PretrainReport&)>& fits) {
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
  fits(r);
  for (const auto& name : r.loaded) targets[name].copy_(weights[name].to(device));
  return r;
}

bool complete(const PretrainReport& r) { return r.missing.empty() && r.unexpected.empty() && r.mismatched.empty(); }

}  // namespace

PretrainReport load_pretrained(const std::string& path, torch::nn::Module& model, const torch::Device& device,
                               const std::string& skip) {
  check_user(fs::exists(path), "--pretrain " + path + " does not exist.", "check the path.");
  return load_matching(path, model, device, skip, [&](const PretrainReport& r) {
    check_user(complete(r), "--pretrain " + path + " does not fit the model: " + r.summary() + ".",
               "pass --pretrain-skip 'fc.*' to keep a new head, or the --model/--stem/data that made the weights.");
  });
}

void load_model_weights(const std::string& path, torch::nn::Module& model, const torch::Device& device) {
  check_user(fs::exists(path), "checkpoint " + path + " does not exist.", "check the path.");
  load_matching(path, model, device, "", [&](const PretrainReport& r) {
    check_user(complete(r), "checkpoint " + path + " does not hold the weights of the model it names: " + r.summary() + ".",
               "the file is damaged or was changed after training; use another checkpoint of the run, or train again.");
  });
}

std::string make_run_dir(const std::string& save_path, const std::string& stem) {
  std::error_code ec;
  fs::create_directories(save_path, ec);
  // mkdir is atomic and fails with EEXIST when the name is taken: two jobs
  // that start in the same second cannot both get one directory.
  for (int i = 0;; ++i) {
    const std::string dir = (fs::path(save_path) / (i ? stem + "_" + std::to_string(i) : stem)).string();
    if (::mkdir(dir.c_str(), 0755) == 0) return dir;
    check_user(errno == EEXIST && i < 10000,
               "cannot create the run directory " + dir + ": " + std::strerror(errno) + ".",
               "pass a writable --save_path.");
  }
}

RunDirLock::RunDirLock(const std::string& dir) {
  const std::string path = (fs::path(dir) / kRunLockFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) write_failed(path, "", errno);
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    // Who holds it, for the job that finds it taken: "pid host".
    const std::string me = std::to_string(::getpid()) + " " + host_name() + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
      const int err = errno;
      ::close(fd_);  // the destructor will not run: let the lock go here
      fd_ = -1;
      write_failed(path, "", err);
    }
    return;
  }
  const int err = errno;
  std::string pid, host;
  std::ifstream(path) >> pid >> host;
  ::close(fd_);
  fd_ = -1;
  if (err != EWOULDBLOCK) {  // a file system without locks: the run goes on unguarded, and says so
    std::fprintf(stderr, "note: cannot lock %s (%s); nothing stops another job from writing this run at once\n",
                 path.c_str(), std::strerror(err));
    return;
  }
  throw UserError("the run directory " + dir + " is in use by another job (pid " + (pid.empty() ? "?" : pid) +
                      " on host " + (host.empty() ? "?" : host) + "); two jobs writing one run would mix its files.",
                  "wait for that job to end (or stop it), then resume; to train beside it, start a new run" +
                      (host.empty() || host == host_name()
                           ? std::string(".")
                           : "; if host " + host + " is down (a network file system may keep its lock), remove " +
                                 path + "."));
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

RunDirLock::RunDirLock(RunDirLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

RunDirLock& RunDirLock::operator=(RunDirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

std::string run_dir_of(const std::string& checkpoint) {
  const auto dir = fs::path(checkpoint).parent_path();
  return dir.empty() ? "." : dir.string();
}

std::optional<int64_t> epoch_of(const std::string& name) {
  static const std::regex pattern(R"(epoch_(\d{1,18})\.pt)");  // 18 digits always fit in int64
  std::smatch m;
  if (!std::regex_match(name, m, pattern)) return std::nullopt;
  return std::stoll(m[1]);
}

void remove_old_checkpoints(const std::string& dir, int64_t keep, int64_t up_to_epoch) {
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& e : fs::directory_iterator(dir))
    if (auto epoch = epoch_of(e.path().filename().string()); epoch && *epoch <= up_to_epoch)
      found.emplace_back(*epoch, e.path().string());
  std::sort(found.begin(), found.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < found.size(); ++i) fs::remove(found[i].second);
}

std::string set_aside_later_checkpoints(const std::string& dir, int64_t step, int64_t epoch, const std::string& stamp,
                                        std::vector<std::string>* unreadable) {
  std::vector<fs::path> later;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().extension() != ".pt") continue;
    const std::string name = e.path().filename().string();
    try {
      if (read_checkpoint_meta(e.path().string()).state.step > step) later.push_back(e.path());
    } catch (const std::exception&) {
      // Not a checkpoint (an exported weights.pt), or a damaged one. A
      // damaged file of a name this run would write again (a later epoch's,
      // preempt.pt, best.pt) may be the branch's furthest work: kept with it,
      // never written over.
      const auto n = epoch_of(name);
      if ((n && *n > epoch) || name == "preempt.pt" || name == "best.pt") {
        later.push_back(e.path());
        if (unreadable) unreadable->push_back(name);
      }
    }
  }
  if (later.empty()) return "";
  const std::string aside = make_run_dir(dir, kAbandonedPrefix + stamp);
  // The logs first: the resumed run cuts its copy back to the resume point.
  for (const char* log : {"metrics.jsonl", "metrics.csv"}) {
    std::error_code ec;
    if (fs::exists(fs::path(dir) / log, ec)) fs::copy_file(fs::path(dir) / log, fs::path(aside) / log, ec);
  }
  for (const auto& p : later) {
    std::error_code ec;
    fs::rename(p, fs::path(aside) / p.filename(), ec);  // the same file system: a rename, never a copy
    check_user(!ec, "cannot move " + p.string() + " into " + aside + ": " + ec.message() + ".",
               "make the run directory writable, or resume from its newest checkpoint.");
  }
  fsync_dir(aside + "/x");
  fsync_dir(dir + "/x");
  return aside;
}

void remove_superseded_preempt(const std::string& dir, int64_t step) {
  const std::string path = dir + "/preempt.pt";
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  try {
    if (read_checkpoint_meta(path).state.step > step) return;  // further along: still the place to resume
  } catch (const std::exception&) {
    return;  // damaged: left for the user to look at
  }
  fs::remove(path, ec);
}

void remove_stale_temp_files(const std::string& dir) {
  static const std::regex pattern(R"(.+\.tmp\.(\d{1,9})(\.(.+))?)");
  const std::string here = host_name();
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!e.is_regular_file() || !std::regex_match(name, m, pattern)) continue;
    if (m[2].matched && m[3].str() != here) continue;  // another host's pid
    const auto pid = static_cast<pid_t>(std::stol(m[1]));
    if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask: EPERM)
    fs::remove(e.path(), ec);
  }
}

namespace {

// Why `path` could not be read, from the reader's one-line error without
// the path and the reader's own hint: for a line that names the file once.
std::string unreadable_reason(const std::exception& e, const std::string& path) {
  std::string why = first_line(e);
  why = why.substr(0, why.find(" Hint: "));
  for (const std::string& prefix : {"cannot read " + path + ": ", "checkpoint " + path + " "})
    if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
  while (!why.empty() && why.back() == '.') why.pop_back();
  return why;
}

}  // namespace

std::string find_latest_checkpoint(const std::string& dir) {
  if (!fs::exists(dir)) return "";
  struct Found {
    fs::path path;
    fs::file_time_type time;
    int64_t step, epoch;
    std::string unreadable;  // why, for a damaged (or foreign) file
  };
  std::vector<Found> found;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec)) {
    const auto& e = *it;
    if (e.is_directory() && e.path().filename().string().rfind(kAbandonedPrefix, 0) == 0) {
      it.disable_recursion_pending();  // a branch given up: never where a run goes on
      continue;
    }
    if (!e.is_regular_file()) continue;
    const std::string fname = e.path().filename().string();
    const auto epoch = epoch_of(fname);
    if (!epoch && fname != "preempt.pt") continue;
    // A file another job's pruning removed since the listing is no longer
    // there to count (its time is read without throwing).
    std::error_code time_error;
    const auto time = e.last_write_time(time_error);
    if (time_error) continue;
    try {
      const auto meta = read_checkpoint_meta(e.path().string());
      found.push_back({e.path(), time, meta.state.step, meta.state.epoch, ""});
    } catch (const std::exception& err) {
      if (!fs::exists(e.path(), time_error)) continue;
      // By its name only: a preempt.pt stopped somewhere in an epoch, so it
      // is never known to be behind.
      found.push_back({e.path(), time, -1, epoch.value_or(std::numeric_limits<int64_t>::max()),
                       unreadable_reason(err, e.path().string())});
    }
  }
  if (found.empty()) return "";
  // The run written to last (a directory may hold several runs' folders),
  // then in it the checkpoint furthest along: file times do not say that
  // (a copy or a touch reorders them). A damaged file counts for the run it
  // is in, so that a run whose files are all damaged is never passed over
  // for an older one.
  const auto last = std::max_element(found.begin(), found.end(), [](const Found& x, const Found& y) {
                      return x.time < y.time;
                    })->path.parent_path();
  const Found *best = nullptr, *damaged = nullptr;
  for (const auto& f : found) {
    if (f.path.parent_path() != last || !f.unreadable.empty()) continue;
    if (!best || std::tie(f.step, f.epoch, f.time) > std::tie(best->step, best->epoch, best->time)) best = &f;
  }
  // A damaged file that may be further along than `best` (an epoch_N.pt
  // of a later epoch, a preempt.pt newer than it) is where the run got to,
  // for all anyone knows: resuming `best` would skip its work without a
  // word, and then write over it. An epoch_N.pt goes by its N only (a copy
  // without -t reorders file times); one behind `best` does not matter.
  for (const auto& f : found) {
    if (f.path.parent_path() != last || f.unreadable.empty()) continue;
    const bool is_preempt = f.path.filename() == "preempt.pt";
    const bool may_be_ahead = !best || f.epoch > best->epoch || (is_preempt && f.time > best->time);
    if (may_be_ahead && (!damaged || std::tie(f.epoch, f.time) > std::tie(damaged->epoch, damaged->time))) damaged = &f;
  }
  if (damaged) {
    const std::string file = damaged->path.string();
    if (best)
      throw UserError("checkpoint " + file + " cannot be read (" + damaged->unreadable +
                          ") and may be further along than " + best->path.string() +
                          ", the run's newest readable checkpoint; resuming that would skip it.",
                      "to go on from the readable one, name it: --resume " + best->path.string() +
                          " (the unreadable file then moves into an abandoned-* folder, kept); or move " + file +
                          " out of " + last.string() + ".");
    throw UserError("checkpoint " + file + " cannot be read (" + damaged->unreadable + "), and the run " +
                        last.string() + " holds no readable checkpoint to resume.",
                    "restore the file from a copy; or, to go on with another run, pass --resume with its directory.");
  }
  return best->path.string();
}

}  // namespace ddp
