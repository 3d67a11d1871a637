// 8-bit AdamW: bitsandbytes' blockwise-quantised moments, laid out per parameter; the Device runs the update, one
// fused pass per block (dequantize, update, requantize).
#include <algorithm>
#include <cmath>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/optim/optimizer.h"

namespace fusetrain::optim {

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
  params.device().upload(qmap1_.get(), map1.data(), map1.size() * sizeof(float));
  params.device().upload(qmap2_.get(), map2.data(), map2.size() * sizeof(float));
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
  kernels::OptimizerUpdate u;
  u.grad_scale = static_cast<float>(grad_scale);
  u.beta1 = static_cast<float>(config_.beta1);
  u.beta2 = static_cast<float>(config_.beta2);
  u.one_minus_beta1 = static_cast<float>(1.0 - config_.beta1);
  u.one_minus_beta2 = static_cast<float>(1.0 - config_.beta2);
  u.decay_factor = static_cast<float>(1.0 - lr * config_.weight_decay);
  // The blockwise update's constants, and the 32-bit update's (its own order of operations).
  kernels::OptimizerUpdate eight = u, full = u;
  eight.kind = kernels::OptimizerUpdate::Kind::AdamW8bit;
  eight.step_size = static_cast<float>(lr / correction1);
  eight.bias2_sqrt = static_cast<float>(correction2);
  eight.eps = static_cast<float>(config_.eps);
  eight.code_map[0] = static_cast<const float*>(qmap1_.get());
  eight.code_map[1] = static_cast<const float*>(qmap2_.get());
  full.kind = kernels::OptimizerUpdate::Kind::AdamWBnb;
  full.step_size = static_cast<float>(lr * correction2 / correction1);
  full.eps = static_cast<float>(config_.eps * correction2);
  kernels::StepContext ctx;
  ctx.num_threads = threads();
  const kernels::Device& device = params_.device();
  const bool zero = zero_grads_on();
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    const runtime::ParamSlot& slot = slots[i];
    const kernels::OptimizerSpan span{params_.params_data() + slot.offset, params_.grads_data() + slot.offset, 0,
                                      slot.numel, slot.weight_decay && config_.weight_decay > 0, zero};
    if (code_at_[i] < 0) {
      full.state[0] = static_cast<float*>(m32_.get()) + f32_at_[i];
      full.state[1] = static_cast<float*>(v32_.get()) + f32_at_[i];
      device.optimizer_update(full, span, ctx);
      continue;
    }
    eight.codes[0] = static_cast<uint8_t*>(state1_.get()) + code_at_[i];
    eight.codes[1] = static_cast<uint8_t*>(state2_.get()) + code_at_[i];
    eight.absmax[0] = static_cast<float*>(absmax1_.get()) + absmax_at_[i];
    eight.absmax[1] = static_cast<float*>(absmax2_.get()) + absmax_at_[i];
    device.optimizer_update(eight, span, ctx);
  }
}

}  // namespace fusetrain::optim
