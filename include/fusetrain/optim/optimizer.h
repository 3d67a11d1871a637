// Optimizers: one fused pass over the flat parameter, gradient and state buffers.
#pragma once

#include <cstdint>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/runtime/parameters.h"

namespace fusetrain::optim {

/// Sum of squares of n floats, in double (threaded).
double sum_of_squares(const float* data, int64_t n, int num_threads = 0);

/// Global L2 norm of all gradients (computed in double, threaded).
double grad_norm(const runtime::ParameterStore& params, int num_threads = 0);

/// Scales gradients so their global norm is at most `max_norm`, as
/// torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6),
/// capped at 1). Returns the norm before clipping.
double clip_grad_norm(runtime::ParameterStore& params, double max_norm, int num_threads = 0);

/// Hyperparameters of AdamW, with torch.optim.AdamW's defaults.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

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

/// AdamW with decoupled weight decay and bias correction, numerically the same
/// update as torch.optim.AdamW: p -= lr·wd·p; m = β1·m + (1−β1)·g;
/// v = β2·v + (1−β2)·g²; p -= lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε).
/// Parameters whose slot has weight_decay == false are not decayed. With a Shard it updates (and keeps moments for)
/// that range of the flat buffers only.
class AdamW {
 public:
  AdamW(runtime::ParameterStore& params, AdamWConfig config, Shard shard = {});
  /// One update of every parameter. `grad_scale` multiplies each gradient as it
  /// is read (clipping fused into the pass); `lr` overrides config.lr when >= 0.
  void step(double grad_scale = 1.0, double lr = -1.0);
  /// Clips to `max_norm` (if > 0) and steps, reading each gradient once for the
  /// norm and once for the update. Gradients are first multiplied by `grad_scale`
  /// (1 / accumulation steps). Returns the (scaled) gradient norm before clipping.
  double clip_and_step(double max_norm, double lr = -1.0, double grad_scale = 1.0);
  /// clip_and_step unless the gradients hold inf or NaN (an fp16 overflow): then
  /// nothing changes and the returned norm is not finite.
  double clip_and_step_if_finite(double max_norm, double lr = -1.0, double grad_scale = 1.0);
  /// The same with the gradients' norm given (before grad_scale): a sharded run's global norm, reduced across ranks.
  double clip_and_step_if_finite_with_norm(double norm, double max_norm, double lr, double grad_scale);
  /// Sum of squares of the gradients this optimizer reads (its shard's), in double.
  double grad_sum_of_squares() const;
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t t) { step_count_ = t; }
  const AdamWConfig& config() const { return config_; }
  AdamWConfig& config() { return config_; }
  /// First and second moments: the shard's segments one after another (the parameters' layout without a shard).
  float* exp_avg() const { return static_cast<float*>(m_.get()); }
  float* exp_avg_sq() const { return static_cast<float*>(v_.get()); }
  /// The flat-buffer segments this optimizer updates, and their total length (the moments' length).
  const std::vector<Segment>& segments() const { return segments_; }
  int64_t shard_numel() const { return numel_; }
  size_t state_bytes() const { return 2 * static_cast<size_t>(numel_) * sizeof(float); }
  void set_num_threads(int n) { num_threads_ = n; }
  /// When on, an update leaves the store's gradients it read at zero (zeroed in the same pass, so a trainer
  /// needs no separate pass before the next step's accumulation). Off by default.
  void set_zero_grads(bool on) { zero_grads_ = on; }

 private:
  runtime::ParameterStore& params_;
  AdamWConfig config_;
  std::vector<Segment> segments_;
  std::vector<int64_t> offsets_;  // where each segment starts in the moments
  int64_t numel_ = 0;
  const float* grads_ = nullptr;
  AlignedPtr m_, v_;
  int64_t step_count_ = 0;
  int num_threads_ = 0;
  bool zero_grads_ = false;
};

/// Hyperparameters of SGD, as torch.optim.SGD.
struct SgdConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// SGD with momentum, the same update as torch.optim.SGD: g += wd·p;
/// b = μ·b + (1−dampening)·g (b = g on the first step); g = nesterov ? g + μ·b : b; p -= lr·g.
class Sgd {
 public:
  Sgd(runtime::ParameterStore& params, SgdConfig config);
  void step(double grad_scale = 1.0, double lr = -1.0);
  int64_t step_count() const { return step_count_; }
  float* momentum_buffer() const { return static_cast<float*>(b_.get()); }
  void set_num_threads(int n) { num_threads_ = n; }

 private:
  runtime::ParameterStore& params_;
  SgdConfig config_;
  AlignedPtr b_;
  int64_t step_count_ = 0;
  int num_threads_ = 0;
};

}  // namespace fusetrain::optim
