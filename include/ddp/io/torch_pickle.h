// PyTorch's torch.save format for state_dicts, read and written by hand.
//
// `--pretrain` reads what Python's torch.save(model.state_dict(), path)
// writes, and `ddptrain export` writes files that torch.load(path) reads
// with weights_only=True (the default since PyTorch 2.6). LibTorch's own
// pickler cannot do either: torch::pickle_load maps collections.OrderedDict,
// the type of every state_dict, to None and fails with "Expected GenericDict
// but got None" (pytorch#37213, #95362, #100741), and torch::pickle_save
// tags dicts with torch.jit._pickle.restore_type_tag, a global the
// weights_only unpickler rejects. No Debian library reads the format either.
//
// The format: a zip archive (caffe2's PyTorchStreamWriter) with
// <prefix>/data.pkl, a pickle of a dict name -> tensor, and one record
// <prefix>/data/<key> per storage holding its raw little-endian bytes. A
// tensor is pickled as the call
//   torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
//                                   requires_grad, backward_hooks)
// and its storage as the persistent id
//   ('storage', torch.FloatStorage, key, location, numel).
// The unpickler here knows the opcodes and globals that such a file uses
// (Python's pickletools documents them) and names anything else.
//
// The reader is meant for untrusted files (--pretrain, --resume, export):
// it reads the zip by hand and believes no length in it before checking it
// against the file's real size, shares memoised values instead of copying
// them, and checks every tensor's extent in overflow-free arithmetic. What
// it allocates is bounded by a small multiple of the file's size; anything
// else is a UserError (tests/io/torch_pickle_fuzz_test.cpp mutates files to
// check this under an address-space cap).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace ddp {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Reads a torch.save(state_dict) file (a dict or OrderedDict of tensors):
/// names and CPU tensors in the file's order, whatever device they were
/// saved from. Tensors that shared a storage (views) still share one.
/// Throws UserError naming the file and what it could not read; refuses
/// TorchScript archives (torch.jit.save files, ddptrain checkpoints of
/// format 2 and older) without opening them.
NamedTensors read_state_dict(const std::string& path);

/// The same for the entries whose names `wanted` accepts; the storages of
/// the others are not read (the file is mapped, so they are not even paged
/// in): a checkpoint's header alone costs kilobytes.
NamedTensors read_state_dict(const std::string& path, const std::function<bool(const std::string&)>& wanted);

/// Writes `tensors` the way torch.save(OrderedDict) does, one contiguous
/// storage per tensor, so that torch.load(path, weights_only=True) reads it
/// in PyTorch 1.13 and 2.x. Written atomically (temp file, fsync, rename).
void write_state_dict(const std::string& path, const NamedTensors& tensors);

}  // namespace ddp
