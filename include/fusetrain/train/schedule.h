// Learning-rate schedules, as transformers' get_scheduler defines them.
#pragma once

#include <cstdint>
#include <string>

namespace fusetrain::train {

/// transformers' SchedulerType values that fusetrain supports.
enum class LrSchedule { Linear, Cosine, CosineWithRestarts, Polynomial, Constant, ConstantWithWarmup };

/// Parses "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
/// "constant_with_warmup"; throws Error listing them otherwise.
LrSchedule parse_lr_schedule(const std::string& name);
std::string to_string(LrSchedule schedule);

/// The multiplier of the base learning rate for optimizer step `step` (0-based),
/// identical to the LambdaLR transformers builds: the first step of a warmup uses 0.
/// polynomial decays to lr_end = 1e-7 with power 1; cosine uses half a cycle,
/// cosine_with_restarts one cycle, as transformers' defaults.
double lr_lambda(LrSchedule schedule, int64_t step, int64_t warmup_steps, int64_t total_steps, double base_lr);

/// Warmup steps as transformers' Trainer computes them: warmup_steps if >= 1; a warmup_steps in (0, 1) is a ratio
/// (transformers 5: ceil(warmup_steps · total)); otherwise ceil(warmup_ratio · total) (transformers 4's field).
int64_t warmup_steps_for(double warmup_steps, double warmup_ratio, int64_t total_steps);

}  // namespace fusetrain::train
