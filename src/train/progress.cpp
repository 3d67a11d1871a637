#include "train/progress.h"

#include <unistd.h>

#include <cstdio>

namespace fusetrain::train {

Progress::Progress(int64_t total, bool enabled)
    : total_(total), enabled_(enabled && isatty(STDERR_FILENO)), start_(std::chrono::steady_clock::now()) {}

void Progress::update(int64_t step, const std::map<std::string, double>& values) {
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (first_step_ < 0) {
    first_step_ = step;
    start_ = now;
  }
  if (step < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double rate = elapsed > 0 ? static_cast<double>(step - first_step_) / elapsed : 0.0;
  double eta = rate > 0 ? static_cast<double>(total_ - step) / rate : 0.0;
  constexpr int kWidth = 30;
  int filled = total_ > 0 ? static_cast<int>(kWidth * step / total_) : 0;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '-');
  std::fprintf(stderr, "\r[%s] %lld/%lld", bar.c_str(), static_cast<long long>(step), static_cast<long long>(total_));
  for (const auto& [name, value] : values) std::fprintf(stderr, "  %s %.4g", name.c_str(), value);
  std::fprintf(stderr, "  %.2f it/s  ETA %02d:%02d   ", rate, static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
  std::fflush(stderr);
}

void Progress::finish() {
  if (enabled_) std::fprintf(stderr, "\n");
}

}  // namespace fusetrain::train
