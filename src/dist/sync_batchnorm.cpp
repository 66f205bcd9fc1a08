// BatchNorm with optional global-batch statistics and its exact backward.

#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/dist/sync_batchnorm.h"

#include <atomic>

#include "ddp/error.h"
#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/batch_norm_nhwc.h"
#endif

namespace ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Shape {1, C, 1, ...} to broadcast a per-channel vector against the input.
std::vector<int64_t> channel_shape(const torch::Tensor& x) {
  std::vector<int64_t> s(static_cast<size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

std::vector<int64_t> reduce_dims(const torch::Tensor& x) {
  std::vector<int64_t> d{0};
  for (int64_t i = 2; i < x.dim(); ++i) d.push_back(i);
  return d;
}

// Forward: each rank contributes (count, mean, M2) per channel; they are
// combined with Chan's parallel formula, which stays accurate when the mean
// is large against the spread (sum/sum-of-squares would cancel). Gathering is
// an all-reduce of a zero matrix in which each rank fills its own row.
// Statistics accumulate in double, as LibTorch's own CPU batch norm does, so
// that N ranks track one rank's arithmetic as closely as summation order
// allows. Backward: the two per-channel sums the input gradient needs are
// summed over ranks; the weight and bias gradients stay local, because
// gradient sync averages them afterwards, like every other parameter's.
struct SyncBatchNormFn : torch::autograd::Function<SyncBatchNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               torch::Tensor bias, torch::Tensor running_mean,
                               torch::Tensor running_var, double eps, double momentum,
                               World* world) {
    const auto dims = reduce_dims(x);
    const auto shape = channel_shape(x);
    const int64_t C = x.size(1);
    auto xd = x.to(torch::kDouble);
    const double n_local = static_cast<double>(x.numel() / std::max<int64_t>(C, 1));
    auto row = torch::zeros({2 * C + 1}, xd.options());
    if (n_local > 0) {
      auto mean_l = xd.mean(dims);
      row[0] = n_local;
      row.narrow(0, 1, C).copy_(mean_l);
      row.narrow(0, 1 + C, C).copy_((xd - mean_l.view(shape)).pow(2).sum(dims));
    }
    auto table = torch::zeros({world->size(), 2 * C + 1}, xd.options());
    table[world->rank()].copy_(row);
    world->all_reduce(table, "SyncBatchNorm statistics");
    auto counts = table.select(1, 0).unsqueeze(1);  // W x 1
    auto means = table.narrow(1, 1, C);
    auto m2s = table.narrow(1, 1 + C, C);
    auto n = counts.sum();
    const double n_total = n.item<double>();
    TORCH_CHECK(n_total > 0, "SyncBatchNorm: the global batch is empty");
    auto mean = (counts * means).sum(0) / n;
    auto m2 = (m2s + counts * (means - mean).pow(2)).sum(0);
    auto invstd = (m2 / n + eps).rsqrt();

    if (running_mean.defined()) {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
      auto unbiased = n_total > 1 ? m2 / (n_total - 1) : m2 / n;
      running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
    }

    // y = x * alpha + beta, per channel.
    auto alpha = weight.defined() ? invstd * weight.to(torch::kDouble) : invstd;
    auto beta = (weight.defined() ? bias.to(torch::kDouble) : torch::zeros_like(mean)) - mean * alpha;
    auto y = x * alpha.to(x.scalar_type()).view(shape) + beta.to(x.scalar_type()).view(shape);
    ctx->save_for_backward({x, weight, mean, invstd});
    ctx->saved_data["n"] = n_total;
    ctx->saved_data["world"] = reinterpret_cast<int64_t>(world);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto x = saved[0], weight = saved[1], mean = saved[2], invstd = saved[3];
    auto* world = reinterpret_cast<World*>(ctx->saved_data["world"].toInt());
    const double n = ctx->saved_data["n"].toDouble();
    const auto dims = reduce_dims(x);
    const auto shape = channel_shape(x);
    const int64_t C = x.size(1);

    auto dy = grads[0].to(torch::kDouble);
    auto xhat = (x.to(torch::kDouble) - mean.view(shape)) * invstd.view(shape);
    auto sum_dy = dy.sum(dims);
    auto sum_dy_xhat = (dy * xhat).sum(dims);
    auto both = torch::cat({sum_dy, sum_dy_xhat});
    world->all_reduce(both, "SyncBatchNorm backward");
    auto g_sum_dy = both.narrow(0, 0, C), g_sum_dy_xhat = both.narrow(0, C, C);

    auto scale = weight.defined() ? invstd * weight.to(torch::kDouble) : invstd;
    auto dx = scale.view(shape) *
              (dy - (g_sum_dy / n).view(shape) - xhat * (g_sum_dy_xhat / n).view(shape));
    torch::Tensor dw, db;
    if (weight.defined()) {
      dw = sum_dy_xhat.to(weight.scalar_type());
      db = sum_dy.to(weight.scalar_type());
    }
    return {dx.to(x.scalar_type()), dw, db, torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

std::atomic<bool> g_nhwc_kernels{true};   // use_nhwc_batchnorm_kernels()
std::atomic<bool> g_fused_relu{true};     // use_fused_batchnorm_relu()
std::atomic<bool> g_split_output{true};   // use_split_residual_output()

#ifdef DDP_WITH_CUDA_KERNELS
// Local (unsynced) training statistics through ddptrain's NHWC kernels,
// optionally followed by a ReLU in the same pass. (Two Functions, with and
// without the residual, because autograd takes no undefined tensor input.)
//
// What backward keeps, and why (peak memory is at the start of backward,
// when every saved activation is alive):
//  - x, always (both gradient passes read it).
//  - relu without residual: not y. The mask is recomputed from x and the
//    forward's scale/shift (a [2, C] fp32 view), so y lives only as long as
//    its consumers keep it; the stem's max pool, for one, keeps only uint8
//    argmax offsets, and its 112x112x64 input is then freed after forward.
//  - relu with residual: y, for the mask (recomputing it would need the
//    residual kept instead; y is kept by the next block anyway).
struct NhwcBatchNormFn : torch::autograd::Function<NhwcBatchNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                               torch::Tensor running_mean, torch::Tensor running_var, double eps, double momentum,
                               bool relu) {
    auto out = cuda::bn_nhwc_forward(x, weight, bias, running_mean, running_var, momentum, eps, {}, relu);
    ctx->save_for_backward({x, weight, out[1], out[2], relu ? out[3] : torch::Tensor()});
    return out[0];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    // No shortcut here, so no caller for dz: the ReLU path writes none.
    auto g = s[4].defined() ? cuda::bn_nhwc_relu_backward(grads[0], s[0], s[1], s[2], s[3], s[4])
                            : cuda::bn_nhwc_backward(grads[0], s[0], s[1], s[2], s[3]);
    return {g[0], g[1], g[2], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// relu(bn(x) + residual). dz, the masked gradient, is the residual's.
// With `split`, y is returned twice, {y, a view of y}, for an output with
// two consumers (a residual block's output: the next block's convolution
// and its shortcut): autograd would add their two gradients in a pass of
// its own; as two outputs of one node, both arrive here and the kernels add
// them as they read them (the same bits).
struct NhwcBatchNormAddReluFn : torch::autograd::Function<NhwcBatchNormAddReluFn> {
  static variable_list forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                               torch::Tensor residual, torch::Tensor running_mean, torch::Tensor running_var,
                               double eps, double momentum, bool split) {
    auto out = cuda::bn_nhwc_forward(x, weight, bias, running_mean, running_var, momentum, eps, residual, true);
    ctx->save_for_backward({x, weight, out[1], out[2], out[0]});
    if (!split) return {out[0]};
    return {out[0], out[0].view_as(out[0])};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    // The shortcut needs dz only when its input requires a gradient.
    const bool need_dz = ctx->needs_input_grad(3);
    const auto second = grads.size() > 1 ? grads[1] : torch::Tensor();
    auto g = cuda::bn_nhwc_backward(grads[0], s[0], s[1], s[2], s[3], s[4], need_dz, second);
    return {g[0], g[1], g[2], g[3], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

bool nhwc_kernels_apply(const torch::Tensor& x, const BatchNormImpl& bn) {
  return g_nhwc_kernels.load() && bn.options.affine() && bn.options.track_running_stats() &&
         bn.weight.scalar_type() == torch::kFloat && bn.running_mean.scalar_type() == torch::kFloat &&
         cuda::bn_nhwc_supported(x);
}
#endif

}  // namespace

void use_nhwc_batchnorm_kernels(bool on) { g_nhwc_kernels.store(on); }
void use_fused_batchnorm_relu(bool on) { g_fused_relu.store(on); }
void use_split_residual_output(bool on) { g_split_output.store(on); }

bool have_nhwc_batchnorm_kernels() {
#ifdef DDP_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

BatchNormImpl::BatchNormImpl(BatchNormOptions options_) : options(std::move(options_)) { reset(); }

void BatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::ones({c}));
    bias = register_parameter("bias", torch::zeros({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }
}

void BatchNormImpl::share_tensors_of(const torch::nn::Module& other) {
  // Parameters: the same tensors. Buffers (Module keeps its registry of
  // them private): the same storage, which their in-place updates share.
  auto take = [&](auto& mine, const torch::OrderedDict<std::string, torch::Tensor>& theirs, bool same_tensor) {
    for (const auto& item : theirs) {
      auto* slot = mine.find(item.key());
      TORCH_CHECK(slot != nullptr && slot->defined() && slot->sizes() == item.value().sizes() &&
                      slot->scalar_type() == item.value().scalar_type(),
                  "BatchNorm::share_tensors_of: '", item.key(), "' ", item.value().sizes(), " has no match here");
      if (same_tensor) *slot = item.value();
      else slot->set_data(item.value());
    }
  };
  take(parameters_, other.named_parameters(/*recurse=*/false), true);
  auto buffers = named_buffers(/*recurse=*/false);
  take(buffers, other.named_buffers(/*recurse=*/false), false);
  auto* w = parameters_.find("weight");
  auto* b = parameters_.find("bias");
  weight = w ? *w : torch::Tensor();
  bias = b ? *b : torch::Tensor();
  train(other.is_training());
}

void BatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::BatchNorm" << options.dim() << "d(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=" << options.momentum()
         << (options.relu() ? ", relu" : "") << (synced() ? ", synced" : "") << ")";
}

void BatchNormImpl::check_input(const torch::Tensor& input) const {
  const int d = options.dim();
  const bool rank_ok = d == 1 ? (input.dim() == 2 || input.dim() == 3) : input.dim() == d + 2;
  check_user(rank_ok, "BatchNorm" + std::to_string(d) + "d got a " + std::to_string(input.dim()) +
                          "-D input " + c10::str(input.sizes()) + ".",
             "the layer before it produces the wrong shape; check the model's input size.");
  check_user(input.size(1) == options.num_features(),
             "BatchNorm expected " + std::to_string(options.num_features()) + " channels, got " +
                 std::to_string(input.size(1)) + " (input " + c10::str(input.sizes()) + ").",
             "the model's channel counts do not match its data.");
}

torch::Tensor BatchNormImpl::forward(const torch::Tensor& input) {
  return options.relu() ? forward_relu(input) : normalize(input);
}

torch::Tensor BatchNormImpl::normalize(const torch::Tensor& input) {
  check_input(input);
  const bool use_batch_stats = is_training() || !options.track_running_stats();
  if (is_training() && options.track_running_stats()) num_batches_tracked.add_(1);
  // Only training communicates, as in PyTorch: in eval the ranks may run
  // different numbers of batches, and batch statistics there (no running
  // statistics kept) are each batch's own.
  if (is_training() && synced()) {
    return SyncBatchNormFn::apply(input, weight, bias,
                                  is_training() ? running_mean : torch::Tensor(),
                                  is_training() ? running_var : torch::Tensor(), options.eps(),
                                  options.momentum(), world_);
  }
#ifdef DDP_WITH_CUDA_KERNELS
  if (is_training() && nhwc_kernels_apply(input, *this))
    return NhwcBatchNormFn::apply(input, weight, bias, running_mean, running_var, options.eps(), options.momentum(),
                                  false);
#endif
  return torch::batch_norm(input, weight, bias, running_mean, running_var, use_batch_stats,
                           options.momentum(), options.eps(), at::globalContext().userEnabledCuDNN());
}

bool BatchNormImpl::fused_relu_applies(const torch::Tensor& input, const torch::Tensor& residual) const {
#ifdef DDP_WITH_CUDA_KERNELS
  return is_training() && !synced() && g_fused_relu.load() && nhwc_kernels_apply(input, *this) &&
         (!residual.defined() || (residual.scalar_type() == input.scalar_type() &&
                                  residual.sizes() == input.sizes() && cuda::bn_nhwc_supported(residual)));
#else
  (void)input, (void)residual;
  return false;
#endif
}

std::pair<torch::Tensor, torch::Tensor> BatchNormImpl::forward_relu_split(const torch::Tensor& input,
                                                                          const torch::Tensor& residual) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (residual.defined() && g_split_output.load() && fused_relu_applies(input, residual)) {
    check_input(input);
    if (options.track_running_stats()) num_batches_tracked.add_(1);
    auto out = NhwcBatchNormAddReluFn::apply(input, weight, bias, residual, running_mean, running_var,
                                             options.eps(), options.momentum(), /*split=*/true);
    return {out[0], out[1]};
  }
#endif
  auto y = forward_relu(input, residual);
  return {y, y};
}

torch::Tensor BatchNormImpl::forward_relu(const torch::Tensor& input, const torch::Tensor& residual) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (fused_relu_applies(input, residual)) {
    check_input(input);
    if (options.track_running_stats()) num_batches_tracked.add_(1);
    if (residual.defined())
      return NhwcBatchNormAddReluFn::apply(input, weight, bias, residual, running_mean, running_var, options.eps(),
                                           options.momentum(), /*split=*/false)[0];
    return NhwcBatchNormFn::apply(input, weight, bias, running_mean, running_var, options.eps(), options.momentum(),
                                  true);
  }
#endif
  auto y = normalize(input);
  return torch::relu(residual.defined() ? y + residual : y);
}

int convert_sync_batchnorm(torch::nn::Module& module, World& world) {
  int converted = 0;
  for (const auto& item : module.named_modules()) {
    auto& m = *item.value();
    if (auto* bn = dynamic_cast<BatchNormImpl*>(&m)) {
      bn->set_world(&world);
      ++converted;
    } else if (dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m) ||
               dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m) ||
               dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m)) {
      throw UserError("module '" + item.key() + "' is a torch::nn::BatchNorm, which cannot be synchronised in place.",
                      "build the model with ddp::BatchNorm2d (same parameters and names), or pass --sync-bn off.");
    }
  }
  return converted;
}

}  // namespace ddp
