// Max pooling for the models, through ddptrain's channels-last CUDA kernels
// (include/ddp/cuda/max_pool_nhwc.h: uint8 argmax, gather backward) where
// they apply, and ATen's max_pool2d otherwise; the two give the same bits.
#pragma once

#include <torch/torch.h>

namespace ddp::models {

/// max_pool2d with a square kernel, no dilation, floor mode. ddptrain's
/// kernels run for a CUDA channels-last bf16/fp32 input they support
/// (ddp::cuda::max_pool_nhwc_supported) while use_nhwc_max_pool_kernels is
/// on; anything else goes to torch::max_pool2d.
torch::Tensor max_pool2d(const torch::Tensor& x, int64_t kernel, int64_t stride, int64_t padding);

/// Whether max_pool2d may use ddptrain's kernels (default: yes, in builds
/// that have them). `--bn-kernel native` turns them off with the batch
/// norm's, so that native is all-ATen for A/B timing.
void use_nhwc_max_pool_kernels(bool on);

/// True when max_pool2d would run ddptrain's kernels on this input.
bool nhwc_max_pool_applies(const torch::Tensor& x, int64_t kernel, int64_t stride, int64_t padding);

}  // namespace ddp::models
