// Backward work off the critical path, on a second CUDA stream.
//
// Why: a layer's backward has a chain that the next layer waits for (the
// input gradient's matmul, the LayerNorm's backward, the attention's) and
// work that nothing in the backward reads (the weight gradients' matmuls,
// the MLP's first bias sum). On one stream each kernel waits for the one
// before it, so the bandwidth-bound kernels of the chain (LayerNorm,
// the heads' pass, cuDNN's pre- and post-passes) run with the tensor cores
// idle, and each matmul's last wave leaves SMs idle. On a second stream the
// weight gradients fill those gaps.
//
// On by default for ddptrain's own GPT trained by one process
// (--side-stream auto): in GPT-2's graphed step on an H100 it took 0.36-0.47
// ms off a 31 ms step in each of three calls (bench/RESULTS.md, session 28),
// though the graph with two branches leaves the GPU idle 0.6-0.7 ms a step
// between kernels (0.06 ms as one chain) and takes back most of the 5 ms
// by which the kernels overlap (session 27). Not by default on several
// GPUs: there GradSync joins the side stream before each bucket's
// all-reduce, which no run has measured yet.
//
// The contract: a training step opens a SideWork around its backward. While
// one is open, a backward function may hand work to aside(): it runs on the
// side stream after everything queued so far on the current stream, and
// the tensors it reads are kept alive until it is joined. Its outputs must
// be read by nothing before join_side_work() (which launches any work still
// waiting for its batch): the weight gradients it
// writes go into their slots of the flat gradient buffer (param_slots.h),
// which the all-reduce (GradSync joins first), the tied embedding's
// backward (joins first) and the optimizer (after the SideWork closed) read.
// A parameter used twice in one backward gets its slot once: ddptrain's
// functions wait for the side stream before computing a gradient that has
// no slot, which autograd then adds to the first. A parameter that also
// gets a gradient from LibTorch's own ops in the same backward is not
// covered: autograd would add that one into the slot before the side stream
// wrote it (such a model must not run with --side-stream on).
// With no SideWork open, aside() runs the work at once on the current
// stream, so code outside a training step (tests, a user's own loop) sees
// the usual one-stream order. Under CUDA graph capture the side stream
// joins the capture through the fork's event, and closing joins it back,
// so the graph holds both branches.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace ddp::cuda {

/// When training steps run their side work on the side stream
/// (--side-stream): kAuto for a model that vouches for the contract above
/// (ddptrain's GPT and LmTask, trained by one process: TrainStep asks), kOn
/// for every model (the model's author vouches), kOff never. Process-wide,
/// as the other kernel switches, and read when a TrainStep is made; kAuto
/// until set.
enum class SideStreamMode { kAuto, kOn, kOff };
void set_side_stream(SideStreamMode mode);
SideStreamMode side_stream_mode();
/// Whether the mode opens side work for a model that does (`vouched`) or
/// does not vouch for the contract.
bool side_stream_wanted(bool vouched);

/// Opens side work on the current CUDA device, where `wanted` (a CUDA
/// training step for which side_stream_wanted() said yes) and this is not
/// the process's first SideWork on
/// the device (that backward stays on one stream, so that its matmuls
/// choose their algorithms by timing without the side stream's work beside
/// them), until close() (or the destructor) joins it
/// (join_side_work). Not nested. close() throws what the side work's last
/// launch threw (an out-of-memory error, say); the destructor, run while
/// another exception unwinds the stack, only reports its own on stderr.
class SideWork {
 public:
  explicit SideWork(bool wanted);
  ~SideWork();
  void close();
  SideWork(const SideWork&) = delete;
  SideWork& operator=(const SideWork&) = delete;

 private:
  bool open_ = false;
};

/// Hands `work` to the side stream where a SideWork is open, else runs it
/// here. Handed over, it runs later, in a batch with the next few pieces
/// (one fork from the current stream a batch, after what that stream has
/// queued by then), so it must own what it reads: capture the tensors by
/// value, which also keeps them alive until it has been joined. The
/// tensors it allocates come from the side stream's pool. A backlog of
/// more than a few batches makes the current stream wait for the oldest,
/// which bounds the memory kept alive.
void aside(std::function<void()> work);

/// How many pieces of work have run on the side stream in this process.
size_t side_pieces();

/// Launches the work still waiting for its batch, makes the current stream
/// wait for all side work, and releases what it kept. Cheap when there is none; safe from any thread.
void join_side_work();

}  // namespace ddp::cuda
