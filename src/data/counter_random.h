// Internal to data/: counter-based draws (a pure function of seed, batch and position), shared by the collators'
// masked-LM masking and SpecAugment, so a resumed run reproduces every draw.
#pragma once

#include <cstdint>

namespace fusetrain::data::detail {

// splitmix64's finaliser: a bijective mix of 64 bits (Steele, Lea, Flood 2014).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform double in [0, 1) from the top 53 bits.
inline double unit(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// Uniform integer in [0, bound) by multiply-shift (bias below bound / 2^64).
inline int64_t below(uint64_t bits, uint64_t bound) {
  return static_cast<int64_t>((static_cast<unsigned __int128>(bits) * bound) >> 64);
}

// The stream of one batch: distinct per (seed, batch_index, salt).
inline uint64_t batch_stream(uint64_t seed, uint64_t batch_index, uint64_t salt = 0) {
  return splitmix64(splitmix64(seed ^ salt) ^ splitmix64(batch_index + 0x632BE59BD9B4E019ull));
}

}  // namespace fusetrain::data::detail
