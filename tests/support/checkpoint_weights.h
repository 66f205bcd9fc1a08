// A checkpoint of the default cnn as its tensors, and the check that two
// such checkpoints hold the same bits: what the resume tests compare
// (checkpoint_test.cpp, moved_run_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ddp/io/checkpoint.h"
#include "ddp/models/registry.h"

namespace ddp::testing {

/// The parameters, then the buffers, of `checkpoint`'s default cnn.
inline std::vector<torch::Tensor> cnn_checkpoint_tensors(const std::string& checkpoint) {
  auto model = ddp::models::make_model(ddp::models::ModelSpec{});
  ddp::load_checkpoint(checkpoint, *model, nullptr, torch::kCPU, "");
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  for (auto& b : model->buffers()) out.push_back(b.detach().clone());
  return out;
}

inline void expect_bit_equal(const std::string& a, const std::string& b) {
  auto wa = cnn_checkpoint_tensors(a), wb = cnn_checkpoint_tensors(b);
  ASSERT_EQ(wa.size(), wb.size());
  for (size_t i = 0; i < wa.size(); ++i) EXPECT_TRUE(torch::equal(wa[i], wb[i])) << "tensor " << i;
}

}  // namespace ddp::testing
