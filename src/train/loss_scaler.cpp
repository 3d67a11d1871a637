#include "fusetrain/train/loss_scaler.h"

#include <cmath>

#include "fusetrain/core/error.h"

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

void LossScaler::load_json(const nlohmann::json& json) {
  FT_CHECK(json.is_object() && json.contains("scale") && json["scale"].is_number() && json.contains("growth_tracker") &&
               json["growth_tracker"].is_number_integer(),
           "loss scaler state: expected {\"scale\": number, \"growth_tracker\": integer}, found ", json.dump());
  double scale = json["scale"].get<double>();
  FT_CHECK(scale > 0 && std::isfinite(scale), "loss scaler state: scale must be positive, found ", scale);
  scale_ = scale;
  growth_tracker_ = json["growth_tracker"].get<int64_t>();
  skipped_ = json.value("skipped_steps", int64_t{0});
}

}  // namespace fusetrain::train
