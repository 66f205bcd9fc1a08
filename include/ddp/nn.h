// ddp::nn: LibTorch's layers with ddptrain's CUDA kernels (nn/layers.h),
// and the conversion of a model's torch::nn layers into them
// (nn/convert.h). A program built from template/ gets both from <ddp/app.h>.
#pragma once

#include "ddp/nn/convert.h"
#include "ddp/nn/layers.h"
