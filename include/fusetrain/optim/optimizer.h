// Optimizers: one fused pass over the flat parameter, gradient and state buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/dtype.h"
#include "fusetrain/core/shape.h"
#include "fusetrain/runtime/parameters.h"

namespace fusetrain::optim {

/// Global L2 norm of all gradients (computed in double, threaded).
double grad_norm(const runtime::ParameterStore& params, int num_threads = 0);

/// Scales gradients so their global norm is at most `max_norm`, as
/// torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6),
/// capped at 1). Returns the norm before clipping.
double clip_grad_norm(runtime::ParameterStore& params, double max_norm, int num_threads = 0);

/// Elements [begin, end) of the flat buffers.
struct Segment {
  int64_t begin = 0, end = 0;
  bool operator==(const Segment&) const = default;
};

/// The part of the flat buffers one optimizer updates: ZeRO gives each rank one shard of the optimizer state, one
/// segment of every gradient bucket. The shard's moments (and gradients) hold its segments' elements one after
/// another.
struct Shard {
  std::vector<Segment> segments;  ///< empty: the whole buffers
  /// The shard's gradients, laid out like its moments; nullptr reads the store's gradient buffer.
  const float* grads = nullptr;
};

/// One state buffer of an optimizer, laid out like its shard of the flat buffers (element k belongs to the shard's
/// k-th parameter element), named as the optimizer it reproduces names it in its state dict ("exp_avg",
/// "momentum_buffer", "square_avg", "sum", bitsandbytes' "state1").
struct StateBuffer {
  std::string name;  ///< unique among the optimizer's states (the checkpoint's tensor name)
  DType dtype = DType::f32;
  void* data = nullptr;
  int64_t numel = 0;
  /// Empty: laid out like the shard. Otherwise the state is per parameter and not elementwise (Adafactor's factored
  /// moments): one entry per slot of the store, where its state starts in the buffer and its shape (offset -1: the
  /// slot has none of this state).
  std::vector<std::pair<int64_t, Shape>> per_slot;
  /// The name in the reproduced optimizer's per-parameter state when two buffers share one (bitsandbytes' "state1"
  /// is 8-bit for large parameters and 32-bit for the others); empty: `name`.
  std::string key;
  const std::string& state_key() const { return key.empty() ? name : key; }
};

/// An optimizer as transformers' TrainingArguments choose it: the `optim` value, the learning rate, the weight decay of
/// the decayed parameter group, the Adam arguments (also Lion's betas) and `optim_args` ("momentum=0.9,..." parsed
/// into key -> value).
struct OptimizerSpec {
  std::string name = "adamw_torch";
  double lr = 1e-3;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  std::map<std::string, std::string> options;
};

/// The `optim` values the engine runs, each the update of the optimizer transformers makes for it.
std::vector<std::string> optimizer_names();

/// Parses transformers' `optim_args` text ("momentum=0.9, nesterov=True"): Error naming the entry without one "=".
std::map<std::string, std::string> parse_optim_args(const std::string& text);

/// An optimizer over the flat parameter and gradient buffers of a ParameterStore (or one ZeRO shard of them):
/// one fused pass per step over each run of slots with the same weight-decay flag (the parameter groups), its states
/// laid out like the parameters. step() takes the factor every gradient is multiplied by as it is read; clipping and
/// the non-finite guard (clip_and_step_with_norm) are the same for every optimizer.
class Optimizer {
 public:
  Optimizer(runtime::ParameterStore& params, Shard shard, double lr);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  /// The `optim` value whose update this is ("adamw_torch", "sgd", ...).
  virtual std::string name() const = 0;
  /// One update of every parameter of the shard: gradients read times `grad_scale`, learning rate `lr` (the
  /// optimizer's own when < 0).
  void step(double grad_scale = 1.0, double lr = -1.0);
  /// Clips to `max_norm` (if > 0) and steps, reading each gradient once for the norm and once for the update.
  /// Gradients are first multiplied by `grad_scale`. Returns the (scaled) gradient norm before clipping; a norm that
  /// is inf or NaN (an fp16 overflow) changes nothing.
  double clip_and_step(double max_norm, double lr = -1.0, double grad_scale = 1.0);
  /// clip_and_step with the gradients' norm (before grad_scale) given: the Trainer's, summed over the buckets or the
  /// ranks' shards under data parallel.
  double clip_and_step_with_norm(double unscaled_norm, double max_norm, double lr, double grad_scale);
  /// Sum of squares of the gradients this optimizer reads (its shard's), in double.
  double grad_sum_of_squares() const;
  /// The state buffers, by name (empty for a stateless update).
  virtual std::vector<StateBuffer> states() const = 0;
  size_t state_bytes() const;
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t t) { step_count_ = t; }
  double lr() const { return lr_; }
  void set_lr(double lr);
  /// The flat-buffer segments this optimizer updates, and their total length (each state buffer's length).
  const std::vector<Segment>& segments() const { return segments_; }
  int64_t shard_numel() const { return numel_; }
  void set_num_threads(int n) { num_threads_ = n; }
  /// How the ranks sum a per-parameter statistic in place (under ZeRO; the communicator's all_reduce_sum): an
  /// update whose states are per parameter (Adafactor) needs it over a shard.
  void set_all_reduce(std::function<void(double*, int64_t)> all_reduce) { all_reduce_ = std::move(all_reduce); }
  /// When on, an update leaves the store's gradients it read at zero (zeroed in the same pass, so a trainer
  /// needs no separate pass before the next step's accumulation). Off by default.
  void set_zero_grads(bool on) { zero_grads_ = on; }

 protected:
  /// The update of step step_count() (already counted) with learning rate `lr`.
  virtual void update(double grad_scale, double lr) = 0;
  /// A range of state elements [begin, end) whose parameters share one weight-decay flag: p and g are indexed like
  /// the states (element i of the state is p[i], g[i]); `zero` asks the update to set each g[i] to 0 once read.
  struct Run {
    float* p;
    float* g;
    int64_t begin, end;
    bool decay, zero;
  };
  /// Calls `fn` for every Run of the shard, in order.
  template <typename Fn>
  void for_each_run(Fn&& fn) const;
  /// An elementwise update of this step: `kind`, the gradients read times `grad_scale`, learning rate `lr`; the
  /// subclass adds its constants and states.
  kernels::OptimizerUpdate step_update(kernels::OptimizerUpdate::Kind kind, double grad_scale, double lr) const;
  /// Has the store's Device run `update` over every Run of the shard (Device::optimizer_update).
  void run_update(const kernels::OptimizerUpdate& update) const;
  /// The part of slot i's elements this optimizer updates, [begin, end) counted from the slot's first element, with
  /// `g` such that g[k] is element k's gradient (the store's, or the shard's under ZeRO). At most one per segment.
  struct SlotPart {
    int64_t begin, end;
    float* g;
  };
  std::vector<SlotPart> slot_parts(size_t i) const;
  /// Whether this optimizer updates a ZeRO shard rather than every element.
  bool sharded() const { return grads_ != nullptr || numel_ != params_.flat_numel(); }
  /// A zeroed f32 state buffer of shard_numel() elements, the store's device's memory.
  kernels::DeviceBuffer allocate_state() const;
  /// The description of such a buffer, laid out like the shard, under `name`.
  StateBuffer elementwise_state(std::string name, void* data) const {
    return {std::move(name), DType::f32, data, numel_, {}, {}};
  }
  int threads() const;
  /// Whether the update zeroes the store's gradients it reads (set_zero_grads, with no shard gradients).
  bool zero_grads_on() const { return zero_grads_ && grads_ == nullptr; }

  runtime::ParameterStore& params_;
  std::function<void(double*, int64_t)> all_reduce_;

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> offsets_;  // where each segment starts in the states
  int64_t numel_ = 0;
  const float* grads_ = nullptr;
  double lr_;
  int64_t step_count_ = 0;
  int num_threads_ = 0;
  bool zero_grads_ = false;
};

/// The optimizer `spec` names over `params` (or a shard of them). Error naming an `optim` value the engine does not run
/// (with the ones it does), or an option the optimizer does not take or cannot read.
std::unique_ptr<Optimizer> make_optimizer(runtime::ParameterStore& params, const OptimizerSpec& spec, Shard shard = {});

/// make_optimizer's checks of the name and the options alone (no store): Error as make_optimizer's.
void check_optimizer(const OptimizerSpec& spec);

/// Hyperparameters of AdamW, with torch.optim.AdamW's defaults.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

/// AdamW with decoupled weight decay and bias correction, numerically the same update as torch.optim.AdamW
/// (adamw_torch): p -= lr·wd·p; m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²; p -= lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε).
/// States exp_avg and exp_avg_sq.
class AdamW final : public Optimizer {
 public:
  AdamW(runtime::ParameterStore& params, AdamWConfig config, Shard shard = {});
  std::string name() const override { return "adamw_torch"; }
  std::vector<StateBuffer> states() const override;
  const AdamWConfig& config() const { return config_; }
  float* exp_avg() const { return static_cast<float*>(m_.get()); }
  float* exp_avg_sq() const { return static_cast<float*>(v_.get()); }

 protected:
  void update(double grad_scale, double lr) override;

 private:
  AdamWConfig config_;
  kernels::DeviceBuffer m_, v_;
};

/// Hyperparameters of SGD, as torch.optim.SGD.
struct SgdConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// SGD with momentum, the same update as torch.optim.SGD (sgd): g += wd·p; b = μ·b + (1−dampening)·g (b = g on the
/// first step); g = nesterov ? g + μ·b : b; p -= lr·g. State momentum_buffer (with momentum only).
class Sgd final : public Optimizer {
 public:
  Sgd(runtime::ParameterStore& params, SgdConfig config, Shard shard = {});
  std::string name() const override { return "sgd"; }
  std::vector<StateBuffer> states() const override;
  float* momentum_buffer() const { return static_cast<float*>(b_.get()); }

 protected:
  void update(double grad_scale, double lr) override;

 private:
  SgdConfig config_;
  kernels::DeviceBuffer b_;
};

/// Hyperparameters of RMSprop, as torch.optim.RMSprop.
struct RmspropConfig {
  double lr = 1e-2;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  bool centered = false;
};

/// RMSprop, the same update as torch.optim.RMSprop (rmsprop; bitsandbytes' 32-bit RMSprop computes the same without
/// momentum and centering): g += wd·p; s = α·s + (1−α)·g²; a = √(s − ḡ²) (centered, ḡ = lerp(ḡ, g, 1−α)) or √s;
/// a += ε; with momentum b = μ·b + g/a, p -= lr·b, else p -= lr·g/a. States square_avg, momentum_buffer (momentum
/// > 0), grad_avg (centered).
class Rmsprop final : public Optimizer {
 public:
  Rmsprop(runtime::ParameterStore& params, RmspropConfig config, Shard shard = {}, std::string name = "rmsprop");
  std::string name() const override { return name_; }
  std::vector<StateBuffer> states() const override;

 protected:
  void update(double grad_scale, double lr) override;

 private:
  RmspropConfig config_;
  std::string name_;
  kernels::DeviceBuffer square_avg_, momentum_, grad_avg_;
};

/// Hyperparameters of Adagrad, as torch.optim.Adagrad.
struct AdagradConfig {
  double lr = 1e-2;
  double lr_decay = 0.0;
  double weight_decay = 0.0;
  double initial_accumulator_value = 0.0;
  double eps = 1e-10;
};

/// Adagrad, the same update as torch.optim.Adagrad (adagrad): g += wd·p; s += g²; p -= lr/(1 + (t−1)·lr_decay) ·
/// g/(√s + ε). State sum.
class Adagrad final : public Optimizer {
 public:
  Adagrad(runtime::ParameterStore& params, AdagradConfig config, Shard shard = {});
  std::string name() const override { return "adagrad"; }
  std::vector<StateBuffer> states() const override;

 protected:
  void update(double grad_scale, double lr) override;

 private:
  AdagradConfig config_;
  kernels::DeviceBuffer sum_;
};

/// Hyperparameters of Lion, as bitsandbytes' Lion (what transformers' lion_32bit makes, with the Adam betas).
struct LionConfig {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;
};

/// Lion, the same update as bitsandbytes' 32-bit Lion (lion_32bit, paged_lion_32bit): p -= lr·wd·p;
/// p -= lr·sign(β1·m + (1−β1)·g); m = β2·m + (1−β2)·g. State state1 (bitsandbytes' name for m).
class Lion final : public Optimizer {
 public:
  Lion(runtime::ParameterStore& params, LionConfig config, Shard shard = {}, std::string name = "lion_32bit");
  std::string name() const override { return name_; }
  std::vector<StateBuffer> states() const override;

 protected:
  void update(double grad_scale, double lr) override;

 private:
  LionConfig config_;
  std::string name_;
  kernels::DeviceBuffer m_;
};

/// Hyperparameters of Adafactor as transformers' Trainer makes it (adafactor: scale_parameter and relative_step off,
/// the learning rate given, no first moment).
struct AdafactorConfig {
  double lr = 1e-3;
  double eps = 1e-30;            ///< added to g² (transformers' eps[0])
  double clip_threshold = 1.0;   ///< the update's RMS is clipped to this
  double decay_rate = -0.8;      ///< β2 of step t is 1 − t^decay_rate
  double weight_decay = 0.0;
};

/// Adafactor, the same update as transformers.optimization.Adafactor (adafactor): with β2ₜ = 1 − t^decay_rate and
/// u = g² + ε, a parameter of rank ≥ 2 keeps the row and column means of u's moving average (R = β2ₜ·R + (1−β2ₜ)·
/// mean_cols(u), C likewise over rows) and is updated by g / √(R/mean(R) ⊗ C), a vector by g / √V with V the moving
/// average of u; the update is divided by max(1, RMS(update)/clip_threshold), times lr; p -= lr·wd·p (decayed
/// parameters), p -= update. States exp_avg_sq_row, exp_avg_sq_col and exp_avg_sq, per parameter (StateBuffer::
/// per_slot), whole on every rank under ZeRO: each rank adds its shard's share of the row and column sums, of the
/// vectors' averages and of each update's sum of squares, the ranks sum them (set_all_reduce), and each rank updates
/// its shard.
class Adafactor final : public Optimizer {
 public:
  Adafactor(runtime::ParameterStore& params, AdafactorConfig config, Shard shard = {});
  std::string name() const override { return "adafactor"; }
  std::vector<StateBuffer> states() const override;

 protected:
  void update(double grad_scale, double lr) override;

 private:
  AdafactorConfig config_;
  // Per slot: offsets of its row and column means (factored) or of its elementwise average (-1 where none).
  std::vector<int64_t> row_at_, col_at_, sq_at_;
  int64_t rows_ = 0, cols_ = 0, squares_ = 0;
  kernels::DeviceBuffer row_, col_, sq_;
  // The step's scratch, the device's memory: this optimizer's share of the row and column sums and of the vectors'
  // new averages (summed over ranks under ZeRO), every factored row's factor, each parameter's update sum of squares.
  kernels::DeviceBuffer stats_, factor_rows_, update_squares_;
  // `step` (the step's constants) with slot i's shape, states and scratch; the phase to be set.
  kernels::AdafactorUpdate slot_update(size_t i, const kernels::AdafactorUpdate& step) const;
};

/// 8-bit AdamW as bitsandbytes' AdamW with optim_bits=8 (adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit): each
/// parameter of at least `min_8bit_size` elements that is not an embedding table (transformers' Trainer keeps those in
/// 32 bits) stores its moments as 8-bit codes in blocks of 256 elements, each block scaled by its largest magnitude
/// (absmax), the codes indexing bitsandbytes' dynamic maps (signed for the first moment, unsigned for the second).
/// A step dequantizes a block, updates it as bitsandbytes' blockwise update does (m = β1·m + (1−β1)·g;
/// v = β2·v + (1−β2)·g²; p ·= 1 − lr·wd; p −= lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)) and requantizes it to the
/// nearest code; the other parameters take bitsandbytes' 32-bit update (m / (√v + ε·√(1−β2ᵗ)) times
/// −lr·√(1−β2ᵗ)/(1−β1ᵗ)). States state1/state2 (codes or f32), absmax1/absmax2, qmap1/qmap2, per parameter: no ZeRO
/// shard.
class AdamW8bit final : public Optimizer {
 public:
  AdamW8bit(runtime::ParameterStore& params, AdamWConfig config, Shard shard = {}, std::string name = "adamw_bnb_8bit",
            int64_t min_8bit_size = 4096);
  std::string name() const override { return name_; }
  std::vector<StateBuffer> states() const override;
  /// bitsandbytes' create_dynamic_map: 256 sorted codes in [-1, 1] (signed) or [0, 1], dense near zero.
  static std::vector<float> dynamic_map(bool is_signed);
  static constexpr int64_t kBlock = kernels::OptimizerUpdate::kQuantBlock;

 protected:
  void update(double grad_scale, double lr) override;

 private:
  AdamWConfig config_;
  std::string name_;
  // Per slot: where its codes and block scales start (8-bit) or its 32-bit moments start (-1 where none).
  std::vector<int64_t> code_at_, absmax_at_, f32_at_;
  int64_t codes_ = 0, blocks_ = 0, f32_ = 0;
  kernels::DeviceBuffer state1_, state2_, absmax1_, absmax2_, m32_, v32_, qmap1_, qmap2_;
};

template <typename Fn>
void Optimizer::for_each_run(Fn&& fn) const {
  // Consecutive slots with the same decay flag form one run: one loop per run of slots, not per tensor. Each
  // segment's elements are indexed by their place in the states: element o + k of a state (and of the shard's
  // gradients) is flat element begin + k, so the parameter and store-gradient pointers are shifted by begin - o.
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  for (size_t seg = 0; seg < segments_.size(); ++seg) {
    const Segment& s = segments_[seg];
    const int64_t o = offsets_[seg];
    float* p = params_.params_data() + (s.begin - o);
    float* g = grads_ ? const_cast<float*>(grads_) : params_.grads_data() + (s.begin - o);
    for (size_t first = 0; first < slots.size();) {
      size_t last = first;
      while (last + 1 < slots.size() && slots[last + 1].weight_decay == slots[first].weight_decay) ++last;
      const int64_t lo = std::max(slots[first].offset, s.begin);
      const int64_t hi = std::min(slots[last].offset + slots[last].numel, s.end);
      if (lo < hi) fn(Run{p, g, o + (lo - s.begin), o + (hi - s.begin), slots[first].weight_decay,
                          zero_grads_ && grads_ == nullptr});
      first = last + 1;
    }
  }
}

}  // namespace fusetrain::optim
