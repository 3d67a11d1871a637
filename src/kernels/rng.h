// Counter-based random numbers (Philox4x32-10): the value at (seed, offset, index)
// is a pure function, so a mask can be regenerated in backward or after resume.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fusetrain/ops/params.h"

namespace fusetrain::kernels {

struct Philox4 {
  uint32_t v[4];
};

/// Philox4x32 with 10 rounds; counter (c0..c3), key (k0, k1).
inline Philox4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = static_cast<uint32_t>(p1);
    c2 = n2;
    c3 = static_cast<uint32_t>(p0);
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

/// Uniform float in [0, 1) for element `index` of the stream (seed, offset).
/// Four consecutive elements share one Philox call; use uniform4 in loops.
inline float uniform_at(uint64_t seed, uint64_t offset, uint64_t index) {
  uint64_t block = index >> 2;
  Philox4 r =
      philox4x32(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(offset),
                 static_cast<uint32_t>(offset >> 32), static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<float>(r.v[index & 3] >> 8) * (1.0f / 16777216.0f);
}

/// Uniform floats for elements 4*block .. 4*block+3 of the stream (seed, offset).
inline void uniform4(uint64_t seed, uint64_t offset, uint64_t block, float out[4]) {
  Philox4 r =
      philox4x32(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(offset),
                 static_cast<uint32_t>(offset >> 32), static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  for (int i = 0; i < 4; ++i) out[i] = static_cast<float>(r.v[i] >> 8) * (1.0f / 16777216.0f);
}

/// Dropout keeps element `index` when its uniform draw is >= p.
inline bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t index, float p) {
  return uniform_at(seed, offset, index) >= p;
}

/// Which element of the stream each element of a dropout's tensor draws. A Dropout that
/// computes only some rows of a larger tensor (passes::prune_sliced_rows) keeps that tensor's
/// masks: its elements come in runs of `block` that were `stride` apart, the first one at
/// `start`, so element e draws (e / block)·stride + start + e % block. block 0: element e draws e.
/// From DropoutParams::index_block, index_stride, index_start.
struct StreamIndexMap {
  int64_t block = 0, stride = 0, start = 0;

  bool identity() const { return block == 0; }
  uint64_t operator()(int64_t e) const {
    return identity() ? static_cast<uint64_t>(e) : static_cast<uint64_t>((e / block) * stride + start + e % block);
  }
  /// Calls run(local_begin, local_end, stream_begin) for the pieces of [begin, end) whose stream
  /// indices are consecutive.
  template <typename Run>
  void for_each_run(int64_t begin, int64_t end, Run&& run) const {
    if (identity()) {
      if (begin < end) run(begin, end, static_cast<uint64_t>(begin));
      return;
    }
    for (int64_t e = begin; e < end;) {
      const int64_t piece_end = std::min(end, (e / block + 1) * block);
      run(e, piece_end, (*this)(e));
      e = piece_end;
    }
  }
};

/// The map of a dropout's parameters (identity when index_block is 0).
inline StreamIndexMap stream_index_map(const ops::DropoutParams& params) {
  return {params.index_block, params.index_stride, params.index_start};
}

}  // namespace fusetrain::kernels
