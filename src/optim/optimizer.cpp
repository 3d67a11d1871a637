// Fused optimizers. Each runs one threaded loop over contiguous ranges of the
// flat buffers (the CPU form of multi-tensor apply); the per-parameter weight
// decay flag splits the buffer into ranges, not into per-tensor passes.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/optim/optimizer.h"

namespace fusetrain::optim {
namespace {

int threads_or_default(int n) { return n > 0 ? n : omp_get_max_threads(); }

// Applies fn to [begin, end): serially for small ranges, else with the whole
// team (never a smaller team: libgomp allocates when team sizes change).
template <typename Fn>
void for_range(int64_t begin, int64_t end, int threads, Fn&& fn) {
  if (end - begin <= 65536 || threads <= 1) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) fn(i);
    return;
  }
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = begin; i < end; ++i) fn(i);
}

// The element loops are compiled for AVX-512, AVX2 and baseline x86-64 and chosen at load time by CPU
// (target_clones); the library itself is built for baseline x86-64. ThreadSanitizer builds keep one plain copy:
// g++ and clang both instrument the clones' load-time resolver, which then runs before TSan is up and crashes.
#ifdef FUSETRAIN_NO_TARGET_CLONES
#define FT_VECTOR_CLONES
#else
#define FT_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

FT_VECTOR_CLONES double squares(const float* __restrict g, int64_t n, int threads) {
  double sum = 0.0;
#pragma omp parallel for simd num_threads(threads) reduction(+ : sum) schedule(static)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(g[i]) * g[i];
  return sum;
}

// The AdamW constants of one step; `decay` is 1 for parameters without weight decay.
struct AdamWStep {
  float scale, decay, b1, b2, one_minus_b1, one_minus_b2, step_size, bias2_sqrt, eps;
};

// One element's AdamW update, in torch's single-tensor order of operations.
__attribute__((always_inline)) inline void adamw_element(float* __restrict p, const float* __restrict g,
                                                         float* __restrict m, float* __restrict v, int64_t i,
                                                         const AdamWStep& c) {
  const float grad = g[i] * c.scale;
  const float mi = m[i] * c.b1 + c.one_minus_b1 * grad;
  const float vi = v[i] * c.b2 + c.one_minus_b2 * grad * grad;
  m[i] = mi;
  v[i] = vi;
  p[i] = p[i] * c.decay - c.step_size * (mi / (std::sqrt(vi) / c.bias2_sqrt + c.eps));
}

// AdamW over elements [begin, end) of the flat buffers: serially for small ranges, else with the whole team. With
// `zero`, each gradient is set to 0 once read: the next step's accumulation starts from zero without a pass of its
// own over the buffer.
FT_VECTOR_CLONES void adamw_range(float* __restrict p, float* __restrict g, float* __restrict m, float* __restrict v,
                                  int64_t begin, int64_t end, const AdamWStep& k, int threads, bool zero) {
  const AdamWStep c = k;
  const bool serial = end - begin <= 65536 || threads <= 1;
  if (serial && zero) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      adamw_element(p, g, m, v, i, c);
      g[i] = 0.0f;
    }
  } else if (serial) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) adamw_element(p, g, m, v, i, c);
  } else if (zero) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = begin; i < end; ++i) {
      adamw_element(p, g, m, v, i, c);
      g[i] = 0.0f;
    }
  } else {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = begin; i < end; ++i) adamw_element(p, g, m, v, i, c);
  }
}

}  // namespace

double sum_of_squares(const float* data, int64_t n, int num_threads) {
  return n > 0 ? squares(data, n, threads_or_default(num_threads)) : 0.0;
}

double grad_norm(const runtime::ParameterStore& params, int num_threads) {
  // padding between slots is always zero
  return std::sqrt(squares(params.grads_data(), params.flat_numel(), threads_or_default(num_threads)));
}

double clip_grad_norm(runtime::ParameterStore& params, double max_norm, int num_threads) {
  double norm = grad_norm(params, num_threads);
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    float* g = params.grads_data();
    const int64_t n = params.flat_numel();
    const float c = static_cast<float>(coef);
#pragma omp parallel for simd num_threads(threads_or_default(num_threads)) schedule(static)
    for (int64_t i = 0; i < n; ++i) g[i] *= c;
  }
  return norm;
}

AdamW::AdamW(runtime::ParameterStore& params, AdamWConfig config, Shard shard)
    : params_(params), config_(config), segments_(std::move(shard.segments)), grads_(shard.grads) {
  if (segments_.empty()) segments_.push_back({0, params.flat_numel()});
  for (const Segment& s : segments_) {
    FT_CHECK(s.begin >= 0 && s.begin <= s.end && s.end <= params.flat_numel(), "AdamW: the segment [", s.begin, ", ",
             s.end, ") is not within the ", params.flat_numel(), " elements of the parameters");
    offsets_.push_back(numel_);
    numel_ += s.end - s.begin;
  }
  m_ = aligned_allocate(static_cast<size_t>(std::max<int64_t>(numel_, 1)) * sizeof(float));
  v_ = aligned_allocate(static_cast<size_t>(std::max<int64_t>(numel_, 1)) * sizeof(float));
  FT_CHECK(config.lr >= 0, "AdamW: learning rate must be >= 0, found ", config.lr);
  FT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "AdamW: betas must be in [0, 1), found (", config.beta1, ", ", config.beta2, ")");
  FT_CHECK(config.eps >= 0, "AdamW: eps must be >= 0, found ", config.eps);
  FT_CHECK(config.weight_decay >= 0, "AdamW: weight_decay must be >= 0, found ", config.weight_decay);
}

double AdamW::grad_sum_of_squares() const {
  const int threads = threads_or_default(num_threads_);
  if (grads_) return numel_ > 0 ? squares(grads_, numel_, threads) : 0.0;
  double sum = 0;
  for (const Segment& s : segments_)
    if (s.end > s.begin) sum += squares(params_.grads_data() + s.begin, s.end - s.begin, threads);
  return sum;
}

void AdamW::step(double grad_scale, double lr) {
  ++step_count_;
  if (lr < 0) lr = config_.lr;
  const double bias1 = 1.0 - std::pow(config_.beta1, static_cast<double>(step_count_));
  const double bias2 = 1.0 - std::pow(config_.beta2, static_cast<double>(step_count_));
  // Same order of operations as torch's single-tensor AdamW, in f32.
  const float step_size = static_cast<float>(lr / bias1);
  const float bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  AdamWStep k{};
  k.b1 = static_cast<float>(config_.beta1);
  k.b2 = static_cast<float>(config_.beta2);
  k.one_minus_b1 = static_cast<float>(1.0 - config_.beta1);
  k.one_minus_b2 = static_cast<float>(1.0 - config_.beta2);
  k.eps = static_cast<float>(config_.eps);
  k.scale = static_cast<float>(grad_scale);
  k.step_size = step_size;
  k.bias2_sqrt = bias2_sqrt;
  const float decay = static_cast<float>(1.0 - lr * config_.weight_decay);
  const int threads = threads_or_default(num_threads_);
  // Consecutive slots with the same decay flag form one range: one loop per run of slots, not per tensor.
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  // Each segment's elements are indexed by their place in the moments: element o + k of m, v (and of the shard's
  // gradients) is flat element begin + k, so the parameter and store-gradient pointers are shifted by begin - o.
  for (size_t seg = 0; seg < segments_.size(); ++seg) {
    const Segment& s = segments_[seg];
    const int64_t o = offsets_[seg];
    float* p = params_.params_data() + (s.begin - o);
    float* g = grads_ ? const_cast<float*>(grads_) : params_.grads_data() + (s.begin - o);
    for (size_t first = 0; first < slots.size();) {
      size_t last = first;
      while (last + 1 < slots.size() && slots[last + 1].weight_decay == slots[first].weight_decay) ++last;
      k.decay = slots[first].weight_decay ? decay : 1.0f;
      const int64_t lo = std::max(slots[first].offset, s.begin);
      const int64_t hi = std::min(slots[last].offset + slots[last].numel, s.end);
      if (lo < hi)
        adamw_range(p, g, exp_avg(), exp_avg_sq(), o + (lo - s.begin), o + (hi - s.begin), k, threads,
                    zero_grads_ && grads_ == nullptr);
      first = last + 1;
    }
  }
}

double AdamW::clip_and_step_if_finite(double max_norm, double lr, double grad_scale) {
  return clip_and_step_if_finite_with_norm(std::sqrt(grad_sum_of_squares()), max_norm, lr, grad_scale);
}

double AdamW::clip_and_step_if_finite_with_norm(double unscaled_norm, double max_norm, double lr, double grad_scale) {
  double norm = unscaled_norm * grad_scale;  // inf or NaN when any gradient is
  if (!std::isfinite(norm)) return norm;
  double clip = 1.0;
  if (max_norm > 0) clip = std::min(1.0, max_norm / (norm + 1e-6));
  step(grad_scale * clip, lr);
  return norm;
}

double AdamW::clip_and_step(double max_norm, double lr, double grad_scale) {
  double norm = std::sqrt(grad_sum_of_squares()) * grad_scale;
  double clip = 1.0;
  if (max_norm > 0) clip = std::min(1.0, max_norm / (norm + 1e-6));
  step(grad_scale * clip, lr);
  return norm;
}

Sgd::Sgd(runtime::ParameterStore& params, SgdConfig config)
    : params_(params), config_(config), b_(aligned_allocate(static_cast<size_t>(params.flat_numel()) * sizeof(float))) {
  FT_CHECK(config.lr >= 0, "SGD: learning rate must be >= 0, found ", config.lr);
  FT_CHECK(config.momentum >= 0, "SGD: momentum must be >= 0, found ", config.momentum);
  FT_CHECK(!config.nesterov || (config.momentum > 0 && config.dampening == 0),
           "SGD: nesterov needs momentum > 0 and dampening == 0");
}

void Sgd::step(double grad_scale, double lr) {
  ++step_count_;
  if (lr < 0) lr = config_.lr;
  const float lr_f = static_cast<float>(lr), mu = static_cast<float>(config_.momentum);
  const float damp = static_cast<float>(1.0 - config_.dampening), wd = static_cast<float>(config_.weight_decay);
  const float scale = static_cast<float>(grad_scale);
  const bool first = step_count_ == 1, use_momentum = config_.momentum != 0, nesterov = config_.nesterov;
  float* p = params_.params_data();
  float* g = params_.grads_data();
  float* b = momentum_buffer();
  const int threads = threads_or_default(num_threads_);
  for (const runtime::ParamSlot& slot : params_.slots()) {
    const int64_t begin = slot.offset, end = slot.offset + slot.numel;
    const float slot_wd = slot.weight_decay ? wd : 0.0f;
    auto update = [&](int64_t i) {
      float grad = g[i] * scale + slot_wd * p[i];
      if (use_momentum) {
        float buf = first ? grad : mu * b[i] + damp * grad;
        b[i] = buf;
        grad = nesterov ? grad + mu * buf : buf;
      }
      p[i] -= lr_f * grad;
    };
    for_range(begin, end, threads, update);
  }
}

}  // namespace fusetrain::optim
