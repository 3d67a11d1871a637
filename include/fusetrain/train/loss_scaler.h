// Dynamic loss scaling for fp16 training.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <nlohmann/json.hpp>

namespace fusetrain::train {

/// The loss scale of fp16 training, with torch.amp.GradScaler's rule and defaults:
/// start at 2^16; a step whose gradients overflowed is skipped and halves the
/// scale; 2000 steps in a row without overflow double it.
class LossScaler {
 public:
  explicit LossScaler(double init_scale = 65536.0, double growth_factor = 2.0, double backoff_factor = 0.5,
                      int64_t growth_interval = 2000);
  double scale() const { return scale_; }
  /// Records one optimizer step: `overflowed` when its gradients held inf or NaN.
  void update(bool overflowed);
  /// Steps skipped so far because of overflow.
  int64_t skipped_steps() const { return skipped_; }
  /// State for checkpoints ({"scale", "growth_tracker", "skipped_steps"}).
  nlohmann::json to_json() const;
  /// Restores to_json()'s state read from `file`; throws Error naming the file and a missing or invalid field
  /// (the scale must be positive and finite, skipped_steps at most `max_skipped`).
  void load_json(const nlohmann::json& json, const std::string& file = "scaler.json",
                 int64_t max_skipped = std::numeric_limits<int64_t>::max());

 private:
  double scale_, growth_factor_, backoff_factor_;
  int64_t growth_interval_;
  int64_t growth_tracker_ = 0;  // overflow-free steps since the last change
  int64_t skipped_ = 0;
};

}  // namespace fusetrain::train
