// An embedding's weight gradient added into a given table
// (cuda/embedding.h) against index_add_ in float64: runs of equal indices
// (a few rows used many times, most not at all), short and crossing the
// kernel's chunks, both the 4-column and the one-column paths, added to
// what the table held; deterministic.
#include <gtest/gtest.h>

#include "support/testing.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/embedding.h"
#endif

namespace {

#ifdef DDP_WITH_CUDA_KERNELS
TEST(EmbeddingBackward, AddsEachRowsSumToTheTable_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(13);
  struct Shape {
    int64_t n, v, c, distinct;
  };
  // GPT-2's width with a skewed vocabulary (runs of ~80, across the 32-row
  // chunks); an odd width (the scalar path), short runs and long ones; one
  // index for everything; a single lookup; widths past one warp's slice of
  // columns (128 on the 4-column path, 32 on the other) that end inside one.
  for (auto s : {Shape{4096, 50304, 768, 50}, Shape{1000, 300, 37, 300}, Shape{2000, 3, 37, 2}, Shape{513, 10, 8, 1},
                 Shape{1, 5, 4, 5}, Shape{700, 40, 1000, 40}, Shape{300, 7, 70, 7}}) {
    SCOPED_TRACE(::testing::PrintToString(std::vector<int64_t>{s.n, s.v, s.c, s.distinct}));
    auto grad = torch::randn({s.n, s.c}, opts);
    auto idx = torch::randint(0, s.distinct, {s.n}, opts.dtype(torch::kLong));
    auto before = torch::randn({s.v, s.c}, opts);
    auto dw = before.clone();
    ddp::cuda::embedding_backward_add(grad, idx, dw);
    auto want = before.to(torch::kDouble).index_add(0, idx, grad.to(torch::kDouble));
    const double scale = want.abs().max().item<double>();
    // fp32 sums of up to ~n terms of size ~1, then one add.
    EXPECT_LE((dw.to(torch::kDouble) - want).abs().max().item<double>() / scale, 1e-5);
    // Rows no index names are untouched, bit for bit.
    auto untouched = torch::ones({s.v}, opts.dtype(torch::kBool)).index_fill_(0, idx, false);
    EXPECT_TRUE(torch::equal(dw.index({untouched}), before.index({untouched})));
    auto again = before.clone();
    ddp::cuda::embedding_backward_add(grad, idx, again);
    EXPECT_TRUE(torch::equal(dw, again)) << "deterministic";
  }
}

TEST(EmbeddingBackward, RefusesWhatItCannotTake_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  auto grad = torch::randn({6, 8}, opts), dw = torch::zeros({10, 8}, opts);
  auto idx = torch::zeros({6}, opts.dtype(torch::kLong));
  EXPECT_THROW(ddp::cuda::embedding_backward_add(grad.to(torch::kBFloat16), idx, dw), c10::Error);  // fp32 only
  EXPECT_THROW(ddp::cuda::embedding_backward_add(grad, idx, torch::zeros({10, 9}, opts)), c10::Error);  // widths
  EXPECT_THROW(ddp::cuda::embedding_backward_add(grad, idx.narrow(0, 0, 5), dw), c10::Error);           // count
  EXPECT_THROW(ddp::cuda::embedding_backward_add(grad, idx.to(torch::kInt), dw), c10::Error);           // int64
}

#endif

}  // namespace
