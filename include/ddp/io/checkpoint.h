// Checkpoints: the whole training state, written so that a crash never
// leaves a broken file behind.
//
// A checkpoint holds the model's parameters and buffers, the optimizer
// state, the counters (epoch, step, best accuracy), the CPU random state and
// a JSON header with a format version, the architecture and the config. It
// is written to a temporary file, fsync'ed and renamed over the target: a
// kill at any moment leaves either the old file or the new one, never half.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace ddp {

constexpr int kCheckpointFormat = 2;  // 2: flat optimizer state

struct TrainState {
  int64_t epoch = 0;    // epochs completed
  int64_t step = 0;     // optimizer steps completed
  // The best value of the task's monitor metric so far (NaN: none yet).
  double best = std::numeric_limits<double>::quiet_NaN();
  // Where an interrupted epoch stopped (all zero when a checkpoint ends an
  // epoch): micro-batches done, and the train-loss sum and count over all
  // ranks so far, so that the resumed epoch reports the same mean.
  int64_t batch_in_epoch = 0;
  double epoch_loss_sum = 0;
  double epoch_loss_count = 0;
};

struct CheckpointMeta {
  TrainState state;
  std::string arch;         // e.g. "resnet18/small/1x28x28/10"
  nlohmann::json config;
};

/// Training state saved beside the model: the optimizer and the loss scaler.
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual void save(torch::serialize::OutputArchive& archive) const = 0;
  virtual void load(torch::serialize::InputArchive& archive) = 0;
};

/// Writes atomically; throws UserError if the directory is not writable.
void save_checkpoint(const std::string& path, const torch::nn::Module& model,
                     const Stateful* optimizer, const CheckpointMeta& meta);

/// Reads a checkpoint into `model` (and `optimizer` if given), placing
/// tensors on `device`. Throws UserError naming the file for a missing,
/// corrupt, wrong-version or wrong-architecture checkpoint.
CheckpointMeta load_checkpoint(const std::string& path, torch::nn::Module& model,
                               Stateful* optimizer, const torch::Device& device,
                               const std::string& expected_arch);

/// What load_pretrained() matched and what it did not.
struct PretrainReport {
  std::vector<std::string> loaded, missing, unexpected, mismatched, skipped;
  std::string summary() const;
};

/// Loads weights into `model` from a ddptrain checkpoint or from a PyTorch
/// `torch.save(model.state_dict())` file, onto `device`. DDP's "module." and
/// torch.compile's "_orig_mod." prefixes are stripped. Names matching the
/// glob `skip` (e.g. "fc.*") are left as initialised. Strict: any missing,
/// unexpected or shape-mismatched name is a UserError listing them.
PretrainReport load_pretrained(const std::string& path, torch::nn::Module& model, const torch::Device& device,
                               const std::string& skip = "");

/// Writes the model's parameters and buffers as a PyTorch state_dict file
/// (see torch_pickle.h): in Python, torch.load(path, weights_only=True)
/// gives an OrderedDict of tensors that load_state_dict() accepts (e.g.
/// torchvision's resnet18 for ddptrain's). Written atomically.
void export_state_dict(const torch::nn::Module& model, const std::string& path);

/// The same for the weights in a ddptrain checkpoint (or a state_dict file).
void export_weights(const std::string& checkpoint, const std::string& path);

/// True if `path` opens as a ddptrain checkpoint (format header present).
bool is_checkpoint(const std::string& path);

/// The newest complete checkpoint (epoch_*.pt) under `dir` and its run
/// subdirectories, or "" when there is none.
std::string find_latest_checkpoint(const std::string& dir);

/// Writes `text` to `path` atomically (temp file, fsync, rename).
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace ddp
