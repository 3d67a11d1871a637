// Whether the threads of a parallel kernel run at the same speed, judged from their measured rates.
//
// On an idle machine they do, and a GEMM gives each thread one equal block of C (the least packing). When another
// process takes part of a core, the thread sharing it runs slower and the others would wait for it at the end of
// every product; a GEMM then splits C into more blocks, taken in turn from a shared counter, so that a late thread
// takes fewer. After each parallel product its threads' rates (work over the seconds each spent) are recorded: the
// state turns contended when a moving average of 1 − slowest / fastest rate exceeds kContended and balanced again
// when it falls below kBalanced (hysteresis, so that one noisy product does not flip it).
#pragma once

#include <algorithm>
#include <atomic>

namespace fusetrain::kernels {

class ThreadBalance {
 public:
  static constexpr float kContended = 0.3f, kBalanced = 0.15f;
  static constexpr float kWeight = 0.25f;  // of the newest product in the moving average

  bool contended() const { return contended_.load(std::memory_order_relaxed); }
  float average_spread() const { return average_.load(std::memory_order_relaxed); }

  /// Records one parallel run: work[t] units done by thread t in seconds[t]; threads that did no work are left out.
  /// Concurrent calls may lose one another's update (the average is a heuristic), never corrupt it.
  void record(const double* work, const double* seconds, int threads) {
    double fastest = 0.0, slowest = 0.0;
    for (int t = 0; t < threads; ++t) {
      if (!(work[t] > 0.0) || !(seconds[t] > 0.0)) continue;
      const double rate = work[t] / seconds[t];
      fastest = std::max(fastest, rate);
      slowest = slowest == 0.0 ? rate : std::min(slowest, rate);
    }
    if (fastest <= 0.0) return;
    const float spread = float(1.0 - slowest / fastest);
    const float average = (1.0f - kWeight) * average_spread() + kWeight * spread;
    average_.store(average, std::memory_order_relaxed);
    if (average > kContended) contended_.store(true, std::memory_order_relaxed);
    if (average < kBalanced) contended_.store(false, std::memory_order_relaxed);
  }

 private:
  std::atomic<float> average_{0.0f};
  std::atomic<bool> contended_{false};
};

}  // namespace fusetrain::kernels
