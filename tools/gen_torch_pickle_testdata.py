"""Writes the PyTorch files that tests/io/torch_pickle_test.cpp reads with
ddptrain's own unpickler (src/io/torch_pickle.cpp), and the values it expects.

Made with Debian 12's PyTorch 1.13.0 (CPU), the one at /usr/bin/python3:
    /usr/bin/python3 tools/gen_torch_pickle_testdata.py tests/testdata
Each file is a plain torch.save(obj, path) (zip format, pickle protocol 2
unless noted):
  pickle_bn.pt       model.state_dict() of a small conv/BatchNorm/linear
                     model: an OrderedDict with _metadata set through BUILD,
                     and BatchNorm's int64 num_batches_tracked
  pickle_plain.pt    a plain dict of float32/64, int8/16/32/64, uint8, bool
                     tensors, a 0-d tensor and an empty one
  pickle_half.pt     float16 and bfloat16 tensors (a state_dict after
                     model.half()/bfloat16())
  pickle_views.pt    tensors that share one storage: the base, its
                     transpose, a column, a strided slice with an offset
  pickle_cuda.pt     a state_dict whose storages say location 'cuda:0', as
                     when saved from a GPU (made on a CPU by overriding
                     torch.serialization.location_tag while saving)
  pickle_proto4.pt   pickle_bn's state_dict saved with pickle_protocol=4
                     (FRAME, SHORT_BINUNICODE, MEMOIZE, STACK_GLOBAL)
  pickle_bad_global.pt  a dict holding a torch.device: a global that a
                     state_dict never has
  pickle_nested.pt   a training checkpoint {"model": state_dict, "epoch": 3},
                     not a state_dict
  pickle_expected.json  per file, in order: name, dtype, shape, stride,
                     storage offset and the values (flattened, row-major)
"""
import collections
import json
import sys

import torch
from torch import nn


def small_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 3))
    with torch.no_grad():  # non-trivial running statistics
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        m[1].num_batches_tracked.fill_(12345678901)  # needs more than 32 bits
    return m


def describe(sd):
    out = []
    for name, t in sd.items():
        values = t.flatten().tolist() if t.dtype in (torch.int64, torch.bool) else t.double().flatten().tolist()
        out.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                    "stride": list(t.stride()), "offset": t.storage_offset(), "values": values})
    return out


def main(out):
    files = {}
    bn = small_model().state_dict()
    assert isinstance(bn, collections.OrderedDict) and hasattr(bn, "_metadata")
    files["pickle_bn.pt"] = bn

    g = torch.Generator().manual_seed(1)
    files["pickle_plain.pt"] = {
        "f32": torch.randn(2, 3, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "i8": torch.tensor([-128, -1, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "i16": torch.tensor([-32768, 32767], dtype=torch.int16),
        "i32": torch.tensor([[-2147483648, 7], [2147483647, 0]], dtype=torch.int32),
        "i64": torch.tensor([-(2 ** 40), 2 ** 40 + 3], dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }

    files["pickle_half.pt"] = {
        "w16": torch.randn(3, 2, generator=g).half(),
        "wbf16": torch.randn(2, 3, generator=g).bfloat16(),
        "tiny16": torch.tensor([6e-8, 65504.0, -0.0], dtype=torch.float16),
    }

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    files["pickle_views.pt"] = {
        "base": base,
        "transposed": base.t(),           # non-contiguous, same storage
        "column": base[:, 2],             # stride 6, offset 2
        "slice": base[1:3, ::2],          # offset 6, strides (6, 2)
        "alone": torch.ones(2),
    }

    for name, obj in files.items():
        torch.save(obj, f"{out}/{name}")
    torch.save(bn, f"{out}/pickle_proto4.pt", pickle_protocol=4)
    cuda_sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor(3)}
    real_tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(cuda_sd, f"{out}/pickle_cuda.pt")
    finally:
        torch.serialization.location_tag = real_tag
    torch.save({"w": torch.ones(2), "device": torch.device("cpu")}, f"{out}/pickle_bad_global.pt")
    torch.save({"model": bn, "epoch": 3}, f"{out}/pickle_nested.pt")

    expected = {"torch": torch.__version__, "files": {name: describe(obj) for name, obj in files.items()}}
    expected["files"]["pickle_proto4.pt"] = expected["files"]["pickle_bn.pt"]
    expected["files"]["pickle_cuda.pt"] = describe(cuda_sd)
    with open(f"{out}/pickle_expected.json", "w") as f:
        json.dump(expected, f, indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
