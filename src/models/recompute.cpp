// Activation recomputation: a custom autograd node whose forward runs the
// user's function without autograd and whose backward runs it again with
// autograd, in the forward's RNG and autocast state, and differentiates it.
#include "ddp/models/recompute.h"

#include <optional>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#ifdef DDP_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "ddp/compat.h"
#include "ddp/error.h"

namespace ddp {
namespace {

thread_local int g_recomputing = 0;

// Inside a CUDA graph capture the CUDA generator's state cannot be read or
// set (a captured kernel reads its seed and offset on the device at each
// replay); what can be read is how far the capture has moved the offset. A
// forward that moved it drew random numbers that a re-run in the captured
// backward could not draw again: refused. 0 outside capture or without CUDA.
uint64_t captured_rng_offset(const std::optional<c10::Device>& device) {
#ifdef DDP_WITH_CUDA
  if (!device) return 0;
  auto gen = at::cuda::detail::getDefaultCUDAGenerator(device->index());
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CUDAGeneratorImpl>()->philox_cuda_state(0).offset_intragraph_;
#else
  (void)device;
  return 0;
#endif
}

// The random and autocast state a forward ran in.
struct Ambient {
  at::Tensor cpu_rng;
  std::optional<c10::Device> cuda_device;
  at::Tensor cuda_rng;  // undefined when captured
  bool captured = false;  // the forward ran inside a CUDA graph capture
  compat::AutocastState cpu_autocast, cuda_autocast;

  static Ambient now(const std::vector<torch::Tensor>& inputs) {
    Ambient a;
    a.cpu_rng = at::detail::getDefaultCPUGenerator().get_state();
    for (const auto& x : inputs)
      if (x.defined() && x.is_cuda()) {
        a.cuda_device = x.device();
        break;
      }
    a.captured = a.cuda_device && compat::stream_capturing();
    if (a.cuda_device && !a.captured) a.cuda_rng = at::globalContext().defaultGenerator(*a.cuda_device).get_state();
    a.cpu_autocast = compat::autocast_state(c10::DeviceType::CPU);
    a.cuda_autocast = compat::autocast_state(c10::DeviceType::CUDA);
    return a;
  }
};

// Puts an Ambient in place for a scope and the previous one back after it,
// exceptions included.
class AmbientGuard {
 public:
  explicit AmbientGuard(const Ambient& a) : saved_(Ambient::now({})) {
    if (a.cuda_device && !a.captured) {
      cuda_gen_ = at::globalContext().defaultGenerator(*a.cuda_device);
      saved_cuda_rng_ = cuda_gen_->get_state();
      cuda_gen_->set_state(a.cuda_rng);
    }
    cpu_gen_.set_state(a.cpu_rng);
    compat::set_autocast_state(c10::DeviceType::CPU, a.cpu_autocast);
    compat::set_autocast_state(c10::DeviceType::CUDA, a.cuda_autocast);
    autocast_on_ = a.cpu_autocast.enabled || a.cuda_autocast.enabled;
    ++g_recomputing;
  }
  ~AmbientGuard() {
    --g_recomputing;
    // The re-run's autocast kept casts of the weights in its (thread-local)
    // cache, which would be stale once the optimizer changes the weights:
    // dropped, as the end of an autocast scope does.
    if (autocast_on_) at::autocast::clear_cache();
    cpu_gen_.set_state(saved_.cpu_rng);
    if (cuda_gen_) cuda_gen_->set_state(saved_cuda_rng_);
    compat::set_autocast_state(c10::DeviceType::CPU, saved_.cpu_autocast);
    compat::set_autocast_state(c10::DeviceType::CUDA, saved_.cuda_autocast);
  }
  AmbientGuard(const AmbientGuard&) = delete;
  AmbientGuard& operator=(const AmbientGuard&) = delete;

 private:
  Ambient saved_;
  bool autocast_on_ = false;
  at::Generator cpu_gen_ = at::detail::getDefaultCPUGenerator();
  std::optional<at::Generator> cuda_gen_;
  at::Tensor saved_cuda_rng_;
};

// What the backward needs beyond the saved inputs.
struct RecomputeState : torch::CustomClassHolder {
  RecomputeFn fn;
  std::vector<torch::Tensor> params, buffers;
  std::vector<char> input_needs_grad;
  Ambient ambient;
  // fn's outputs -> the node's (distinct) outputs: a tensor that fn returns
  // twice is one output of the node.
  std::vector<size_t> out_map;
  size_t num_distinct = 0;
};

std::vector<torch::Tensor> distinct(const std::vector<torch::Tensor>& outs, RecomputeState& st, bool record) {
  std::vector<torch::Tensor> unique;
  if (record) st.out_map.clear();
  for (size_t i = 0; i < outs.size(); ++i) {
    size_t k = unique.size();
    for (size_t j = 0; j < unique.size(); ++j)
      if (unique[j].is_same(outs[i])) k = j;
    if (k == unique.size()) unique.push_back(outs[i]);
    if (record) st.out_map.push_back(k);
  }
  if (record) st.num_distinct = unique.size();
  return unique;
}

// A leaf that the re-run's graph reaches but that recompute was not told
// about would get no gradient: say so.
void check_all_leaves_given(const std::vector<torch::Tensor>& outs, const std::vector<torch::Tensor>& targets) {
  std::unordered_set<const c10::TensorImpl*> given;
  for (const auto& t : targets) given.insert(t.unsafeGetTensorImpl());
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo;
  for (const auto& o : outs)
    if (o.grad_fn() && seen.insert(o.grad_fn().get()).second) todo.push_back(o.grad_fn().get());
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      check_user(given.count(acc->variable.unsafeGetTensorImpl()) > 0,
                 "recompute: the function reads a tensor that requires grad (shape " + c10::str(acc->variable.sizes()) +
                     ") which was passed neither as an input nor as a parameter, so its gradient would be lost.",
                 "pass every parameter the function uses in recompute()'s params (a module's parameters()).");
      continue;
    }
    for (const auto& e : node->next_edges())
      if (e.function && seen.insert(e.function.get()).second) todo.push_back(e.function.get());
  }
}

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<RecomputeState> st, at::TensorList inputs,
                                                at::TensorList params) {
    (void)params;  // inputs of the node, so that the graph reaches them
    std::vector<torch::Tensor> in(inputs.begin(), inputs.end());
    st->ambient = Ambient::now(in);
    const uint64_t offset = st->ambient.captured ? captured_rng_offset(st->ambient.cuda_device) : 0;
    auto outs = distinct(st->fn(in), *st, /*record=*/true);
    check_user(!st->ambient.captured || captured_rng_offset(st->ambient.cuda_device) == offset,
               "recompute: a recomputed part draws random numbers on the GPU (dropout, say) inside a CUDA graph "
               "capture, where its re-run in backward cannot draw the same ones.",
               "set its dropout to 0, or train without --cuda-graph.");
    ctx->save_for_backward(in);
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto st = c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> in;
    std::vector<torch::Tensor> targets;
    for (size_t i = 0; i < saved.size(); ++i) {
      in.push_back(saved[i].detach().requires_grad_(st->input_needs_grad[i] != 0));
      if (st->input_needs_grad[i]) targets.push_back(in.back());
    }
    const size_t num_input_targets = targets.size();
    for (const auto& p : st->params)
      if (p.requires_grad()) targets.push_back(p);

    std::vector<torch::Tensor> outs, kept;
    {
      torch::NoGradGuard no_grad_for_copies;
      for (const auto& b : st->buffers) kept.push_back(b.clone());
    }
    {
      torch::AutoGradMode grad(true);  // backward runs with it off
      AmbientGuard ambient(st->ambient);
      outs = distinct(st->fn(in), *st, /*record=*/false);
    }
    TORCH_CHECK(outs.size() == st->num_distinct, "recompute: the function returned ", outs.size(),
                " distinct tensors when re-run, ", st->num_distinct, " the first time");

    std::vector<torch::Tensor> diff_outs, diff_grads;
    for (size_t i = 0; i < outs.size(); ++i)
      if (outs[i].requires_grad() && grad_outputs[i].defined()) {
        diff_outs.push_back(outs[i]);
        diff_grads.push_back(grad_outputs[i]);
      }
    std::vector<torch::Tensor> grads(targets.size());
    if (!diff_outs.empty() && !targets.empty()) {
      check_all_leaves_given(diff_outs, targets);
      grads = torch::autograd::grad(diff_outs, targets, diff_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    }
    // The buffers as the first run left them (the re-run updated them
    // again); after the gradients, as the re-run's backward may have saved
    // them (batch norm does), and an in-place write would fail its check.
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < kept.size(); ++i) st->buffers[i].copy_(kept[i]);
    }
    // One gradient per forward argument: the state (none), the inputs, the parameters.
    torch::autograd::variable_list result{torch::Tensor()};
    size_t t = 0;
    for (size_t i = 0; i < saved.size(); ++i) result.push_back(st->input_needs_grad[i] ? grads[t++] : torch::Tensor());
    TORCH_INTERNAL_ASSERT(t == num_input_targets);
    for (const auto& p : st->params) result.push_back(p.requires_grad() ? grads[t++] : torch::Tensor());
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> recompute(const RecomputeFn& fn, const std::vector<torch::Tensor>& inputs,
                                     const std::vector<torch::Tensor>& params,
                                     const std::vector<torch::Tensor>& buffers) {
  bool any_grad = false;
  for (const auto& x : inputs) any_grad = any_grad || (x.defined() && x.requires_grad());
  for (const auto& p : params) any_grad = any_grad || p.requires_grad();
  if (!torch::GradMode::is_enabled() || !any_grad) return fn(inputs);
  for (const auto& x : inputs)
    check_user(x.defined(), "recompute: an input is an undefined tensor.", "pass only defined tensors as inputs.");
  auto st = c10::make_intrusive<RecomputeState>();
  st->fn = fn;
  st->params = params;
  st->buffers = buffers;
  for (const auto& x : inputs) st->input_needs_grad.push_back(x.requires_grad() ? 1 : 0);
  auto outs = RecomputeFunction::apply(st, at::TensorList(inputs), at::TensorList(params));
  std::vector<torch::Tensor> result;
  for (size_t k : st->out_map) result.push_back(outs[k]);
  return result;
}

torch::Tensor recompute_sequential(torch::nn::Sequential& seq, torch::Tensor x, int64_t every) {
  int64_t i = 0;
  for (auto& any : *seq) {
    if (every > 0 && i % every == 0) {
      auto run = [&any](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{any.forward(in[0])}; };
      x = recompute(run, {x}, any.ptr()->parameters(), any.ptr()->buffers())[0];
    } else {
      x = any.forward(x);
    }
    ++i;
  }
  return x;
}

bool is_recomputing() { return g_recomputing > 0; }

RecomputePolicy parse_recompute(const std::string& value) {
  RecomputePolicy p;
  if (value == "none") return p;
  if (value == "mlp") {
    p.kind = RecomputePolicy::Kind::kMlp;
    return p;
  }
  if (value == "stages") {
    p.kind = RecomputePolicy::Kind::kStages;
    return p;
  }
  const std::string blocks = "blocks";
  if (value.compare(0, blocks.size(), blocks) == 0) {
    p.kind = RecomputePolicy::Kind::kBlocks;
    if (value.size() == blocks.size()) return p;
    const std::string n = value.substr(blocks.size());
    char* end = nullptr;
    const long long every = n.size() > 1 && n[0] == ':' ? std::strtoll(n.c_str() + 1, &end, 10) : 0;
    if (end && *end == '\0' && every >= 1) {
      p.every = every;
      return p;
    }
  }
  throw UserError("--recompute " + value + " is not a recompute level.",
                  "use none, mlp (the MLP of each GPT block), blocks (every block), blocks:N (every N-th block) or "
                  "stages (each ResNet stage).");
}

}  // namespace ddp
