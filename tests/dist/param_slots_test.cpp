// A parameter's bf16 copy and gradient slot in GradSync's flat buffers
// (include/ddp/dist/param_slots.h), on CPU with a real one-rank Gloo group
// and, across ranks, real processes: a gradient written into its slot lands
// in the flat buffer with no copy; a second use of the parameter, a second
// micro-batch and a parameter GradSync does not hold get no slot, and their
// gradients still add up; the bf16 copies follow the parameters and exist
// only while a step's window is open.
#include "ddp/dist/param_slots.h"

#include <ATen/record_function.h>

#include <atomic>

#include "ddp/dist/grad_sync.h"
#include "support/testing.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = x W^T with dW = g^T x written into W's slot where it has one, else
// into a fresh tensor: how ddptrain's CUDA linear layers use the slots.
struct SlotLinearFn : torch::autograd::Function<SlotLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({x, w});
    return x.matmul(w.t());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto dw = ddp::param_slots::take_gradient_slot(s[1]);
    if (!dw.defined()) dw = torch::empty_like(s[1]);
    at::mm_out(dw, grads[0].t(), s[0]);
    return {grads[0].matmul(s[1]), dw};
  }
};

// aten::copy_ calls on this process while it lives (autograd's copy of a
// gradient it does not adopt, and GradSync's copy into the flat buffer).
struct CopyCounter {
  CopyCounter() {
    handle = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (std::string(fn.name()) == "aten::copy_") ++copies();
          return nullptr;
        }));
  }
  ~CopyCounter() { at::removeCallback(handle); }
  static std::atomic<int>& copies() {
    static std::atomic<int> n{0};
    return n;
  }
  at::CallbackHandle handle;
};

struct Weights : torch::nn::Module {
  Weights() {
    torch::manual_seed(1);
    w = register_parameter("w", torch::randn({3, 4}));
  }
  torch::Tensor w;
};

const char* begin_of(const torch::Tensor& t) { return static_cast<const char*>(t.data_ptr()); }

// One weight in a GradSync over a one-rank Gloo group.
class ParamSlots : public ::testing::Test {
 protected:
  void SetUp() override {
    DDP_SKIP_UNLESS_GLOO();
    world = ddp::testing::one_rank_world();
    sync = std::make_unique<ddp::GradSync>(m, *world);
  }
  std::unique_ptr<ddp::World> world;
  Weights m;
  std::unique_ptr<ddp::GradSync> sync;
  const torch::Tensor x = torch::randn({5, 4}), g = torch::randn({5, 3});
};

TEST_F(ParamSlots, GradientWrittenIntoItsSlotLandsInTheFlatBufferWithoutACopy) {
  const auto want = g.t().mm(x);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    sync->zero_grad(/*set_to_none=*/true);
    auto y = SlotLinearFn::apply(x, m.w);
    CopyCounter::copies() = 0;
    {
      CopyCounter count;
      (y * g).sum().backward();
    }
    EXPECT_EQ(sync->gradient_slots_taken(), 1u);
    sync->finish();
    EXPECT_EQ(CopyCounter::copies().load(), 0) << "the gradient was copied";
    ASSERT_TRUE(m.w.grad().defined());
    EXPECT_EQ(begin_of(m.w.grad()), begin_of(sync->flat_grads().at(0))) << ".grad is the flat buffer's slice";
    EXPECT_TRUE(torch::allclose(m.w.grad(), want));
    EXPECT_TRUE(torch::allclose(sync->flat_grads().at(0).narrow(0, 0, 12).view({3, 4}), want));
  }
}

// The control for the test above: the same function without a slot makes
// autograd hand a tensor of its own to GradSync, which copies it.
TEST_F(ParamSlots, GradientOfAParameterWithoutASlotIsCopied) {
  sync->zero_grad(/*set_to_none=*/true);
  auto y = SlotLinearFn::apply(x, m.w);
  EXPECT_TRUE(ddp::param_slots::take_gradient_slot(m.w).defined()) << "taken here, so backward gets none";
  CopyCounter::copies() = 0;
  {
    CopyCounter count;
    (y * g).sum().backward();
  }
  sync->finish();
  EXPECT_GE(CopyCounter::copies().load(), 1);
  EXPECT_TRUE(torch::allclose(m.w.grad(), g.t().mm(x)));
}

// Two uses of one parameter in a backward (a tied weight), and two
// micro-batches before the optimizer: the second writer gets no slot, so
// the gradients add up instead of one overwriting the other.
TEST_F(ParamSlots, SecondUseAndSecondMicroBatchAddUp) {
  const auto x1 = torch::randn({5, 4}), x2 = torch::randn({2, 4});
  const auto g1 = torch::randn({5, 3}), g2 = torch::randn({2, 3});
  const auto want = g1.t().mm(x1) + g2.t().mm(x2);
  sync->zero_grad(/*set_to_none=*/true);
  ((SlotLinearFn::apply(x1, m.w) * g1).sum() + (SlotLinearFn::apply(x2, m.w) * g2).sum()).backward();
  sync->finish();
  EXPECT_TRUE(torch::allclose(m.w.grad(), want)) << "tied";

  sync->zero_grad(/*set_to_none=*/true);
  {
    auto no_sync = sync->no_sync();
    (SlotLinearFn::apply(x1, m.w) * g1).sum().backward();
  }
  EXPECT_FALSE(ddp::param_slots::take_gradient_slot(m.w).defined()) << ".grad is there: accumulate into it";
  (SlotLinearFn::apply(x2, m.w) * g2).sum().backward();
  sync->finish();
  EXPECT_TRUE(torch::allclose(m.w.grad(), want)) << "two micro-batches";
  EXPECT_EQ(begin_of(m.w.grad()), begin_of(sync->flat_grads().at(0)));
}

TEST_F(ParamSlots, ParametersGradSyncDoesNotHoldGetNeither) {
  auto stranger = torch::randn({3, 4}).requires_grad_();
  sync->zero_grad(/*set_to_none=*/true);
  sync->bf16_copies(true);
  EXPECT_FALSE(ddp::param_slots::take_gradient_slot(stranger).defined());
  EXPECT_FALSE(ddp::param_slots::bf16_copy(stranger).defined());
  EXPECT_FALSE(ddp::param_slots::take_gradient_slot(torch::Tensor()).defined());
  sync->bf16_copies(false);
  sync.reset();
  EXPECT_FALSE(ddp::param_slots::take_gradient_slot(m.w).defined()) << "its GradSync is gone";
}

// The bf16 copies: none until asked for, then made at each opening from
// the parameters as they are, and handed out only while open.
TEST_F(ParamSlots, BF16CopiesFollowTheParametersWhileTheWindowIsOpen) {
  EXPECT_FALSE(ddp::param_slots::bf16_copy(m.w).defined()) << "closed";
  sync->bf16_copies(true);
  EXPECT_FALSE(ddp::param_slots::bf16_copy(m.w).defined()) << "the first request only asks for them";
  sync->bf16_copies(false);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    sync->bf16_copies(true);
    auto copy = ddp::param_slots::bf16_copy(m.w);
    ASSERT_TRUE(copy.defined());
    EXPECT_EQ(copy.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(copy, m.w.detach().to(torch::kBFloat16)));
    sync->bf16_copies(false);
    EXPECT_FALSE(ddp::param_slots::bf16_copy(m.w).defined()) << "closed after backward";
    torch::NoGradGuard no_grad;
    m.w.mul_(-3.0);  // the optimizer's step
  }
}

// A window casts the copies only where the parameters changed in place
// since the last cast (their version counters): the later micro-batches of
// a step reuse the step's cast. Seen through a mark written into the copy,
// which a cast would overwrite.
TEST_F(ParamSlots, CopiesAreCastOnlyWhenTheParametersChanged) {
  sync->bf16_copies(true);
  ddp::param_slots::bf16_copy(m.w);  // asks: made when the window closes
  sync->bf16_copies(false);
  ASSERT_TRUE(sync->has_bf16_copies());
  EXPECT_FALSE(sync->bf16_copies_current()) << "made, never cast";
  sync->bf16_copies(true);
  auto copy = ddp::param_slots::bf16_copy(m.w);
  EXPECT_TRUE(torch::equal(copy, m.w.detach().to(torch::kBFloat16)));
  sync->bf16_copies(false);
  EXPECT_TRUE(sync->bf16_copies_current());
  torch::NoGradGuard no_grad;
  copy.fill_(7.0);  // the mark
  sync->bf16_copies(true);
  EXPECT_TRUE(torch::equal(copy, torch::full_like(copy, 7.0))) << "unchanged parameters: no cast";
  sync->bf16_copies(false);
  m.w.mul_(-3.0);  // an in-place change (an optimizer's step, a load)
  EXPECT_FALSE(sync->bf16_copies_current());
  sync->bf16_copies(true);
  EXPECT_TRUE(torch::equal(copy, m.w.detach().to(torch::kBFloat16))) << "changed: cast again";
  sync->bf16_copies(false);
  copy.fill_(7.0);
  sync->flat_params().front().add_(1.0);  // through the flat buffer: its own counter
  sync->refresh_bf16_copies();
  EXPECT_TRUE(torch::equal(copy, m.w.detach().to(torch::kBFloat16)));
}

// Two ranks over Gloo, each writing its own gradient into the slot: after
// finish() every rank holds the average, as with autograd's own tensors.
TEST_F(ParamSlots, SlotGradientsAreAveragedAcrossRanks) {
  const auto dir = ddp::testing::temp_dir("param_slots");
  auto r = ddp::testing::run_process({DDP_TESTWORKER, "--launch", "2", "param_slots", dir}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    torch::Tensor got, want;
    torch::load(got, dir + "/slot_rank" + std::to_string(rank) + ".pt");
    torch::load(want, dir + "/want_rank" + std::to_string(rank) + ".pt");
    EXPECT_TRUE(torch::allclose(got, want)) << "rank " << rank << ": " << (got - want).abs().max().item<double>();
  }
}

}  // namespace
