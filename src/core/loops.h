// Element loops over flat buffers (the optimizers' updates, on the CPU devices): how they are threaded and which CPU
// each copy is compiled for.
#pragma once

#include <omp.h>

#include <cstdint>

namespace fusetrain {

inline int threads_or_default(int n) { return n > 0 ? n : omp_get_max_threads(); }

// Applies fn to [begin, end): serially for small ranges, else with the whole team (never a smaller team: libgomp
// allocates when team sizes change).
template <typename Fn>
void for_range(int64_t begin, int64_t end, int threads, Fn&& fn) {
  if (end - begin <= 65536 || threads <= 1) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) fn(i);
    return;
  }
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = begin; i < end; ++i) fn(i);
}

}  // namespace fusetrain

// The element loops are compiled for AVX-512, AVX2 and baseline x86-64 and chosen at load time by CPU.
#include "core/clones.h"
