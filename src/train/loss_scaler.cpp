#include "fusetrain/train/loss_scaler.h"

#include <cmath>

#include "fusetrain/core/error.h"
#include "fusetrain/io/json_fields.h"

namespace fusetrain::train {

LossScaler::LossScaler(double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval)
    : scale_(init_scale),
      growth_factor_(growth_factor),
      backoff_factor_(backoff_factor),
      growth_interval_(growth_interval) {
  FT_CHECK(init_scale > 0 && std::isfinite(init_scale), "loss scale must be positive and finite, found ", init_scale);
  FT_CHECK(growth_factor > 1 && backoff_factor > 0 && backoff_factor < 1 && growth_interval > 0,
           "loss scaler: expected growth_factor > 1, backoff_factor in (0, 1), growth_interval > 0");
}

void LossScaler::update(bool overflowed) {
  if (overflowed) {
    scale_ *= backoff_factor_;
    growth_tracker_ = 0;
    ++skipped_;
    return;
  }
  if (++growth_tracker_ == growth_interval_) {
    scale_ *= growth_factor_;
    growth_tracker_ = 0;
  }
}

nlohmann::json LossScaler::to_json() const {
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}, {"skipped_steps", skipped_}};
}

void LossScaler::load_json(const nlohmann::json& json, const std::string& file, int64_t max_skipped) {
  io::JsonFields fields(json, file);
  FT_CHECK(fields.has("scale"), file, ": missing the field \"scale\"");
  const double scale = *fields.optional_number("scale", 0.0);
  FT_CHECK(scale > 0, file, ": \"scale\" must be positive, found ", scale);
  const int64_t growth_tracker = fields.integer("growth_tracker", 0);
  const int64_t skipped = fields.optional_integer("skipped_steps", 0, max_skipped).value_or(0);
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  skipped_ = skipped;
}

}  // namespace fusetrain::train
