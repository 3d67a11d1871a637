// Aligned memory owned by a unique handle.
#pragma once

#include <cstddef>
#include <memory>

namespace fusetrain {

/// Alignment of every buffer the engine allocates (one cache line, one zmm register).
constexpr size_t kAlignment = 64;

/// Rounds n up to a multiple of `align` (a power of two).
constexpr size_t align_up(size_t n, size_t align = kAlignment) { return (n + align - 1) & ~(align - 1); }

/// Releases memory from aligned_allocate (null: nothing).
struct AlignedFree {
  void operator()(void* p) const;
};
/// Owning pointer to memory from aligned_allocate.
using AlignedPtr = std::unique_ptr<void, AlignedFree>;

/// Allocates `bytes` (rounded up to kAlignment), zero-filled; throws Error on failure. From 1 MiB on the memory is
/// mapped from the kernel and each page becomes resident on its first write, so what is never written costs no RAM.
AlignedPtr aligned_allocate(size_t bytes);

/// Hands the whole pages inside [p, p + bytes) of memory from aligned_allocate back to the kernel: they read as zero
/// afterwards and cost no RAM until written again; the partial pages at either end, and everything around the
/// range, keep their contents. For a buffer whose data has been consumed and will be freed or overwritten.
void release_pages(void* p, size_t bytes);

}  // namespace fusetrain
