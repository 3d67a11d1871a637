// The optimizer interface and AdamW. An elementwise update is one Device operation per run of same-decay slots
// (Device::optimizer_update: on the CPU one threaded loop over contiguous ranges of the flat buffers, the CPU form of
// multi-tensor apply); the per-parameter weight decay flag splits the buffer into ranges, not per-tensor passes.
#include <algorithm>
#include <cmath>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/optim/optimizer.h"
#include "core/loops.h"

namespace fusetrain::optim {
namespace {

kernels::StepContext with_threads(int num_threads) {
  kernels::StepContext ctx;
  ctx.num_threads = threads_or_default(num_threads);
  return ctx;
}

}  // namespace

double grad_norm(const runtime::ParameterStore& params, int num_threads) {
  // padding between slots is always zero
  return std::sqrt(params.device().sum_of_squares(params.grads_data(), params.flat_numel(), with_threads(num_threads)));
}

double clip_grad_norm(runtime::ParameterStore& params, double max_norm, int num_threads) {
  double norm = grad_norm(params, num_threads);
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0)
    params.device().scale(params.grads_data(), static_cast<float>(coef), params.flat_numel(),
                          with_threads(num_threads));
  return norm;
}

Optimizer::Optimizer(runtime::ParameterStore& params, Shard shard, double lr)
    : params_(params), segments_(std::move(shard.segments)), grads_(shard.grads), lr_(lr) {
  if (segments_.empty()) segments_.push_back({0, params.flat_numel()});
  for (const Segment& s : segments_) {
    FT_CHECK(s.begin >= 0 && s.begin <= s.end && s.end <= params.flat_numel(), "optimizer: the segment [", s.begin,
             ", ", s.end, ") is not within the ", params.flat_numel(), " elements of the parameters");
    offsets_.push_back(numel_);
    numel_ += s.end - s.begin;
  }
  set_lr(lr);
}

void Optimizer::set_lr(double lr) {
  FT_CHECK(std::isfinite(lr) && lr >= 0, "optimizer: the learning rate must be finite and >= 0, found ", lr);
  lr_ = lr;
}

std::vector<Optimizer::SlotPart> Optimizer::slot_parts(size_t i) const {
  const runtime::ParamSlot& slot = params_.slots().at(i);
  std::vector<SlotPart> out;
  for (size_t seg = 0; seg < segments_.size(); ++seg) {
    const Segment& s = segments_[seg];
    const int64_t lo = std::max(slot.offset, s.begin), hi = std::min(slot.offset + slot.numel, s.end);
    if (lo >= hi) continue;
    // Element k of the slot is flat element slot.offset + k: the shard's gradients hold flat element e at
    // offsets_[seg] + (e - s.begin).
    float* g = grads_ ? const_cast<float*>(grads_) + offsets_[seg] + (slot.offset - s.begin)
                      : params_.grads_data() + slot.offset;
    out.push_back({lo - slot.offset, hi - slot.offset, g});
  }
  return out;
}

kernels::OptimizerUpdate Optimizer::step_update(kernels::OptimizerUpdate::Kind kind, double grad_scale,
                                                double lr) const {
  kernels::OptimizerUpdate u;
  u.kind = kind;
  u.grad_scale = static_cast<float>(grad_scale);
  u.lr = static_cast<float>(lr);
  return u;
}

void Optimizer::run_update(const kernels::OptimizerUpdate& update) const {
  const kernels::StepContext ctx = with_threads(num_threads_);
  const kernels::Device& device = params_.device();
  for_each_run([&](const Run& r) {
    device.optimizer_update(update, {r.p, r.g, r.begin, r.end, r.decay, r.zero}, ctx);
  });
}

int Optimizer::threads() const { return threads_or_default(num_threads_); }

kernels::DeviceBuffer Optimizer::allocate_state() const {
  return params_.device().allocate(static_cast<size_t>(std::max<int64_t>(numel_, 1)) * sizeof(float));
}

size_t Optimizer::state_bytes() const {
  size_t bytes = 0;
  for (const StateBuffer& s : states()) bytes += static_cast<size_t>(s.numel) * dtype_size(s.dtype);
  return bytes;
}

double Optimizer::grad_sum_of_squares() const {
  const kernels::StepContext ctx = with_threads(num_threads_);
  const kernels::Device& device = params_.device();
  if (grads_) return device.sum_of_squares(grads_, numel_, ctx);
  double sum = 0;
  for (const Segment& s : segments_) sum += device.sum_of_squares(params_.grads_data() + s.begin, s.end - s.begin, ctx);
  return sum;
}

void Optimizer::step(double grad_scale, double lr) {
  ++step_count_;
  update(grad_scale, lr < 0 ? lr_ : lr);
}

double Optimizer::clip_and_step(double max_norm, double lr, double grad_scale) {
  return clip_and_step_with_norm(std::sqrt(grad_sum_of_squares()), max_norm, lr, grad_scale);
}

double Optimizer::clip_and_step_with_norm(double unscaled_norm, double max_norm, double lr, double grad_scale) {
  const double norm = unscaled_norm * grad_scale;  // inf or NaN when any gradient is
  if (!std::isfinite(norm)) return norm;
  double clip = 1.0;
  if (max_norm > 0) clip = std::min(1.0, max_norm / (norm + 1e-6));  // torch.nn.utils.clip_grad_norm_'s
  step(grad_scale * clip, lr);
  return norm;
}

AdamW::AdamW(runtime::ParameterStore& params, AdamWConfig config, Shard shard)
    : Optimizer(params, std::move(shard), config.lr), config_(config), m_(allocate_state()), v_(allocate_state()) {
  FT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "AdamW: betas must be in [0, 1), found (", config.beta1, ", ", config.beta2, ")");
  FT_CHECK(config.eps >= 0, "AdamW: eps must be >= 0, found ", config.eps);
  FT_CHECK(config.weight_decay >= 0, "AdamW: weight_decay must be >= 0, found ", config.weight_decay);
}

std::vector<StateBuffer> AdamW::states() const {
  return {elementwise_state("exp_avg", exp_avg()), elementwise_state("exp_avg_sq", exp_avg_sq())};
}

void AdamW::update(double grad_scale, double lr) {
  const double t = static_cast<double>(step_count());
  const double bias1 = 1.0 - std::pow(config_.beta1, t);
  const double bias2 = 1.0 - std::pow(config_.beta2, t);
  // Same order of operations as torch's single-tensor AdamW, in f32.
  kernels::OptimizerUpdate u = step_update(kernels::OptimizerUpdate::Kind::AdamW, grad_scale, lr);
  u.beta1 = static_cast<float>(config_.beta1);
  u.beta2 = static_cast<float>(config_.beta2);
  u.one_minus_beta1 = static_cast<float>(1.0 - config_.beta1);
  u.one_minus_beta2 = static_cast<float>(1.0 - config_.beta2);
  u.eps = static_cast<float>(config_.eps);
  u.step_size = static_cast<float>(lr / bias1);
  u.bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  u.decay_factor = static_cast<float>(1.0 - lr * config_.weight_decay);
  u.state[0] = exp_avg();
  u.state[1] = exp_avg_sq();
  run_update(u);
}

}  // namespace fusetrain::optim
