#include "fusetrain/train/schedule.h"

#include <algorithm>
#include <cmath>

#include "fusetrain/core/error.h"

namespace fusetrain::train {

LrSchedule parse_lr_schedule(const std::string& name) {
  if (name == "linear") return LrSchedule::Linear;
  if (name == "cosine") return LrSchedule::Cosine;
  if (name == "cosine_with_restarts") return LrSchedule::CosineWithRestarts;
  if (name == "polynomial") return LrSchedule::Polynomial;
  if (name == "constant") return LrSchedule::Constant;
  if (name == "constant_with_warmup") return LrSchedule::ConstantWithWarmup;
  throw Error(str("lr_scheduler_type \"", name,
                  "\" is not supported (supported: linear, cosine, cosine_with_restarts, polynomial, constant, "
                  "constant_with_warmup)"));
}

std::string to_string(LrSchedule schedule) {
  switch (schedule) {
    case LrSchedule::Linear:
      return "linear";
    case LrSchedule::Cosine:
      return "cosine";
    case LrSchedule::CosineWithRestarts:
      return "cosine_with_restarts";
    case LrSchedule::Polynomial:
      return "polynomial";
    case LrSchedule::Constant:
      return "constant";
    case LrSchedule::ConstantWithWarmup:
      return "constant_with_warmup";
  }
  return "?";
}

double lr_lambda(LrSchedule schedule, int64_t step, int64_t warmup, int64_t total, double base_lr) {
  const double s = static_cast<double>(step), w = static_cast<double>(warmup), n = static_cast<double>(total);
  auto warming = [&] { return step < warmup; };
  auto warm = [&] { return s / std::max(1.0, w); };
  auto progress = [&] { return (s - w) / std::max(1.0, n - w); };
  constexpr double kPi = 3.14159265358979323846;
  switch (schedule) {
    case LrSchedule::Constant:
      return 1.0;
    case LrSchedule::ConstantWithWarmup:
      return warming() ? warm() : 1.0;
    case LrSchedule::Linear:
      return warming() ? warm() : std::max(0.0, (n - s) / std::max(1.0, n - w));
    case LrSchedule::Cosine:
      return warming() ? warm() : std::max(0.0, 0.5 * (1.0 + std::cos(kPi * 0.5 * 2.0 * progress())));
    case LrSchedule::CosineWithRestarts: {
      if (warming()) return warm();
      double p = progress();
      if (p >= 1.0) return 0.0;
      return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * std::fmod(1.0 * p, 1.0))));
    }
    case LrSchedule::Polynomial: {
      constexpr double kLrEnd = 1e-7, kPower = 1.0;
      if (warming()) return warm();
      if (step > total) return kLrEnd / base_lr;
      double remaining = 1.0 - (s - w) / (n - w);
      return ((base_lr - kLrEnd) * std::pow(remaining, kPower) + kLrEnd) / base_lr;
    }
  }
  return 1.0;
}

int64_t warmup_steps_for(double warmup_steps, double warmup_ratio, int64_t total_steps) {
  if (warmup_steps >= 1) return static_cast<int64_t>(warmup_steps);
  const double ratio = warmup_steps > 0 ? warmup_steps : warmup_ratio;
  return static_cast<int64_t>(std::ceil(ratio * static_cast<double>(total_steps)));
}

}  // namespace fusetrain::train
