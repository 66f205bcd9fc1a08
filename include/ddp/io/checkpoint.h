// Checkpoints: the whole training state, written so that a crash never
// leaves a broken file behind.
//
// A checkpoint holds the model's parameters and buffers, the optimizer
// state, the counters (epoch, step, the best monitor value), the CPU (and CUDA)
// random state and a JSON header with a format version, the architecture
// and the config. It is a torch.save zip of one flat dict of tensors,
// written and read by torch_pickle.h's bounded reader and writer: no file a
// user names goes through TorchScript's loader, which PyTorch documents as
// unsafe for untrusted input, and Python opens a checkpoint with
// torch.load(path, weights_only=True). It is written to a temporary file,
// fsync'ed and renamed over the target: a kill at any moment leaves either
// the old file or the new one, never half, and a failed write (a full disk)
// is an error that leaves the old one in place.
#pragma once

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace ddp {

// 2: flat optimizer state; 3: a torch.save zip instead of a TorchScript
// archive (format 2 and older are refused, never opened).
constexpr int kCheckpointFormat = 3;

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
  // The task's logged sums (StepOutput.logs) over all ranks so far in an
  // interrupted epoch, by name, for the same reason.
  std::map<std::string, double> epoch_log_sums;
  // --patience: the best monitor value by its rule (--min-delta), and the
  // validations since it improved (early_stopping.h).
  double patience_best = std::numeric_limits<double>::quiet_NaN();
  int64_t patience_wait = 0;
  // The monitor's value at the validation a top-k checkpoint was saved
  // after (NaN in the others): what ranks it among the best K.
  double monitored = std::numeric_limits<double>::quiet_NaN();
};

struct CheckpointMeta {
  TrainState state;
  std::string arch;         // e.g. "resnet18/small/1x28x28/10"
  nlohmann::json config;
  int world_size = 0;       // ranks of the run that wrote it (0: not recorded)
  nlohmann::json data = nullptr;  // what identifies its data (data/identity.h); null: not recorded
};

/// Named tensors: a part's state inside a checkpoint.
using TensorMap = std::map<std::string, torch::Tensor>;

/// Training state saved beside the model: the optimizer and the loss scaler.
/// load() gets the tensors that save() wrote, on the CPU.
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual void save(TensorMap& state) const = 0;
  virtual void load(const TensorMap& state) = 0;
};

/// Text kept in a checkpoint as a uint8 tensor of its bytes, and back
/// (UserError if `t` is not such a tensor).
torch::Tensor string_tensor(const std::string& s);
std::string tensor_string(const torch::Tensor& t);

/// Writes atomically; throws UserError if the directory is not writable.
void save_checkpoint(const std::string& path, const torch::nn::Module& model,
                     const Stateful* optimizer, const CheckpointMeta& meta);

/// Reads a checkpoint into `model` (and `optimizer` if given), placing
/// tensors on `device`. Throws UserError naming the file for a missing,
/// corrupt, wrong-version or wrong-architecture checkpoint.
CheckpointMeta load_checkpoint(const std::string& path, torch::nn::Module& model,
                               Stateful* optimizer, const torch::Device& device,
                               const std::string& expected_arch);

/// The header of a checkpoint (its counters, architecture, config and world
/// size) without loading its tensors into a model. UserError as load_checkpoint.
CheckpointMeta read_checkpoint_meta(const std::string& path);

/// The checkpoint that --resume `resume` names: "" for no resume; for
/// "auto", the newest under `save_path` ("" when there is none: a fresh
/// start, as after torchrun's first launch); for a run directory, the
/// newest in it; else the file itself. UserError when a directory holds no
/// checkpoint or the file does not exist.
std::string resume_checkpoint(const std::string& resume, const std::string& save_path);

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

/// Loads every weight of the model a checkpoint's header names (generate,
/// export): the same match as load_pretrained with nothing skipped, whose
/// failure means a damaged file, and says so. From a run with --ema, the
/// parameters are their averages (as export_weights and load_pretrained
/// read them too), the buffers the live ones (train/ema.h says why).
void load_model_weights(const std::string& path, torch::nn::Module& model, const torch::Device& device);

/// Writes the model's parameters and buffers as a PyTorch state_dict file
/// (see torch_pickle.h): in Python, torch.load(path, weights_only=True)
/// gives an OrderedDict of tensors that load_state_dict() accepts (e.g.
/// torchvision's resnet18 for ddptrain's). Written atomically.
void export_state_dict(const torch::nn::Module& model, const std::string& path);

/// The same for the weights in a ddptrain checkpoint (or a state_dict file).
/// Refuses (UserError) to write over a checkpoint: check_output_is_no_checkpoint.
void export_weights(const std::string& checkpoint, const std::string& path);

/// Throws UserError if `out` exists and is the file `input` or any ddptrain
/// checkpoint: a command that writes `out` would destroy it. Other files may
/// be written over, as torch.save would.
void check_output_is_no_checkpoint(const std::string& out, const std::string& input);

/// True if `path` opens as a ddptrain checkpoint: a format header, and every
/// record whole (its CRC checked). read_checkpoint_meta reads the header only.
bool is_checkpoint(const std::string& path);

/// The newest complete checkpoint (epoch_*.pt, preempt.pt) under `dir` and
/// its run subdirectories, or "" when there is none. Folders of abandoned
/// branches (abandoned-*, see set_aside_later_checkpoints) are not searched.
/// The run written to last is the one (by file times), and in it the
/// checkpoint furthest along (by the step in its header). Throws UserError,
/// naming the file and why, when a file of that run that cannot be read may
/// be further along than the one chosen (a later epoch, a preempt.pt, a
/// newer file), or when that run has no readable one: never a silent step
/// back, nor into another run.
std::string find_latest_checkpoint(const std::string& dir);

/// The prefix of the folder in a run directory that holds an abandoned
/// branch's checkpoints.
constexpr const char* kAbandonedPrefix = "abandoned-";

/// A run resumed from an older checkpoint of its directory starts a new
/// branch there. The checkpoints (any *.pt with a ddptrain header) directly in
/// `dir` that are further along than `step` belong to the branch it leaves:
/// they move into a new folder `dir`/abandoned-`stamp`, with a copy of the
/// metrics logs as they were, so that nothing of that branch is lost and
/// neither --keep-last nor --resume confuses it with the live one. A file
/// that cannot be read goes too when the run would write its name again (an
/// epoch_N.pt past `epoch`, preempt.pt, best.pt): its name is added to
/// `unreadable`. Returns the folder, or "" when nothing was further along
/// (the usual resume).
std::string set_aside_later_checkpoints(const std::string& dir, int64_t step, int64_t epoch, const std::string& stamp,
                                        std::vector<std::string>* unreadable = nullptr);

/// Creates a new run directory `save_path`/`stem` (`stem`_1, `stem`_2...
/// when that exists, e.g. another job started in the same second) and
/// returns it. Throws UserError when --save_path is not writable.
std::string make_run_dir(const std::string& save_path, const std::string& stem);

/// The run directory that a resumed checkpoint continues in: its directory,
/// "." for a bare file name.
std::string run_dir_of(const std::string& checkpoint);

/// N for a file named epoch_N.pt (N decimal digits); nothing for any other
/// name, so that stray files never stop a run.
std::optional<int64_t> epoch_of(const std::string& filename);

/// Removes all but the newest `keep` epoch_N.pt files in `dir` (--keep-last)
/// among those of epochs up to `up_to_epoch`, the one just saved: a file of a
/// later epoch is never this branch's to prune (set_aside_later_checkpoints).
void remove_old_checkpoints(const std::string& dir, int64_t keep,
                            int64_t up_to_epoch = std::numeric_limits<int64_t>::max());

/// Removes `dir`/preempt.pt once a checkpoint at `step` supersedes it (its
/// own step is not past `step`): a resume goes on from the later one, and the
/// stop's file would only mislead (report, a reader of the directory).
void remove_superseded_preempt(const std::string& dir, int64_t step);

/// Removes the temporary files (<name>.tmp.<pid>.<host>, and older builds'
/// <name>.tmp.<pid>) in `dir` that a writer killed mid-write left: only those
/// whose process is dead on this host. A live process's, or one of another
/// host (whose pid says nothing here), stays.
void remove_stale_temp_files(const std::string& dir);

/// The file in a run directory that its job locks (RunDirLock).
constexpr const char* kRunLockFile = "run.lock";

/// Rank 0's hold on its run directory, from when the job owns it until the
/// job ends: an exclusive flock on `dir`/run.lock, whose text names the
/// holder ("pid host"). The kernel releases it when the process ends in any
/// way (a crash, SIGKILL), so no lock outlives its job on a local disk (a
/// network file system may keep a dead host's lock until its lease ends;
/// the refusal then says to remove the file). Throws UserError
/// naming the directory and the holder when another process holds it. On a
/// file system without locks it says so on stderr and holds nothing.
class RunDirLock {
 public:
  RunDirLock() = default;
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(RunDirLock&& other) noexcept;
  RunDirLock& operator=(RunDirLock&& other) noexcept;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

/// Writes `text` to `path` atomically (temp file, fsync, rename).
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace ddp
