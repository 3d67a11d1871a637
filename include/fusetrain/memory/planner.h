// Memory planning: place buffers with known lifetimes into one arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fusetrain::memory {

/// A buffer to place: `bytes` live from schedule step `first` to step `last`
/// inclusive. Two buffers may share bytes only if their lifetimes are disjoint.
struct BufferRequest {
  size_t bytes = 0;
  int first = 0;
  int last = 0;
  std::string name;  ///< for reports and checker errors
};

/// Offsets chosen for every request, and the arena size they need.
struct ArenaPlan {
  std::vector<size_t> offsets;  ///< offsets[i] for request i, multiples of `alignment`
  size_t arena_bytes = 0;
  size_t alignment = 64;
};

/// Places the buffers: largest first, each into the smallest gap (best fit)
/// left by already-placed buffers whose lifetimes overlap it, else at the top.
ArenaPlan plan_arena(const std::vector<BufferRequest>& requests, size_t alignment = 64);

/// Proves the plan sound: every offset aligned, every buffer inside the arena,
/// and no two buffers with overlapping lifetimes share a byte. Throws Error
/// naming the first two conflicting buffers.
void check_arena(const std::vector<BufferRequest>& requests, const ArenaPlan& plan);

/// Sum of all request sizes (each aligned): the arena a planner without reuse would need.
size_t naive_bytes(const std::vector<BufferRequest>& requests, size_t alignment = 64);

/// The memory a training plan uses, by kind.
struct MemoryReport {
  size_t parameter_bytes = 0;         ///< the trainable parameters (f32)
  size_t frozen_parameter_bytes = 0;  ///< frozen weights (LoRA's base) in their dtype; no gradient, no optimizer state
  size_t gradient_bytes = 0;
  size_t optimizer_state_bytes = 0;
  size_t input_bytes = 0;
  size_t activation_peak_bytes = 0;   ///< the planned arena
  size_t activation_naive_bytes = 0;  ///< every activation in its own buffer
  size_t num_buffers = 0;
  size_t num_in_place = 0;  ///< outputs that reuse their input's memory
  /// A small table, one kind per line, sizes in MiB.
  std::string to_string() const;
};

}  // namespace fusetrain::memory
