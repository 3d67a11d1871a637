// A one-line progress bar on stderr (only when it is a terminal).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace fusetrain::train {

class Progress {
 public:
  Progress(int64_t total, bool enabled);
  /// Redraws: step/total, the given values, steps/s and ETA (at most 10 times a second).
  void update(int64_t step, const std::map<std::string, double>& values);
  void finish();

 private:
  int64_t total_;
  bool enabled_;
  int64_t first_step_ = -1;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace fusetrain::train
