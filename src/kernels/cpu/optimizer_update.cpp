// The elementwise optimizer updates of the CPU devices: one fused pass over a span of the flat buffers, each in the
// order of operations of the implementation it reproduces (torch.optim's single-tensor loops, bitsandbytes' CPU
// kernels), in f32.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/clones.h"
#include "core/loops.h"
#include "fusetrain/core/error.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {
namespace {

float sign(float u) { return static_cast<float>((u > 0.0f) - (u < 0.0f)); }

// The AdamW constants of one span; `decay` is 1 for parameters without weight decay.
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

// AdamW over elements [begin, end): serially for small ranges, else with the whole team. With `zero`, each gradient
// is set to 0 once read.
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

// The loop of the other updates: element(p, i, grad, decay) for every element of the span, grad = g[i]·grad_scale
// read once (and g[i] zeroed when asked).
template <typename Element>
void for_each_element(const OptimizerUpdate& u, const OptimizerSpan& s, int threads, Element&& element) {
  const float scale = u.grad_scale;
  float* p = s.p;
  float* g = s.g;
  const bool zero = s.zero_grads, decay = s.decay;
  for_range(s.begin, s.end, threads, [&](int64_t i) {
    const float grad = g[i] * scale;
    if (zero) g[i] = 0.0f;
    element(p, i, grad, decay);
  });
}

void sgd(const OptimizerUpdate& u, const OptimizerSpan& s, int threads) {
  const float lr = u.lr, mu = u.momentum, damp = u.one_minus_dampening, wd = u.weight_decay;
  const bool first = u.first_step, use_momentum = u.state[0] != nullptr, nesterov = u.nesterov;
  float* b = u.state[0];
  for_each_element(u, s, threads, [&](float* p, int64_t i, float grad, bool decay) {
    grad = grad + (decay ? wd : 0.0f) * p[i];
    if (use_momentum) {
      const float buf = first ? grad : mu * b[i] + damp * grad;
      b[i] = buf;
      grad = nesterov ? grad + mu * buf : buf;
    }
    p[i] -= lr * grad;
  });
}

void rmsprop(const OptimizerUpdate& u, const OptimizerSpan& s, int threads) {
  const float wd = u.weight_decay, alpha = u.beta2, one_minus_alpha = u.one_minus_beta2;
  const float eps = u.eps, mu = u.momentum, neg_lr = -u.lr;
  float* sq = u.state[0];
  float* buf = u.state[1];
  float* ga = u.state[2];
  const bool centered = ga != nullptr, momentum = buf != nullptr;
  for_each_element(u, s, threads, [&](float* p, int64_t i, float grad, bool decay) {
    if (decay && wd != 0.0f) grad = grad + wd * p[i];
    const float sv = sq[i] * alpha + one_minus_alpha * grad * grad;
    sq[i] = sv;
    float avg;
    if (centered) {
      const float m = ga[i] + one_minus_alpha * (grad - ga[i]);  // torch's lerp for a weight below 0.5
      ga[i] = m;
      avg = std::sqrt(sv + -1.0f * m * m);
    } else {
      avg = std::sqrt(sv);
    }
    avg = avg + eps;
    if (momentum) {
      const float bi = buf[i] * mu + grad / avg;
      buf[i] = bi;
      p[i] = p[i] + neg_lr * bi;
    } else {
      p[i] = p[i] + neg_lr * (grad / avg);
    }
  });
}

void adagrad(const OptimizerUpdate& u, const OptimizerSpan& s, int threads) {
  const float wd = u.weight_decay, eps = u.eps, neg_clr = -u.lr;
  float* sum = u.state[0];
  for_each_element(u, s, threads, [&](float* p, int64_t i, float grad, bool decay) {
    if (decay && wd != 0.0f) grad = grad + wd * p[i];
    const float sv = sum[i] + grad * grad;
    sum[i] = sv;
    p[i] = p[i] + neg_clr * (grad / (std::sqrt(sv) + eps));
  });
}

void lion(const OptimizerUpdate& u, const OptimizerSpan& s, int threads) {
  const float decay = u.decay_factor, b1 = u.beta1, one_minus_b1 = u.one_minus_beta1;
  const float b2 = u.beta2, one_minus_b2 = u.one_minus_beta2, neg_lr = -u.lr;
  float* m = u.state[0];
  for_each_element(u, s, threads, [&](float* p, int64_t i, float grad, bool decayed) {
    const float v = m[i] * b1 + one_minus_b1 * grad;
    p[i] = p[i] * (decayed ? decay : 1.0f) + neg_lr * sign(v);
    m[i] = m[i] * b2 + one_minus_b2 * grad;
  });
}

// bitsandbytes' 32-bit AdamW: p ·= 1 − lr·wd; p += −step_size · m / (√v + eps), the constants folding √(1 − β2ᵗ).
void adamw_bnb(const OptimizerUpdate& u, const OptimizerSpan& s, int threads) {
  const float b1 = u.beta1, b2 = u.beta2, one_minus_b1 = u.one_minus_beta1, one_minus_b2 = u.one_minus_beta2;
  const float decay = u.decay_factor, neg_step = -u.step_size, eps = u.eps;
  float* m = u.state[0];
  float* v = u.state[1];
  for_each_element(u, s, threads, [&](float* p, int64_t i, float grad, bool decayed) {
    const float mi = m[i] * b1 + one_minus_b1 * grad;
    const float vi = v[i] * b2 + one_minus_b2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float pi = decayed ? p[i] * decay : p[i];
    p[i] = pi + neg_step * (mi / (std::sqrt(vi) + eps));
  });
}

// The decision boundaries of a sorted code map: bounds[i] is the midpoint of codes i and i + 1, bounds[255] +inf.
void code_bounds(const float* code, float* bounds) {
  for (int i = 0; i + 1 < 256; ++i) bounds[i] = (code[i] + code[i + 1]) / 2.0f;
  bounds[255] = std::numeric_limits<float>::infinity();
}

// The index of the code nearest x (the lower one on a tie): how many boundaries lie below x, by a branchless
// binary search over the 256 sorted boundaries.
inline uint8_t nearest_code(const float* __restrict bounds, float x) {
  int i = 0;
  for (int step = 128; step >= 1; step >>= 1) i += bounds[i + step - 1] < x ? step : 0;
  return static_cast<uint8_t>(i);
}

// bitsandbytes' blockwise 8-bit AdamW, one pass per block: dequantize both moments (code × the block's absmax),
// update them and the parameters, and requantize each moment to the nearest code of its block's new absmax.
void adamw_8bit(const OptimizerUpdate& u, const OptimizerSpan& s, int threads) {
  constexpr int64_t kBlock = OptimizerUpdate::kQuantBlock;
  FT_CHECK(s.begin % kBlock == 0, "optimizer_update: an 8-bit span starts a block of ", kBlock,
           " elements; found element ", s.begin);
  const float scale = u.grad_scale, b1 = u.beta1, b2 = u.beta2;
  const float one_minus_b1 = u.one_minus_beta1, one_minus_b2 = u.one_minus_beta2;
  const float eps = u.eps, c2 = u.bias2_sqrt, neg_step = -u.step_size, decay = u.decay_factor;
  const bool decays = s.decay, zero = s.zero_grads;
  const float* map1 = u.code_map[0];
  const float* map2 = u.code_map[1];
  float bounds1[256], bounds2[256];
  code_bounds(map1, bounds1);
  code_bounds(map2, bounds2);
  float* p = s.p;
  float* g = s.g;
  uint8_t* s1 = u.codes[0];
  uint8_t* s2 = u.codes[1];
  float* a1 = u.absmax[0];
  float* a2 = u.absmax[1];
  const int64_t first = s.begin / kBlock, last = (s.end + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (last - first > 64)
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, s.end - lo);
    float m[kBlock], v[kBlock];
    const float scale1 = a1[b], scale2 = a2[b];
    float max1 = 0.0f, max2 = 0.0f;
    for (int64_t k = 0; k < len; ++k) {
      const int64_t e = lo + k;
      const float grad = g[e] * scale;
      if (zero) g[e] = 0.0f;
      const float mk = map1[s1[e]] * scale1 * b1 + one_minus_b1 * grad;
      const float vk = map2[s2[e]] * scale2 * b2 + one_minus_b2 * grad * grad;
      const float pk = decays ? p[e] * decay : p[e];
      p[e] = pk + neg_step * (mk / (std::sqrt(vk) / c2 + eps));
      m[k] = mk;
      v[k] = vk;
      max1 = std::max(max1, std::fabs(mk));
      max2 = std::max(max2, std::fabs(vk));
    }
    a1[b] = max1;
    a2[b] = max2;
    // A block of zeros keeps scale 0 (every code then reads 0); bitsandbytes divides by the scale.
    const float d1 = std::max(max1, std::numeric_limits<float>::min());
    const float d2 = std::max(max2, std::numeric_limits<float>::min());
    for (int64_t k = 0; k < len; ++k) {
      s1[lo + k] = nearest_code(bounds1, m[k] / d1);
      s2[lo + k] = nearest_code(bounds2, v[k] / d2);
    }
  }
}

}  // namespace

void cpu_optimizer_update(const OptimizerUpdate& u, const OptimizerSpan& s, const StepContext& ctx) {
  const int threads = threads_or_default(ctx.num_threads);
  switch (u.kind) {
    case OptimizerUpdate::Kind::AdamW: {
      const AdamWStep k{u.grad_scale, s.decay ? u.decay_factor : 1.0f, u.beta1, u.beta2, u.one_minus_beta1,
                        u.one_minus_beta2, u.step_size, u.bias2_sqrt, u.eps};
      adamw_range(s.p, s.g, u.state[0], u.state[1], s.begin, s.end, k, threads, s.zero_grads);
      return;
    }
    case OptimizerUpdate::Kind::Sgd:
      return sgd(u, s, threads);
    case OptimizerUpdate::Kind::Rmsprop:
      return rmsprop(u, s, threads);
    case OptimizerUpdate::Kind::Adagrad:
      return adagrad(u, s, threads);
    case OptimizerUpdate::Kind::Lion:
      return lion(u, s, threads);
    case OptimizerUpdate::Kind::AdamW8bit:
      return adamw_8bit(u, s, threads);
    case OptimizerUpdate::Kind::AdamWBnb:
      return adamw_bnb(u, s, threads);
  }
  throw Error("optimizer_update: unknown update kind");
}

}  // namespace fusetrain::kernels
