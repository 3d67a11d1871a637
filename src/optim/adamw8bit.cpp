// 8-bit AdamW: bitsandbytes' blockwise-quantised moments, one fused pass per block (dequantize, update, requantize).
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/optim/optimizer.h"
#include "core/loops.h"

namespace fusetrain::optim {
namespace {

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

}  // namespace

std::vector<float> AdamW8bit::dynamic_map(bool is_signed) {
  // bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for exponent i = 0..6 the midpoints
  // of an f32 linspace(0.1, 1) with 2^i + 1 points (2^(i+1) + 1 unsigned) times 10^(i-6), mirrored when signed;
  // then 0 and 1, sorted.
  std::vector<double> data;
  for (int i = 0; i < 7; ++i) {
    const int points = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    std::vector<double> bounds(static_cast<size_t>(points));
    for (int k = 0; k < points; ++k)
      bounds[static_cast<size_t>(k)] = static_cast<float>(0.1 + 0.9 * k / (points - 1));
    const double scale = std::pow(10.0, i - 6);
    for (int k = 0; k + 1 < points; ++k) {
      const double mean = static_cast<float>((bounds[static_cast<size_t>(k)] + bounds[static_cast<size_t>(k + 1)]) / 2);
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  std::vector<float> code(data.begin(), data.end());
  std::sort(code.begin(), code.end());
  return code;
}

AdamW8bit::AdamW8bit(runtime::ParameterStore& params, AdamWConfig config, Shard shard, std::string name,
                     int64_t min_8bit_size)
    : Optimizer(params, std::move(shard), config.lr), config_(config), name_(std::move(name)) {
  FT_CHECK(shard_numel() == params.flat_numel() && segments().size() == 1, name_,
           ": its moments are quantised in blocks of each whole parameter, so it needs whole parameters; ZeRO shards "
           "split them (train ", name_, " with zero_stage 0)");
  FT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1, name_,
           ": betas must be in [0, 1), found (", config.beta1, ", ", config.beta2, ")");
  FT_CHECK(config.eps >= 0, name_, ": eps must be >= 0, found ", config.eps);
  FT_CHECK(config.weight_decay >= 0, name_, ": weight_decay must be >= 0, found ", config.weight_decay);
  for (const runtime::ParamSlot& slot : params.slots()) {
    const bool eight_bit = slot.numel >= min_8bit_size && !slot.embedding_table;
    code_at_.push_back(eight_bit ? codes_ : -1);
    absmax_at_.push_back(eight_bit ? blocks_ : -1);
    f32_at_.push_back(eight_bit ? -1 : f32_);
    if (eight_bit) {
      codes_ += slot.numel;
      blocks_ += (slot.numel + kBlock - 1) / kBlock;
    } else {
      f32_ += slot.numel;
    }
  }
  auto buffer = [&](int64_t n, size_t bytes) {  // zeroed, the store's device's memory
    return params.device().allocate(static_cast<size_t>(std::max<int64_t>(n, 1)) * bytes);
  };
  state1_ = buffer(codes_, 1);
  state2_ = buffer(codes_, 1);
  absmax1_ = buffer(blocks_, sizeof(float));
  absmax2_ = buffer(blocks_, sizeof(float));
  m32_ = buffer(f32_, sizeof(float));
  v32_ = buffer(f32_, sizeof(float));
  qmap1_ = buffer(256, sizeof(float));
  qmap2_ = buffer(256, sizeof(float));
  const std::vector<float> map1 = dynamic_map(true), map2 = dynamic_map(false);
  std::copy(map1.begin(), map1.end(), static_cast<float*>(qmap1_.get()));
  std::copy(map2.begin(), map2.end(), static_cast<float*>(qmap2_.get()));
}

std::vector<StateBuffer> AdamW8bit::states() const {
  std::vector<StateBuffer> out{{"state1", DType::u8, state1_.get(), codes_, {}, {}},
                               {"state2", DType::u8, state2_.get(), codes_, {}, {}},
                               {"absmax1", DType::f32, absmax1_.get(), blocks_, {}, {}},
                               {"absmax2", DType::f32, absmax2_.get(), blocks_, {}, {}},
                               {"qmap1", DType::f32, qmap1_.get(), 256, {}, {}},
                               {"qmap2", DType::f32, qmap2_.get(), 256, {}, {}},
                               {"state1_32bit", DType::f32, m32_.get(), f32_, {}, "state1"},
                               {"state2_32bit", DType::f32, v32_.get(), f32_, {}, "state2"}};
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  const std::pair<int64_t, Shape> none{-1, Shape{}};
  for (size_t i = 0; i < slots.size(); ++i) {
    const Shape& shape = slots[i].shape;
    const bool eight_bit = code_at_[i] >= 0;
    const Shape blocks{(slots[i].numel + kBlock - 1) / kBlock};
    out[0].per_slot.push_back(eight_bit ? std::pair{code_at_[i], shape} : none);
    out[1].per_slot.push_back(eight_bit ? std::pair{code_at_[i], shape} : none);
    out[2].per_slot.push_back(eight_bit ? std::pair{absmax_at_[i], blocks} : none);
    out[3].per_slot.push_back(eight_bit ? std::pair{absmax_at_[i], blocks} : none);
    out[4].per_slot.push_back(eight_bit ? std::pair{int64_t{0}, Shape{256}} : none);  // one map, every parameter's
    out[5].per_slot.push_back(eight_bit ? std::pair{int64_t{0}, Shape{256}} : none);
    out[6].per_slot.push_back(eight_bit ? none : std::pair{f32_at_[i], shape});
    out[7].per_slot.push_back(eight_bit ? none : std::pair{f32_at_[i], shape});
  }
  return out;
}

void AdamW8bit::update(double grad_scale, double lr) {
  const double t = static_cast<double>(step_count());
  const double correction1 = 1.0 - std::pow(config_.beta1, t);
  const double correction2 = std::sqrt(1.0 - std::pow(config_.beta2, t));
  const float scale = static_cast<float>(grad_scale);
  const float b1 = static_cast<float>(config_.beta1), b2 = static_cast<float>(config_.beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - config_.beta1);
  const float one_minus_b2 = static_cast<float>(1.0 - config_.beta2);
  const float eps = static_cast<float>(config_.eps), c2 = static_cast<float>(correction2);
  const float decay = static_cast<float>(1.0 - lr * config_.weight_decay);
  const float step_8bit = static_cast<float>(-lr / correction1);                   // the blockwise update's
  const float step_32bit = static_cast<float>(-lr * correction2 / correction1);    // the 32-bit update's
  const float eps_32bit = static_cast<float>(config_.eps * correction2);
  const float* map1 = static_cast<const float*>(qmap1_.get());
  const float* map2 = static_cast<const float*>(qmap2_.get());
  float bounds1[256], bounds2[256];
  code_bounds(map1, bounds1);
  code_bounds(map2, bounds2);
  const int n = threads();
  const bool zero = zero_grads_on();
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    const runtime::ParamSlot& slot = slots[i];
    float* p = params_.params_data() + slot.offset;
    float* g = params_.grads_data() + slot.offset;
    const int64_t numel = slot.numel;
    const bool decays = slot.weight_decay && config_.weight_decay > 0;
    if (code_at_[i] < 0) {
      float* m = static_cast<float*>(m32_.get()) + f32_at_[i];
      float* v = static_cast<float*>(v32_.get()) + f32_at_[i];
      for_range(0, numel, n, [&](int64_t k) {
        const float grad = g[k] * scale;
        if (zero) g[k] = 0.0f;
        const float mk = m[k] * b1 + one_minus_b1 * grad;
        const float vk = v[k] * b2 + one_minus_b2 * grad * grad;
        m[k] = mk;
        v[k] = vk;
        const float pk = decays ? p[k] * decay : p[k];
        p[k] = pk + step_32bit * (mk / (std::sqrt(vk) + eps_32bit));
      });
      continue;
    }
    uint8_t* s1 = static_cast<uint8_t*>(state1_.get()) + code_at_[i];
    uint8_t* s2 = static_cast<uint8_t*>(state2_.get()) + code_at_[i];
    float* a1 = static_cast<float*>(absmax1_.get()) + absmax_at_[i];
    float* a2 = static_cast<float*>(absmax2_.get()) + absmax_at_[i];
    const int64_t blocks = (numel + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(n) schedule(static) if (blocks > 64)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t lo = b * kBlock, len = std::min(kBlock, numel - lo);
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
        p[e] = pk + step_8bit * (mk / (std::sqrt(vk) / c2 + eps));
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
}

}  // namespace fusetrain::optim
