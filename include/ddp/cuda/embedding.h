// An embedding's weight gradient on CUDA, added into a given fp32 tensor:
// the GPT's tied token embedding adds it to the output head's gradient,
// which is already there (models/fused_linear.h, TiedEmbedding).
//
// Why by hand: ATen's embedding backward returns a fresh dense [V, C]
// gradient (a fill of the whole table, a sort and two segment kernels),
// which autograd then adds to the head's [V, C] gradient: two passes over
// a 154 MB table per GPT-2 124M step for a gradient that touches at most
// 16,384 of its 50,304 rows.
#pragma once

#include <ATen/core/Tensor.h>

namespace ddp::cuda {

/// dw[idx[n], :] += grad[n, :] for every n, in fp32. grad: [N, C] fp32,
/// contiguous; idx: N int64 indices in [0, V); dw: [V, C] fp32, contiguous,
/// on the same device. Deterministic: the rows that share an index are
/// summed in the order they come in idx (a stable sort groups them), then
/// added to dw once. Indices are not checked here (the forward's lookup
/// checks them).
void embedding_backward_add(const at::Tensor& grad, const at::Tensor& idx, const at::Tensor& dw);

}  // namespace ddp::cuda
