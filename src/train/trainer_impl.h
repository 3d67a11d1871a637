// Trainer internals shared by trainer.cpp and checkpoint.cpp.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>

#include "fusetrain/optim/optimizer.h"
#include "fusetrain/train/data_parallel.h"
#include "fusetrain/train/loss_scaler.h"
#include "fusetrain/train/schedule.h"
#include "fusetrain/train/trainer.h"

namespace fusetrain::train {

struct Trainer::Impl {
  std::unique_ptr<optim::Optimizer> optimizer;
  /// Data parallel (more than one rank): the gradient buckets and ZeRO shards.
  std::unique_ptr<GradientSync> sync;
  LrSchedule schedule = LrSchedule::Linear;
  int64_t warmup = 0;
  int64_t updates_per_epoch = 1;
  int64_t batches_per_epoch = 0;
  int evaluations_without_improvement = 0;
  LossScaler scaler;  // fp16 only
  /// Steps skipped by the non-finite guard (their loss or gradient norm was inf or NaN); the learning-rate
  /// schedule does not advance over them, as over fp16's overflowed steps.
  int64_t nonfinite_skipped_steps = 0;
  /// The newest checkpoint this run saved or resumed from ("" when none): the one a stopped run points to.
  std::string last_checkpoint;
  /// Trainer::start_at's dropout stream position and skipped-step count, applied by the next train().
  int64_t resume_dropout_step = 0;
  int64_t resume_nonfinite_skipped = 0;
  /// This run's identifier, written into every optimizer file it saves: the ZeRO shards of one checkpoint must
  /// carry the same one (a shard copied from another run at the same step is refused).
  std::string run_id = random_run_id();

  static std::string random_run_id() {
    std::random_device device;
    const uint64_t id = (uint64_t{device()} << 32) ^ device();
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(id));
    return text;
  }
};

}  // namespace fusetrain::train
