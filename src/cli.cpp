// Flag table, CLI11 wiring, validation and printing of the configuration.
#include "ddp/cli.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <iomanip>
#include <map>
#include <iostream>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <sstream>
#include <type_traits>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/models/recompute.h"
#include "ddp/train/stop_rule.h"

namespace ddp {

bool Config::was_given(const std::string& name) const {
  return std::find(given.begin(), given.end(), name) != given.end();
}

namespace {
std::string key_of(const std::string& names) {
  std::string first = names.substr(0, names.find(','));
  return first.substr(first.find_first_not_of('-'));
}
}  // namespace

std::string Flag::key() const { return key_of(names); }
std::string TaskFlag::key() const { return key_of(names); }

std::vector<Flag> flag_table(Config& c) {
  constexpr OnResume kMayChange = OnResume::kMayChange;  // the rest: OnResume::kSame
  constexpr OnResume kNotRestored = OnResume::kNotRestored;
  constexpr AcrossRanks kPerNode = AcrossRanks::kPerNode;  // the rest: AcrossRanks::kMustAgree
  std::vector<Flag> table = {
      // group "seed": the seed template's flags, unchanged in name and meaning.
      {"--port", "rendezvous port on the master node; default: a free port (single node)", &c.port, {}, "launch", kNotRestored},
      {"--size", "ranks (processes) on this node; 0: one per visible GPU, or 1 CPU rank with every core", &c.size, {}, "launch", kNotRestored},
      {"--visible", "GPUs this node may use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES); empty: all", &c.visible, {}, "launch", kNotRestored, kPerNode},
      {"--address", "address of the master node (node 0)", &c.address, {}, "launch", kNotRestored, kPerNode},
      {"--nnodes", "number of nodes in the job", &c.nnodes, {}, "launch", kNotRestored},
      {"--node-rank,--node_rank", "index of this node, 0 .. nnodes-1", &c.node_rank, {}, "launch", kNotRestored, kPerNode},
      {"--backend", "collective backend", &c.backend, {"auto", "nccl", "gloo"}, "launch", kNotRestored},
      {"--timeout", "seconds any collective may wait before the run fails, naming the rank", &c.timeout, {}, "launch", kNotRestored, kPerNode},
      {"--max-restarts", "restart all workers from the last checkpoint this many times after a failure", &c.max_restarts, {}, "launch", kNotRestored},

      {"--data_root,--data-root", c.program.description.empty() ? "dataset directory: IDX files of Fashion-MNIST or MNIST, <class>/<image> folders, or CIFAR-10 batches" : "where the task's make_data() reads its data (config.data_root)", &c.data_root, {}, "data", kMayChange, kPerNode},
      {"--dataset", "which data; auto: Fashion-MNIST from --data_root, synthetic if absent; imagefolder: --data_root/<class>/<image>; cifar10: its binary batches; shards: tar shards (--data_root 'train-{0000..0127}.tar', written by the shards subcommand), streamed", &c.dataset, {"auto", "fashion-mnist", "mnist", "synthetic", "imagefolder", "cifar10", "shards"}, "data"},
      {"--train-samples", "use only the first N training samples (0: all)", &c.train_samples, {}, "data"},
      {"--test-samples", "use only the first N test samples (0: all)", &c.test_samples, {}, "data"},
      {"--cpu-decode-share", "imagefolder or shards with --image-decode gpu: the share of each batch's images (evenly spread, the same on every run) whose crops the loader's CPU threads decode; nvJPEG decodes the rest, and the GPU resizes all. 1 (default) was fastest with 16 cores per GPU; lower it when the loader cannot keep up", &c.cpu_decode_share, {}, "data", kMayChange, kPerNode},
      {"--val-root", "imagefolder: validation folder with the same class folders; empty: hold out --val-split; shards: the validation shards (a pattern, required)", &c.val_root, {}, "data", kMayChange, kPerNode},
      {"--val-split", "fraction of the training set held out as the validation split, which then chooses best.pt, the monitor and --stop-at (test is evaluated on best.pt at the end): seeded, the same on any number of ranks; imagefolder holds out this fraction of each class (default there 0.1, unless --val-root). 0: none, test chooses", &c.val_split, {}, "data"},
      {"--test-every-epoch", "with a validation split: also evaluate the test split every epoch (logged as test_*; it never chooses)", &c.test_every_epoch, {}, "data", kMayChange},
      {"--image-size", "side of square images: imagefolder crops (0: 224); ddptrain bench inputs (0: 64)", &c.image_size, {}, "data"},
      {"--strict-data", "stop at the first corrupt image instead of skipping it with a warning", &c.strict_data, {}, "data", kMayChange},
      {"--image-decode", "imagefolder and shards: crop, resize and normalise on the loader's CPU threads (cpu) or on the GPU (gpu; the loader's threads still decode the crops, or nvJPEG a share of them: --cpu-decode-share); auto: gpu when training on a CUDA device of a build with nvJPEG", &c.image_decode, {"auto", "cpu", "gpu"}, "data", kMayChange, kPerNode},
      {"--augment", "training augmentation of images: random crop with padding + horizontal flip (imagefolder: random-resized crop + flip); auto: standard for the built-in image datasets, none for a task's own data (a task asks for it with config.augment = \"standard\")", &c.augment, {"auto", "standard", "none"}, "data"},
      {"--workers", "loader threads per rank (0: load in the training thread)", &c.workers, {}, "data", kMayChange, kPerNode},
      {"--shard-streams", "shards: sequential readers each epoch is cut into, fixed for the run; the world size must divide it, and a run resumes exactly on any world size that does (0: the world size of the run's first start)", &c.shard_streams, {}, "data"},
      {"--shuffle-buffer", "shards: samples each stream's shuffle buffer holds (memory: this many encoded images per stream; 1 or less: shards' order only)", &c.shuffle_buffer, {}, "data"},
      {"--skip-bad-samples", "shards: instead of stopping, leave out a sample missing a field (at the start) and replace one whose image or field does not decode by the next sample of its shard that does (counted in the epoch line); a damaged tar or a vanished shard still stops the run", &c.skip_bad_samples, {}, "data", kMayChange},

      {"--task", "what to learn: classification (cross-entropy; test_loss, test_acc), regression (--loss mse|l1|huber; test_mse, test_mae, test_r2) or lm (next-token prediction with a GPT; test_loss, test_perplexity)", &c.task, {"classification", "regression", "lm"}, "model"},
      {"--model", "network; gpt-nano, gpt2 (124M), gpt2-medium (350M), gpt2-large (774M), gpt2-xl (1.5B) and gpt are language models for --task lm", &c.model, {"cnn", "resnet18", "resnet34", "resnet50", "gpt-nano", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt"}, "model"},
      {"--stem", "ResNet stem; small: 3x3 stride 1, no max-pool (28-32 px); auto picks by input size", &c.stem, {"auto", "small", "imagenet"}, "model"},
      {"--pretrain", "initial weights: a ddptrain checkpoint or a PyTorch torch.save(state_dict) file", &c.pretrain, {}, "model", kMayChange, kPerNode},
      {"--pretrain-skip", "with --pretrain: names to keep as initialised, a glob such as 'fc.*'", &c.pretrain_skip, {}, "model", kMayChange},
      {"--sync-bn", "SyncBatchNorm; auto: on when the world size is above 1", &c.sync_bn, {"auto", "on", "off"}, "model"},

      {"--epochs", "training epochs", &c.epochs, {}, "train", kMayChange},
      {"--batch", "batch size per rank (global batch = batch x ranks x accum-steps)", &c.batch, {}, "train", kMayChange},
      {"--optimizer", "optimizer", &c.optimizer, {"sgd", "adam", "adamw"}, "train"},
      {"--lr", "peak learning rate; default: 0.1 (sgd), 2e-3 (adam, adamw)", &c.lr, {}, "train"},
      {"--weight-decay", "weight decay (--task lm: on matrices and embeddings only, as nanoGPT); default: 5e-4 (sgd), 0 (adam), 0.05 (adamw)", &c.weight_decay, {}, "train"},
      {"--momentum", "SGD momentum", &c.momentum, {}, "train"},
      {"--schedule", "learning-rate schedule, as PyTorch's of the same name (formulas below)", &c.schedule, {"constant", "step", "cosine", "onecycle"}, "train"},
      {"--warmup-epochs", "linear warm-up in epochs (may be fractional; 0: none); onecycle: its rise (default 30% of the run)", &c.warmup_epochs, {}, "train"},
      {"--loss", "loss of the built-in tasks; mse, l1 and huber need targets shaped like the outputs", &c.loss, {"cross-entropy", "mse", "l1", "huber"}, "train"},
      {"--label-smoothing", "label smoothing for cross-entropy", &c.label_smoothing, {}, "train"},
      {"--clip-grad-norm", "clip the global gradient norm to this value (0: off)", &c.clip_grad_norm, {}, "train"},
      {"--ema", "decay of an exponential moving average of the weights, updated after every optimizer step with a warm-up (decay min(DECAY, (1+n)/(10+n)) at update n); validation, best.pt, export and predict use the average (0: off)", &c.ema, {}, "train"},
      {"--accum-steps", "micro-batches per optimizer step (gradient accumulation)", &c.accum_steps, {}, "train"},
      {"--seed", "seed for initialisation, shuffling and augmentation", &c.seed, {}, "train"},
      {"--bucket-cap-mb", "gradient all-reduce bucket size in MiB", &c.bucket_cap_mb, {}, "train"},

      {"--amp", "mixed precision: bf16 (CPU or CUDA), or fp16 with dynamic loss scaling (CUDA only)", &c.amp, {"off", "bf16", "fp16"}, "speed"},
      {"--cuda-graph", "capture the whole training step in a CUDA graph and replay it", &c.cuda_graph, {}, "speed", kMayChange},
      {"--shard-optimizer", "ZeRO-1: each rank keeps the optimizer state (AdamW's two moments, SGD's momentum) of 1/world-size of the parameters and updates only those; the updated parts are then broadcast, each from its rank. Saves (N-1)/N of that state per rank (AdamW: 8 bytes per parameter become 8/N); costs one all-gather of the parameters per step and a gather of the state before each checkpoint. The same numbers bit for bit (over NCCL with --clip-grad-norm: to rounding, the norm being summed over the ranks' parts), and the same checkpoints: resume sharded or not, on any number of ranks. Gradients are reduce-scattered where the backend has it (NCCL), else all-reduced whole (Gloo), as the start line says", &c.shard_optimizer, {}, "memory", kMayChange},
      {"--shard-gradients", "ZeRO-2 (DeepSpeed stage 2, FSDP's SHARD_GRAD_OP without the parameters): --shard-optimizer, and each rank keeps the gradients of its 1/world-size part only. Each bucket's gradients are copied into a bucket buffer as backward makes them, reduced, this rank's part kept, and the buffer freed: gradient memory per rank falls from 4 bytes per parameter (fp32) to 4/N plus two or three buckets (--bucket-cap-mb). Costs a copy of each gradient, no gradient slots for the fused kernels, no --cuda-graph; with --accum-steps the micro-steps but the last keep whole gradients. The same numbers bit for bit over Gloo (with --clip-grad-norm too), the same checkpoints as --shard-optimizer and unsharded runs", &c.shard_gradients, {}, "memory", kMayChange},
      {"--recompute", "activation recomputation of the built-in models, to fit a larger model or batch: backward runs these parts' forward again instead of keeping their activations (about one more forward of them per step; the same numbers bit for bit). none; mlp: each GPT block's second LayerNorm and MLP; blocks: every GPT block or ResNet residual block; blocks:N: every N-th; stages: each ResNet stage. A model of your own calls ddp::recompute (ddp/models/recompute.h)", &c.recompute, {}, "memory", kMayChange},
      {"--channels-last", "channels-last memory format for images and conv weights; auto: on with CUDA", &c.channels_last, {"auto", "on", "off"}, "speed", kMayChange},
      {"--tf32", "TF32 for fp32 matmuls and convolutions on CUDA (--tf32=false: off)", &c.tf32, {}, "speed", kMayChange},
      {"--convert-layers", "at start, turn the model's torch::nn Linear, LayerNorm and BatchNorm layers inside a torch::nn::Sequential into ddp::nn's (the same layers and state_dict names, with ddptrain's CUDA kernels; a ReLU or GELU right after one folded into it) and say what was converted and what stayed: layers held in a model's members cannot be swapped in C++ (on), or leave the model as built (off)", &c.convert_layers, {"on", "off"}, "speed", kMayChange},
      {"--bn-kernel", "training batch norm on CUDA: ddptrain's channels-last bf16 kernels where they apply, with ReLU and residual add fused in (auto), the same kernels with separate ReLU/add ops (unfused), or LibTorch's (native); the ResNet stem's max pool runs ddptrain's channels-last kernel except with native", &c.bn_kernel, {"auto", "unfused", "native"}, "speed", kMayChange},
      {"--ce-kernel", "--task lm's and ddp::nn::CrossEntropyLoss's cross-entropy on CUDA: ddptrain's fused kernels, in training one pass over the logits that writes the gradient over them (auto), one pass each way (two-pass), or LibTorch's, which copies the bf16 logits to fp32 first (native)", &c.ce_kernel, {"auto", "two-pass", "native"}, "speed", kMayChange},
      {"--ln-kernel", "--task lm's and ddp::nn::LayerNorm's residual add + LayerNorm on CUDA under --amp bf16: ddptrain's fused kernels, one pass each way with a bf16 output (auto), or LibTorch's add, layer_norm and cast (native)", &c.ln_kernel, {"auto", "native"}, "speed", kMayChange},
      {"--linear-kernel", "--task lm's and ddp::nn::Linear's linear layers on CUDA under --amp bf16: the bias gradients as fp32 column sums from ddptrain's kernels, with the MLP's GELU backward in the same pass (auto), and cuBLASLt's matmuls with their algorithm chosen by timing (auto), or LibTorch's ops (native); the same products either way, up to the last bit", &c.linear_kernel, {"auto", "native"}, "speed", kMayChange},
      {"--side-stream", "--task lm's GPT on CUDA under --amp bf16: the backward's weight-gradient matmuls on a second CUDA stream, beside the chain of input gradients, the same gradients to the bit (auto: for ddptrain's GPT trained by one process; on: also for other models built from ddptrain's GPT layers, each of whose weights must get its gradient from those layers alone; off)", &c.side_stream, {"auto", "on", "off"}, "speed", kMayChange},
      {"--stop-at-acc", "stop after the first epoch whose test accuracy reaches this fraction (0: off); short for --stop-at test_acc>=X", &c.stop_at_acc, {}, "train", kMayChange},
      {"--stop-at", "stop after the first epoch whose metric reaches a value: METRIC>=V or METRIC<=V, or MONITOR=V for the task's monitor (reached in the direction it prefers)", &c.stop_at, {}, "train", kMayChange},
      {"--monitor", "the metric that picks best.pt and that --patience, --save-top-k and --stop-at MONITOR=V follow, as NAME:min or NAME:max (e.g. loss:min; read on the validation split when there is one, else on test); default: the task's monitor()", &c.monitor, {}, "train"},
      {"--patience", "early stopping: stop after N validations in a row in which the task's monitor did not improve on its best by more than --min-delta (0: off); that epoch is saved", &c.patience, {}, "train", kMayChange},
      {"--min-delta", "with --patience: the least change of the monitor, in its direction, that counts as an improvement", &c.min_delta, {}, "train", kMayChange},
      {"--sanity-val-steps", "validation batches per rank to run before training, as Lightning's num_sanity_val_steps: a failing validation_step() or a --stop-at metric that validation does not report shows at the start, not after the first epoch (0: off)", &c.sanity_val_steps, {}, "train", kMayChange},
      {"--bench-steps", "ddptrain bench: timed steps (after warm-up)", &c.bench_steps, {}, "bench", kMayChange},
      {"--largest-batch", "ddptrain bench on one GPU: first find the largest batch whose training step fits in the GPU's memory, as Lightning's batch-size finder, in this process: from --batch, doubling until a step runs out of memory, then bisecting (a line per try); then time that batch", &c.largest_batch, {}, "bench", kMayChange},
      {"--profile-trace", "write a Chrome trace of GPU kernels and ops to this file (Kineto; CUDA builds with LibTorch 2.2+): of the last epoch's training steps, or with ddptrain bench of --bench-steps more steps after timing", &c.profile_trace, {}, "output", kNotRestored, kPerNode},

      {"--checkpoint", "predict: the checkpoint whose weights predict, e.g. RUN/best.pt (with --ema, the average's)", &c.checkpoint, {}, "predict", kMayChange, kPerNode},
      {"--split", "predict: the data to predict, in its order: test, val (the run's --val-split), train (less val), or a file or folder of the kind --data_root takes (the task's make_predict_data reads it)", &c.split, {}, "predict", kMayChange},
      {"--out", "predict: the file to write, .csv (a header of the names predict_step returns) or .npy (NumPy's format, for one name)", &c.out, {}, "predict", kMayChange, kPerNode},

      {"--save_path,--save-path", "directory under which each run makes train_<timestamp>/", &c.save_path, {}, "output", kNotRestored, kPerNode},
      {"--save_epoch,--save-epoch", "save a checkpoint every N epochs (and always after the last)", &c.save_epoch, {}, "output", kMayChange},
      {"--keep-last", "keep only the newest K epoch checkpoints (0: keep all)", &c.keep_last, {}, "output", kMayChange},
      {"--save-top-k", "also keep the best K checkpoints by the task's monitor, as epoch=E-METRIC=VALUE.pt beside best.pt (0: off); --keep-last does not prune them", &c.save_top_k, {}, "output", kMayChange},
      {"--resume", "continue a run with its saved flags: auto (the newest checkpoint under --save_path), a run directory or a checkpoint file", &c.resume, {}, "output", kMayChange, kPerNode},
      {"--reschedule", "with --resume and another --epochs: recompute a schedule that depends on the run's length (step, cosine, onecycle) for the new length", &c.reschedule, {}, "output", kMayChange},
      {"--progress", "auto: a bar on a terminal, plain lines otherwise", &c.progress, {"auto", "bar", "plain", "none"}, "output", kMayChange, kPerNode},
      {"--log-every", "plain-output line every N steps", &c.log_every, {}, "output", kMayChange},

      {"--inject-fault", "for testing restarts, crash reports and preemption on a real job: RANK:STEP makes rank RANK fail after optimizer step STEP of the job's first attempt (an exception); RANK:STEP:segv crashes it (SIGSEGV), RANK:STEP:user stops it as bad input would, RANK:STEP:term sends SIGTERM to its launcher (to the rank without one), as a preemption. Never saved with the run", &c.inject_fault, {}, "testing", kNotRestored, kPerNode},
  };
  // The task's own flags, after the built-in ones.
  for (auto& f : c.task_flags)
    table.push_back({f.names, f.help, std::visit([](auto& v) -> FlagTarget { return &v; }, f.value), f.choices, "task"});
  return table;
}

void check_profile_trace_flag(const Config& c) {
  check_user(c.profile_trace.empty() || compat::kHasGpuProfiler,
             "--profile-trace " + c.profile_trace + ": this build has no Kineto GPU profiler.",
             "build against a CUDA LibTorch 2.2 or later (the GPU machine's PyTorch), or drop --profile-trace.");
}

namespace {

constexpr int64_t kMaxTimeoutSeconds = 30 * 24 * 3600;

void validate(const Config& c) {
  auto finite = [](const std::string& flag, double v, const std::string& hint) {
    std::ostringstream os;
    os << flag << " must be finite, got " << v << ".";
    check_user(!std::isinf(v), os.str(), hint);
  };
  auto positive = [&](const std::string& flag, double v, const std::string& hint) {
    std::ostringstream os;
    os << flag << " must be positive, got " << v << ".";
    check_user(v > 0, os.str(), hint);
    finite(flag, v, hint);
  };
  positive("--epochs", c.epochs, "train for at least one epoch, e.g. --epochs 3.");
  positive("--batch", c.batch, "give the per-rank batch size, e.g. --batch 64.");
  if (c.was_given("lr")) positive("--lr", c.lr, "e.g. --lr 0.1 for sgd, --lr 1e-3 for adamw.");
  positive("--save_epoch", c.save_epoch, "e.g. --save_epoch 1 to save every epoch.");
  positive("--accum-steps", c.accum_steps, "1 means no accumulation.");
  positive("--timeout", c.timeout, "seconds, e.g. --timeout 300.");
  check_user(c.timeout <= kMaxTimeoutSeconds, "--timeout must be at most " + std::to_string(kMaxTimeoutSeconds) +
                                                  " seconds (30 days), got " + std::to_string(c.timeout) + ".",
             "e.g. --timeout 300.");
  finite("--clip-grad-norm", c.clip_grad_norm, "e.g. --clip-grad-norm 1.0, or 0 for none.");
  if (c.was_given("weight-decay")) {
    std::ostringstream os;
    os << "--weight-decay must be 0 or positive, got " << c.weight_decay << ".";
    check_user(c.weight_decay >= 0, os.str(), "e.g. --weight-decay 0.1 for adamw, or 0 for none.");
    finite("--weight-decay", c.weight_decay, "e.g. --weight-decay 0.1 for adamw, or 0 for none.");
  }
  if (c.was_given("momentum")) {
    std::ostringstream os;
    os << "--momentum must be in [0, 1), got " << c.momentum << ".";
    check_user(c.momentum >= 0 && c.momentum < 1, os.str(), "SGD momentum is a fraction such as 0.9; 0 turns it off.");
  }
  positive("--bucket-cap-mb", c.bucket_cap_mb, "PyTorch's default is 25.");
  (void)parse_recompute(c.recompute);  // a UserError for a misspelt level, before anything starts
  positive("--log-every", c.log_every, "e.g. --log-every 50.");
  check_user(c.size >= 0, "--size must be 0 (auto) or positive, got " + std::to_string(c.size) + ".");
  check_user(c.port >= 0 && c.port < 65536, "--port " + std::to_string(c.port) + " is not a TCP port.",
             "use 1024-65535, or omit it to pick a free one.");
  check_user(c.val_split >= 0 && c.val_split < 1, "--val-split must be in [0, 1), got " + std::to_string(c.val_split) + ".",
             "e.g. --val-split 0.1 holds out 10% of the training set for validation.");
  check_user(c.cpu_decode_share >= 0 && c.cpu_decode_share <= 1,
             "--cpu-decode-share must be in [0, 1], got " + std::to_string(c.cpu_decode_share) + ".",
             "e.g. --cpu-decode-share 0.3 decodes 3 of every 10 images on the CPU.");
  check_user(c.image_size >= 0, "--image-size must be 0 (auto) or positive, got " + std::to_string(c.image_size) + ".");
  check_user(c.workers >= 0, "--workers must be 0 or more, got " + std::to_string(c.workers) + ".");
  check_user(c.shard_streams >= 0, "--shard-streams must be 0 (the world size) or positive, got " + std::to_string(c.shard_streams) + ".");
  check_user(c.shuffle_buffer >= 0, "--shuffle-buffer must be 0 or more, got " + std::to_string(c.shuffle_buffer) + ".");
  check_user(c.train_samples >= 0 && c.test_samples >= 0, "--train-samples/--test-samples must be 0 (all) or positive.");
  check_user(c.label_smoothing >= 0 && c.label_smoothing < 1,
             "--label-smoothing must be in [0, 1), got " + std::to_string(c.label_smoothing) + ".");
  check_user(c.clip_grad_norm >= 0, "--clip-grad-norm must be 0 (off) or positive.");
  if (c.ema != 0) {
    std::ostringstream os;
    os << "--ema must be a decay in (0, 1), or 0 for none; got " << c.ema << ".";
    check_user(c.ema > 0 && c.ema < 1, os.str(), "e.g. --ema 0.999 averages over about the last 1000 steps.");
  }
  check_user(c.warmup_epochs >= 0, "--warmup-epochs must not be negative.");
  check_user(c.keep_last >= 0, "--keep-last must be 0 (keep all) or positive.");
  check_user(c.save_top_k >= 0, "--save-top-k must be 0 (off) or positive, got " + std::to_string(c.save_top_k) + ".",
             "e.g. --save-top-k 3 keeps the three best checkpoints.");
  check_user(c.patience >= 0, "--patience must be 0 (off) or positive, got " + std::to_string(c.patience) + ".",
             "e.g. --patience 5 stops after five validations without improvement.");
  finite("--min-delta", c.min_delta, "e.g. --min-delta 0.001, or 0.");
  check_user(c.min_delta >= 0, "--min-delta must be 0 or positive, got " + std::to_string(c.min_delta) + ".",
             "give the least improvement that counts, e.g. --min-delta 0.001; the monitor's direction applies it.");
  check_user(c.max_restarts >= 0, "--max-restarts must be 0 or positive.");
  check_user(c.sanity_val_steps >= 0, "--sanity-val-steps must be 0 (off) or positive, got " +
                                          std::to_string(c.sanity_val_steps) + ".");
  check_user(c.stop_at_acc >= 0 && c.stop_at_acc <= 1, "--stop-at-acc must be a fraction in [0, 1], got " + std::to_string(c.stop_at_acc) + ".",
             "e.g. --stop-at-acc 0.93.");
  positive("--bench-steps", c.bench_steps, "e.g. --bench-steps 100.");
  parse_stop_rule(c.stop_at);  // the trainer reads the same parses (src/train/stop_rule.cpp)
  parse_monitor(c.monitor, {});
  check_user(c.inject_fault.empty() || std::regex_match(c.inject_fault, std::regex("[0-9]+:[0-9]+(:(segv|user|term))?")),
             "--inject-fault '" + c.inject_fault + "' is not RANK:STEP or RANK:STEP:segv|user|term.",
             "e.g. --inject-fault 1:30 (rank 1 fails after step 30); it is for testing restarts.");
  // Flags that would be accepted and do nothing.
  check_user(!c.was_given("momentum") || c.optimizer == "sgd",
             "--momentum applies to --optimizer sgd only; " + c.optimizer + " does not read it.",
             "drop --momentum, or use --optimizer sgd.");
  check_user(!c.was_given("pretrain-skip") || !c.pretrain.empty(), "--pretrain-skip needs --pretrain.",
             "name the weights to start from with --pretrain PATH, or drop --pretrain-skip.");
  check_user(!c.reschedule || !c.resume.empty(), "--reschedule needs --resume.",
             "resume a run with --resume DIR (or auto) --reschedule, or drop --reschedule.");
  if (!c.stop_at.empty() && c.stop_at_acc != 0) {
    std::ostringstream acc;
    acc << c.stop_at_acc;
    throw UserError("--stop-at and --stop-at-acc were both given.",
                    "keep one: --stop-at test_acc=" + acc.str() + " says what --stop-at-acc " + acc.str() + " says.");
  }
  check_user(c.nnodes >= 1, "--nnodes must be at least 1.");
  check_user(c.node_rank >= 0 && c.node_rank < c.nnodes,
             "--node-rank " + std::to_string(c.node_rank) + " is outside [0, " + std::to_string(c.nnodes) + ").");
}

void resolve_defaults(Config& c) {
  if (!c.was_given("lr")) c.lr = c.optimizer == "sgd" ? 0.1 : 2e-3;
  if (!c.was_given("weight-decay")) c.weight_decay = c.optimizer == "sgd" ? 5e-4 : (c.optimizer == "adamw" ? 0.05 : 0.0);
  // An image folder has no held-out images of its own: without --val-root
  // it keeps its 10% per class, which it always held out.
  if (!c.was_given("val-split") && c.dataset == "imagefolder" && c.val_root.empty()) c.val_split = 0.1;
}

nlohmann::json value_of(const FlagTarget& target) {
  return std::visit([](auto* p) { return nlohmann::json(*p); }, target);
}

// True if one of the flag's long names is among the (normalised) arguments.
bool on_command_line(const std::vector<std::string>& args, const Flag& f) {
  std::stringstream names(f.names);
  std::string name;
  while (std::getline(names, name, ','))
    for (size_t i = 1; i < args.size() && args[i] != "--"; ++i)
      if (args[i] == name || args[i].rfind(name + "=", 0) == 0) return true;
  return false;
}

// ---- names: '_' and '-' alike, and "did you mean" ----

std::string dashes(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// Every long name of the table (and --config, --help, --version), keyed by
// its spelling with dashes; the value is the name CLI11 knows.
std::map<std::string, std::string> long_names(const std::vector<Flag>& table) {
  std::map<std::string, std::string> out{{"config", "config"}, {"help", "help"}, {"version", "version"}};
  for (const auto& f : table) {
    std::stringstream names(f.names);
    std::string name;
    while (std::getline(names, name, ','))
      if (name.rfind("--", 0) == 0) out.emplace(dashes(name.substr(2)), name.substr(2));
  }
  return out;
}

// What users of Lightning, torchrun and timm type for a flag this table
// names otherwise: offered by "did you mean", never accepted (one spelling
// per flag keeps config files and refusals readable).
const std::map<std::string, std::string>& kin_names() {
  static const std::map<std::string, std::string> kin{
      {"max-epochs", "epochs"},          {"batch-size", "batch"},          {"learning-rate", "lr"},
      {"precision", "amp"},              {"gradient-clip-val", "clip-grad-norm"}, {"clip-grad", "clip-grad-norm"},
      {"accumulate-grad-batches", "accum-steps"}, {"devices", "size"},   {"gpus", "size"},
      {"nproc-per-node", "size"},        {"num-nodes", "nnodes"},          {"master-port", "port"},
      {"master-addr", "address"},        {"lr-schedule", "schedule"},      {"scheduler", "schedule"},
      {"sched", "schedule"},             {"ckpt-path", "resume"},          {"default-root-dir", "save-path"},
      {"output-dir", "save-path"},       {"num-workers", "workers"},       {"model-ema-decay", "ema"},
      {"grad-checkpointing", "recompute"}, {"opt", "optimizer"},         {"wd", "weight-decay"},
      {"smoothing", "label-smoothing"},  {"early-stopping-patience", "patience"}};
  return kin;
}

// " Did you mean --epochs?" for the nearest name, or "". `names` holds what
// may be offered (a program's flags less those its task does not read).
std::string did_you_mean(const std::string& wrong, const std::map<std::string, std::string>& names,
                         const std::string& prefix) {
  const std::string w = dashes(wrong);
  const auto kin = kin_names().find(w);
  if (kin != kin_names().end() && names.count(kin->second)) return "did you mean " + prefix + kin->second + "? ";
  std::string best;
  size_t best_distance = std::max<size_t>(2, w.size() / 4) + 1;
  for (const auto& [spelling, name] : names) {
    size_t d = edit_distance(w, spelling);
    if (spelling.rfind(w, 0) == 0 || w.rfind(spelling, 0) == 0) d = std::min<size_t>(d, 1);
    if (d < best_distance) best_distance = d, best = spelling;
  }
  return best.empty() ? "" : "did you mean " + prefix + best + "? ";
}

// argv with every long flag spelt as the table spells it (--train_samples ->
// --train-samples); an unknown flag is an error that suggests the nearest.
std::vector<std::string> normalise_flags(int argc, const char* const* argv, const std::map<std::string, std::string>& names,
                                         const std::map<std::string, std::string>& offered, const std::string& program) {
  std::vector<std::string> out(argv, argv + argc);
  for (size_t i = 1; i < out.size(); ++i) {
    std::string& arg = out[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg.rfind("--", 0) != 0) continue;
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const auto it = names.find(dashes(name));
    if (it == names.end())
      throw UserError("unknown flag '--" + name + "'.",
                      did_you_mean(name, offered, "--") + "Run '" + program + " --help' to see every flag.");
    arg = "--" + it->second + (eq == std::string::npos ? "" : arg.substr(eq));
  }
  return out;
}

// TOML for --config, read leniently: keys with '_' or '-', and sections
// named after the flag groups ([data], [model], [train], ...) whose keys
// count as if they were at the top. Other sections and unknown keys are
// errors that name the file and the nearest key.
class ConfigReader : public CLI::ConfigTOML {
 public:
  ConfigReader(std::map<std::string, std::string> names, std::vector<std::string> sections, const CLI::Option* file,
               std::string program)
      : names_(std::move(names)), sections_(std::move(sections)), file_(file), program_(std::move(program)) {}

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    std::vector<CLI::ConfigItem> out;
    for (auto& item : CLI::ConfigTOML::from_config(input)) {
      if (!item.parents.empty()) {
        const std::string section = CLI::detail::join(item.parents, ".");
        if (item.parents.size() > 1 || std::find(sections_.begin(), sections_.end(), section) == sections_.end())
          throw UserError("section [" + section + "] in the config file '" + file() + "' is not a flag group.",
                          "use no sections, or the groups of '" + program_ + " --help': [data], [model], [optimisation], "
                          "[memory], [distributed], [output], [speed], [bench].");
        if (item.name == "++" || item.name == "--") continue;  // CLI11's section markers
        item.parents.clear();
      }
      const auto it = names_.find(dashes(item.name));
      if (it == names_.end() || it->second == "config" || it->second == "help" || it->second == "version")
        throw UserError("unknown key '" + item.name + "' in the config file '" + file() + "'.",
                        did_you_mean(item.name, names_, "") +
                            "Keys are the long flag names without dashes, e.g. epochs = 3; see '" + program_ + " --help'.");
      item.name = it->second;
      out.push_back(std::move(item));
    }
    return out;
  }

 private:
  std::string file() const { return file_->results().empty() ? "" : file_->results().back(); }
  std::map<std::string, std::string> names_;
  std::vector<std::string> sections_;
  const CLI::Option* file_;
  std::string program_;
};

// ---- --help and --version ----

// Help groups in the order a newcomer reads them, under the names they know.
std::string help_group(const std::string& group) {
  if (group == "launch") return "distributed";
  if (group == "train") return "optimisation";
  if (group == "speed") return "speed (CUDA)";
  return group;
}

int help_rank(const std::string& group) {
  static const std::vector<std::string> order = {"task",   "data",         "model", "optimisation", "memory",
                                                 "distributed", "output", "speed (CUDA)", "bench", "testing"};
  const auto it = std::find(order.begin(), order.end(), help_group(group));
  return it == order.end() ? static_cast<int>(order.size()) : static_cast<int>(it - order.begin());
}

// The table's rows in help order (CLI11 lists groups as first registered).
std::vector<Flag> ordered_for_help(std::vector<Flag> table) {
  std::stable_sort(table.begin(), table.end(),
                   [](const Flag& a, const Flag& b) { return help_rank(a.group) < help_rank(b.group); });
  return table;
}

// Section names a config file may use: the groups, as the table and --help name them.
std::vector<std::string> config_sections(const std::vector<Flag>& table) {
  std::vector<std::string> out;
  for (const auto& f : table)
    for (const auto& g : {f.group, help_group(f.group)})
      if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  for (const char* g : {"train", "optimization"})
    if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  return out;
}

constexpr const char* kSchedulesHelp =
    "\nSchedules (step s of S optimizer steps, W warm-up steps from --warmup-epochs, peak = --lr):\n"
    "  constant   peak; with W > 0: peak * (s+1)/W for s < W (PyTorch LinearLR(1/W, 1, W-1))\n"
    "  step       warm-up as above, then peak * 0.1^k, k = milestones passed at 50% and 75% of S-W (MultiStepLR)\n"
    "  cosine     warm-up as above, then peak * (1 + cos(pi * (s-W)/(S-W))) / 2 (CosineAnnealingLR)\n"
    "  onecycle   PyTorch OneCycleLR: cosine from peak/25 up to peak over W = 30% of S (or --warmup-epochs),\n"
    "             then cosine down to peak/25/1e4 at the last step (the learning rate only; no momentum cycling)\n";

// The schedules, then the subcommands, named as the program is.
std::string help_footer(const ProgramInfo& program) {
  const bool ddptrain = program.description.empty();
  std::string out = kSchedulesHelp;
  out += "\nFlags marked [per node] may differ between the nodes (and ranks) of a job. Every other flag, a task's\n"
         "own included, must be the same on every rank: a job whose ranks differ in one stops before training,\n"
         "naming the flag and the ranks.\n";
  if (ddptrain) out += "\nA task may add flags and defaults of its own: ddptrain --task lm --help lists the GPT's.\n";
  out += "\nSubcommands:\n";
  auto row = [&](const std::string& usage, const char* what) {
    char line[200];
    std::snprintf(line, sizeof(line), "  %-36s %s\n", (program.name + " " + usage).c_str(), what);
    out += line;
  };
  row("report RUN_DIR", "metrics, plots and the best epoch of a run");
  row("export CHECKPOINT OUT.pt", "a checkpoint's weights as a PyTorch state_dict");
  row("doctor [flags]", "check the ranks, devices and collectives of a job");
  row("bench [flags]", "time training steps (--bench-steps, --image-size)");
  row("predict --checkpoint C --out F", "the task's predict_step over --split (test) into F (.csv, .npy)");
  row("shards SOURCE OUT [--shard-mb MB]", "an image folder or a CSV as tar shards (--dataset shards), token files as token shards");
  if (ddptrain)
    out += "  ddptrain generate CHECKPOINT --prompt TEXT [--tokens N --temperature T --top-k K --seed S]\n"
           "                                       sample text from a --task lm checkpoint\n";
  return out;
}

std::string version_text(const std::string& program) {
#ifndef DDP_VERSION
#define DDP_VERSION "unknown"
#endif
  const std::string cuda = compat::cuda_nccl_versions();
  return (program == "ddptrain" ? std::string("ddptrain ") : program + ", built on ddptrain ") + DDP_VERSION + "\nLibTorch " + compat::torch_version() + "\n" +
         (cuda.empty() ? "CPU only (no CUDA, no NCCL)" : cuda) + "\n";
}

}  // namespace

std::string nearest_word(const std::string& wrong, const std::vector<std::string>& words) {
  std::map<std::string, std::string> names;
  for (const auto& w : words) names.emplace(w, w);
  return did_you_mean(wrong, names, "");
}

Config parse_cli(int argc, const char* const* argv, Config defaults) {
  Config c = std::move(defaults);
  c.given.clear();
  const Config defaults_copy = c;
  const ProgramInfo& program = c.program;
  CLI::App app{program.description.empty()
                   ? "ddptrain: data-parallel training with LibTorch on one GPU, many GPUs or many machines.\n"
                     "With no flags it trains a small CNN on Fashion-MNIST on every visible GPU (or one CPU rank; --size 2 for two)."
                   : program.name + ": " + program.description + "\n"
                     "It trains on every visible GPU, or one CPU rank (--size 2 for two), data-parallel with ddptrain.",
               program.name};
  app.set_help_flag("-h,--help", "print this help and exit");
  app.get_formatter()->column_width(34);
  // --config is not a Config field: it names where the others come from.
  app.footer(help_footer(program));
  auto table = flag_table(c);
  const auto names = long_names(table);
  for (const char* const* a = argv + 1; a < argv + argc; ++a)
    if (std::string(*a) == "--version") {
      std::cout << version_text(program.name);
      std::exit(exit_code::kOk);
    }
  // What an unknown flag may be offered: not a flag this program's task
  // does not read (it would be refused next).
  auto offered = names;
  for (const auto& key : program.unread_flags) offered.erase(key);
  const auto args = normalise_flags(argc, argv, names, offered, program.name);
  for (auto& f : ordered_for_help(table)) {
    const std::string help = f.help + (f.across_ranks == AcrossRanks::kPerNode ? " [per node]" : "");
    CLI::Option* o = std::visit(
        [&](auto* p) {
          if constexpr (std::is_same_v<decltype(p), bool*>)
            return app.add_flag(f.names, *p, help);
          else
            return app.add_option(f.names, *p, help);
        },
        f.target);
    // A later value overrides an earlier one (flags after a config file, or
    // a script's defaults followed by the user's own).
    // A flag the task does not read is still parsed (to be refused with a
    // reason, check_flags_apply) but not offered: CLI11 hides group "".
    const auto& unread = program.unread_flags;
    const bool hidden = std::find(unread.begin(), unread.end(), f.key()) != unread.end();
    o->capture_default_str()->group(hidden ? "" : help_group(f.group))->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    if (!f.choices.empty()) o->check(CLI::IsMember(f.choices));
  }
  CLI::Option* config_file = app.set_config("--config", "", "read flags from a TOML file (key = value, keys named like the long flags, optionally under [data], [model], ... sections); flags on the command line win. A run's config.toml repeats that run");
  config_file->group("config");
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.config_formatter(std::make_shared<ConfigReader>(names, config_sections(table), config_file, program.name));
  const std::string version_help = std::string("print the versions of ") +
                                   (program.name == "ddptrain" ? "" : "this program, ") +
                                   "ddptrain, LibTorch, CUDA and NCCL and exit";
  app.add_flag("--version", version_help)->group("config");
  std::vector<const char*> cargs;
  for (const auto& a : args) cargs.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::FileError&) {
    const std::string file = config_file->results().empty() ? "" : config_file->results().back();
    throw UserError("cannot read the config file '" + file + "'.",
                    "check the path; a finished run keeps its flags in <run dir>/config.toml.");
  } catch (const CLI::ConfigError& e) {
    // CLI11 says "INI was not able to parse KEY" for a key that is no flag.
    const std::string what = e.what(), key = what.substr(what.rfind(' ') + 1);
    const std::string file = config_file->results().empty() ? "" : config_file->results().back();
    throw UserError("unknown key '" + key + "' in the config file '" + file + "'.",
                    "keys are the long flag names without dashes, e.g. epochs = 3; see '" + program.name + " --help'.");
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string(e.what()) + ".", "run '" + program.name + " --help' to see every flag and its values.");
  }
  // Given: on the command line, or in a config file with a value other than
  // the default (a run's config.toml spells out every default).
  Config untouched = defaults_copy;
  auto default_table = flag_table(untouched);
  for (size_t i = 0; i < table.size(); ++i) {
    const Flag& f = table[i];
    if (app.count(f.names.substr(0, f.names.find(','))) == 0) continue;
    if (on_command_line(args, f) || value_of(f.target) != value_of(default_table[i].target)) c.given.push_back(f.key());
  }
  validate(c);
  resolve_defaults(c);
  return c;
}

namespace {

// A flag's value as the command line would spell it.
std::string spelled(const FlagTarget& target) {
  std::ostringstream os;
  std::visit([&](auto* p) { os << std::boolalpha << *p; }, target);
  return os.str();
}

// Sets *p from a saved JSON value; false if the JSON holds another type.
template <typename T>
bool assign(T* p, const nlohmann::json& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return false;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return false;
  } else {
    if (!v.is_number()) return false;
  }
  *p = v.get<T>();
  return true;
}

// A data folder given anew on resume, spelt with the run's trailing '/' or
// without it, as the run had it: an image folder carves its validation
// split by a hash of each path below the root as spelt ("data/" and "data"
// differ by that '/', split_image_folder), so the same folder at a new
// place keeps the run's split.
void keep_trailing_slash(std::string& now, const std::string& saved) {
  if (now.empty() || saved.empty()) return;
  const bool slash = saved.back() == '/';
  while (!slash && now.size() > 1 && now.back() == '/') now.pop_back();
  if (slash && now.back() != '/') now += '/';
}

}  // namespace

Config resumed_config(const Config& now, const nlohmann::json& saved, const std::string& checkpoint) {
  Config out = now;
  Config saved_values = now;
  auto table = flag_table(out);
  auto saved_table = flag_table(saved_values);
  std::vector<std::string> changed;
  for (size_t i = 0; i < table.size(); ++i) {
    const Flag& f = table[i];
    const std::string key = f.key();
    // A flag newer than the checkpoint keeps its value; placement and output
    // paths are this invocation's alone (OnResume::kNotRestored).
    if (key == "resume" || f.on_resume == OnResume::kNotRestored || !saved.contains(key)) continue;
    const bool ok = std::visit([&](auto* p) { return assign(p, saved[key]); }, saved_table[i].target);
    check_user(ok, "checkpoint " + checkpoint + " saved '" + key + "' as " + saved[key].dump() + ", not a value of that flag.",
               "it was written by another program; start without --resume.");
    const bool differs = value_of(saved_table[i].target) != value_of(f.target);
    if (now.was_given(key)) {
      const std::string was = spelled(saved_table[i].target);
      if (f.on_resume == OnResume::kSame && differs)
        changed.push_back("--" + key + " " + spelled(f.target) + " (the run's: " + (was.empty() ? "''" : was) + ")");
      if (key == "data_root" || key == "val-root") keep_trailing_slash(*std::get<std::string*>(f.target), was);
      continue;
    }
    // A restored --batch is not the user's: the trainer derives the per-rank
    // batch from the run's global batch (Trainer::keep_global_batch).
    if (differs && key != "batch") out.given.push_back(key);
    std::visit([&](auto* p) { assign(p, saved[key]); }, f.target);
  }
  // A checkpoint from before --val-split applied to every dataset (it has
  // no test-every-epoch) saved the old default 0.1, which only an image
  // folder read: the run trained on all of its data, and goes on so.
  if (!saved.contains("test-every-epoch") && saved.contains("val-split") && out.dataset != "imagefolder" &&
      !now.was_given("val-split")) {
    out.val_split = 0;
    out.given.erase(std::remove(out.given.begin(), out.given.end(), "val-split"), out.given.end());
  }
  if (!changed.empty()) {
    std::string list;
    for (const auto& c : changed) list += (list.empty() ? "" : ", ") + c;
    throw UserError("--resume continues the run of " + checkpoint + " with its own flags, but " + list +
                        (changed.size() == 1 ? " changes" : " change") + " what it learns.",
                    "drop " + std::string(changed.size() == 1 ? "that flag" : "those flags") +
                        " to continue the same job, or start a new run without --resume (--pretrain " + checkpoint +
                        " starts from its weights).");
  }
  // The merged flags pass the checks that parsed ones pass: a header may
  // hold any value (--save_epoch 0 divided by zero).
  try {
    validate(out);
  } catch (const UserError& e) {
    throw UserError("checkpoint " + checkpoint + " holds flags that ddptrain refuses: " + e.what());
  }
  return out;
}

nlohmann::json config_to_json(const Config& config) {
  Config c = config;
  nlohmann::json j = nlohmann::json::object();
  for (auto& f : flag_table(c)) std::visit([&](auto* p) { j[f.key()] = *p; }, f.target);
  return j;
}

namespace {

// `path` absolute and without "." or ".." steps, from this process's
// working directory. Not canonical: a symbolic link the user named (a node's
// own data link) stays. A trailing '/' stays as typed: an image folder
// carves its validation split by the paths below the root as spelt
// (split_image_folder), so "data/" must not become "data" or back.
std::string absolute_path(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  const auto absolute = std::filesystem::absolute(path, ec);
  if (ec) return path;
  std::string out = absolute.lexically_normal().string();
  const bool slash = path.back() == '/';
  if (!slash && out.size() > 1 && out.back() == '/') out.pop_back();  // "data/." is "data"
  if (slash && out.back() != '/') out += '/';                           // "data/x/../" is "data/"
  return out;
}

// absolute_path of each comma-separated item outside braces.
std::string absolute_items(const std::string& list) {
  std::string out, item;
  int depth = 0;
  auto flush = [&] {
    out += (out.empty() ? "" : ",") + absolute_path(item);
    item.clear();
  };
  for (char ch : list) {
    depth += ch == '{' ? 1 : ch == '}' ? -1 : 0;
    if (ch == ',' && depth == 0)
      flush();
    else
      item += ch;
  }
  if (!list.empty()) flush();
  return out;
}

}  // namespace

Config with_absolute_paths(const Config& config) {
  Config c = config;
  // The flags that name files or folders. Not --split: it is a word
  // (test, val, train) as often as a path, and only predict reads it.
  for (std::string* path : {&c.data_root, &c.val_root, &c.pretrain, &c.save_path, &c.profile_trace, &c.checkpoint, &c.out})
    *path = absolute_path(*path);
  // A shard pattern, or --task lm's token files, may list several files
  // (commas outside braces): each of them.
  if (c.dataset == "shards" || c.task == "lm") {
    c.data_root = absolute_items(config.data_root);
    c.val_root = absolute_items(config.val_root);
  }
  return c;
}

namespace {

// TOML values that CLI11's reader takes back unchanged: literal strings
// (no escapes to undo), floats in their shortest exact form. CLI11 2.1's
// reader cuts a value at '#' and undoes no escapes, so a string holding '#'
// or both kinds of quote does not come back intact (rare in paths and globs).
std::string toml_value(const int* v) { return std::to_string(*v); }
std::string toml_value(const bool* v) { return *v ? "true" : "false"; }
std::string toml_value(const std::string* v) {
  const char quote = v->find('\'') == std::string::npos ? '\'' : '"';
  return quote + *v + quote;
}
std::string toml_value(const double* v) {
  char buf[40];
  // The shortest text that reads back exactly, without an exponent where a
  // plain number is as short to read (300, not 3e+02).
  const bool plain = *v == 0 || (std::abs(*v) >= 1e-4 && std::abs(*v) < 1e15);
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, *v);
    if (std::strtod(buf, nullptr) == *v && (!plain || !std::strchr(buf, 'e'))) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";  // TOML tells floats by the point
  return s;
}

}  // namespace

std::string config_to_toml(const Config& config) {
  Config c = config;
  std::ostringstream os;
  os << "# " << config.program.name << " configuration with every default resolved.\n"
     << "# Repeat the run: " << config.program.name << " --config config.toml (flags on the command line override it).\n";
  std::string group;
  for (auto& f : flag_table(c)) {
    if (f.group != group) os << "\n# " << (group = f.group) << "\n";
    os << f.key() << " = " << std::visit([](auto* p) { return toml_value(p); }, f.target) << "\n";
  }
  return os.str();
}

void print_config(const Config& config, std::ostream& out) {
  Config c = config;
  out << "config:\n";
  for (auto& f : flag_table(c)) {
    std::ostringstream v;
    std::visit([&](auto* p) { v << std::boolalpha << *p; }, f.target);
    out << "  " << std::left << std::setw(16) << f.key() << " " << v.str()
        << (config.was_given(f.key()) ? "" : "  (default)") << "\n";
  }
}

}  // namespace ddp
