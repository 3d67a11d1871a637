// Flash-style scaled dot-product attention, forward and backward, for the CPU.
//
// Legend: B batch, H heads, K key/value heads (grouped-query attention: H / K query heads share
// one, query head h reads key/value head h / (H / K)), T query length, S key length, D head size;
// bh = b·H + h indexes one (batch, head) pair; BQ query rows and BK keys per tile.
//   q, out, dq, dout: (B, H, T, D)   k, v, dk, dv: (B, K, S, D)   mask: (B, S) or (B, H, S)   lse: (B, H, T)
// With AttentionParams::seq_major those six are (B, T, H, D) and (B, S, K, D) instead, the
// layout projections produce, so no transpose is needed around the op. One head's rows are
// then H·D elements apart; tasks there take a batch element and a group of heads, copy the
// group into contiguous (heads, len, D) scratch first and copy results back (gather_heads).
// With K < H the kernels always take that route, with groups of whole key/value heads: a task owns
// the H / K query heads of each of its key/value heads and sums their dk, dv in its packed copy, so
// no key/value row is written by two tasks and nothing is repeated in memory.
//
// Forward, one task per (bh, query block): Qt (D, BQ) is the transposed query block; for
// each key block St (BK, BQ) = scale·K_blk·Qt + mask, an online softmax runs down the
// columns (running max m and sum l per query), and out_blk (BQ, D) = corr·out_blk + Stᵀ·V_blk.
// Working on Sᵀ makes the per-query max and sum plain vector operations across queries.
//
// Backward, one task per (bh, run of key blocks): Kt, Vt (D, BK) are transposed once per key
// block; for each query block S (BQ, BK) is recomputed, P = exp(S − lse), dP = dO·Vt,
// dS = P⊙(dP − Di) with Di = rowsum(dO⊙out); dV += Pᵀ·dO and dK += scale·dSᵀ·Q go to rows the
// task owns, dQ += scale·dS·K to the task's dq (or its private partial, summed afterwards
// in a fixed order when B·H is below the thread count). No atomics: results are
// deterministic for a given thread count.
//
// Dropout keeps probability (b, h, t, s) when uniform_at(seed, rng_offset, ((bh·T)+t)·S+s) ≥ p
// (with rng_rows / rng_row_start set: ((bh·rng_rows)+rng_row_start+t)·S+s, the rows of a longer query)
// and scales it by 1/(1−p); lse and the softmax sum are taken before dropout.
// A query row that sees no key (all masked with −inf) gets out 0 and lse 0.
// Soft-capping (Gemma 2) maps each score tile to softcap·tanh(S / softcap) right after its matmul, before the
// mask and the window; backward keeps 1 − tanh² of the recomputed tile and multiplies dS by it.
// A sliding window (causal only) hides key s from query t when t + S − T − s >= window: forward
// starts each query block at its oldest visible key and backward ends each key block's query
// loop at its newest viewer, so work grows as T·window; the tiles that straddle the window's edge
// get the hidden scores set to −inf (forward) or probabilities to 0 (backward) by hide_old_keys_*.
// Packed sequences (key_begin (B, T), causal only) hide from query t every key before key_begin[b, t], the start
// of its own example: like a window that differs per query. As key_begin never decreases along t, forward starts
// each query block at its first query's key_begin and backward ends each key block's query loop at the first
// query whose key_begin lies past the block, so no tile lying wholly between two examples is computed; tiles that
// straddle a boundary get the other example's scores set to −inf or probabilities to 0 by hide_other_examples_*.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "fusetrain/core/cpu.h"
#include "fusetrain/core/half.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/dense_kernels.h"
#include "kernels/cpu/philox_avx2.h"
#include "kernels/cpu/philox_avx512.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/rng.h"

// GCC 12 flags the _mm512_undefined_ps() inside its own intrinsics as maybe-uninitialized.
#ifndef __clang__
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace fusetrain::kernels {

namespace {

constexpr int64_t kBlockQ = 64;  // BQ
constexpr int64_t kBlockK = 64;  // BK
// A causal offset that never masks anything (j − offset and i + offset stay in range).
constexpr int64_t kNoCausal = int64_t{1} << 40;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Floats rounded up to whole 64-byte lines, so every scratch slice stays aligned.
int64_t line_floats(int64_t n) { return (n + 15) / 16 * 16; }

// The arithmetic of one tile, in portable, AVX2 and AVX-512 flavours (TileOps below).
//
// matmul: C (m, n) = alpha·A·B, plus C's old contents if `accumulate`. A (m, k) has element
//   (i, p) at a[i·a_rs + p·a_cs] (any strides, so Aᵀ is free); B (k, n) has contiguous rows
//   b + p·ldb; C rows are c + i·ldc.
// forward_softmax: st (nk, mq), row j = key, column i = query, holds scale·q·k. Adds
//   mask[j], sets query i < j − causal_offset to −inf, then updates m, l (mq) and writes
//   corr (mq) = exp(m_old − m_new) and st = exp(st − m_new).
// scale_rows: x (rows, n) row i *= factor[i].
// backward_probs: s (mq, nk), row i = query, holds scale·q·k; s = exp(s + mask[j] − lse[i]) for
//   keys j <= i + causal_offset, else 0.
// backward_ds_row: with keep (n) multipliers: dp *= keep; then dp = p·(dp − di); p *= keep.
// dropout_row: out[j] = 1/(1−p) or 0 for elements first .. first+n−1 of the stream.
// soft_cap: x (rows, n) = cap·tanh(x / cap); with `grad`, grad (rows, n, rows ld apart too) = 1 − tanh².
struct TileOps {
  void (*matmul)(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);
  void (*forward_softmax)(float* st, int64_t ld, int64_t nk, int64_t mq, const float* mask, int64_t causal_offset,
                          float* m, float* l, float* corr);
  void (*scale_rows)(float* x, int64_t ld, int64_t rows, int64_t n, const float* factor);
  void (*backward_probs)(float* s, int64_t ld, int64_t mq, int64_t nk, const float* mask, int64_t causal_offset,
                         const float* lse);
  void (*backward_ds_row)(float* p, float* dp, int64_t n, float di, const float* keep);
  void (*dropout_row)(uint64_t seed, uint64_t offset, uint64_t first, int64_t n, float p, float* out);
  void (*soft_cap)(float* x, int64_t ld, int64_t rows, int64_t n, float cap, float* grad);
  // st[j·ld + i] = bias[i·bias_ld + j] for i < mq, j < nk: a score bias tile (mq, nk) written transposed, the
  // forward's (keys, queries) layout, for the scores' product to add onto.
  void (*bias_columns)(float* st, int64_t ld, const float* bias, int64_t bias_ld, int64_t mq, int64_t nk);
};

// ---------------------------------------------------------------------------
// Portable tile ops
// ---------------------------------------------------------------------------

void matmul_portable(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs,
                     const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    float* crow = c + i * ldc;
    float acc[64];  // one 64-column strip of C row i
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
      const int64_t nj = std::min<int64_t>(64, n - j0);
      for (int64_t j = 0; j < nj; ++j) acc[j] = 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        const float av = a[i * a_rs + p * a_cs];
        const float* brow = b + p * ldb + j0;
        for (int64_t j = 0; j < nj; ++j) acc[j] += av * brow[j];
      }
      for (int64_t j = 0; j < nj; ++j) crow[j0 + j] = alpha * acc[j] + (accumulate ? crow[j0 + j] : 0.0f);
    }
  }
}

void forward_softmax_portable(float* st, int64_t ld, int64_t nk, int64_t mq, const float* mask, int64_t causal_offset,
                              float* m, float* l, float* corr) {
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    if (mask)
      for (int64_t i = 0; i < mq; ++i) row[i] += mask[j];
    const int64_t hidden = std::clamp<int64_t>(j - causal_offset, 0, mq);
    for (int64_t i = 0; i < hidden; ++i) row[i] = kNegInf;
  }
  for (int64_t i = 0; i < mq; ++i) {
    float m_new = m[i];
    for (int64_t j = 0; j < nk; ++j) m_new = std::max(m_new, st[j * ld + i]);
    const float base = m_new == kNegInf ? 0.0f : m_new;  // no key seen yet: every p is 0
    corr[i] = std::exp(m[i] - base);
    float sum = 0.0f;
    for (int64_t j = 0; j < nk; ++j) {
      float p = std::exp(st[j * ld + i] - base);
      st[j * ld + i] = p;
      sum += p;
    }
    l[i] = l[i] * corr[i] + sum;
    m[i] = m_new;
  }
}

void bias_columns_portable(float* st, int64_t ld, const float* bias, int64_t bias_ld, int64_t mq, int64_t nk) {
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t i = 0; i < mq; ++i) st[j * ld + i] = bias[i * bias_ld + j];
}

void scale_rows_portable(float* x, int64_t ld, int64_t rows, int64_t n, const float* factor) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) x[i * ld + j] *= factor[i];
}

void backward_probs_portable(float* s, int64_t ld, int64_t mq, int64_t nk, const float* mask, int64_t causal_offset,
                             const float* lse) {
  for (int64_t i = 0; i < mq; ++i) {
    float* row = s + i * ld;
    const int64_t visible = std::clamp<int64_t>(i + causal_offset + 1, 0, nk);
    for (int64_t j = 0; j < visible; ++j) row[j] = std::exp(row[j] + (mask ? mask[j] : 0.0f) - lse[i]);
    for (int64_t j = visible; j < nk; ++j) row[j] = 0.0f;
  }
}

void backward_ds_row_portable(float* p, float* dp, int64_t n, float di, const float* keep) {
  for (int64_t j = 0; j < n; ++j) {
    const float k = keep ? keep[j] : 1.0f;
    dp[j] = p[j] * (dp[j] * k - di);
    p[j] *= k;
  }
}

void dropout_row_portable(uint64_t seed, uint64_t offset, uint64_t first, int64_t n, float p, float* out) {
  const float keep_scale = 1.0f / (1.0f - p);
  const uint64_t end = first + static_cast<uint64_t>(n);
  for (uint64_t block = first >> 2; block * 4 < end; ++block) {
    float u[4];
    uniform4(seed, offset, block, u);
    for (uint64_t e = std::max(block * 4, first); e < std::min(block * 4 + 4, end); ++e)
      out[e - first] = u[e & 3] >= p ? keep_scale : 0.0f;
  }
}

void soft_cap_portable(float* x, int64_t ld, int64_t rows, int64_t n, float cap, float* grad) {
  const float inverse = 1.0f / cap;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float t = std::tanh(x[i * ld + j] * inverse);
      x[i * ld + j] = cap * t;
      if (grad) grad[i * ld + j] = 1.0f - t * t;
    }
}

constexpr TileOps kPortableOps{matmul_portable,         forward_softmax_portable, scale_rows_portable,
                               backward_probs_portable, backward_ds_row_portable, dropout_row_portable,
                               soft_cap_portable,       bias_columns_portable};

// ---------------------------------------------------------------------------
// AVX-512 tile ops
// ---------------------------------------------------------------------------

using cpu_basic::exp16;
using cpu_basic::tail_mask;

// C's block (R rows × NV vectors of 16 columns, the last masked by `last`) = alpha·acc, plus C's old contents if
// `accumulate`: the f32 and bf16 blocks' common store.
template <int R, int NV>
FT_AVX512_INLINE void store_block(const __m512 (&acc)[R][NV], float alpha, float* c, int64_t ldc, bool accumulate,
                                  __mmask16 last) {
  const __m512 scale = _mm512_set1_ps(alpha);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* crow = c + r * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 lanes = v == NV - 1 ? last : __mmask16(0xFFFF);
      __m512 x = _mm512_mul_ps(acc[r][v], scale);
      if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(lanes, crow + 16 * v));
      _mm512_mask_storeu_ps(crow + 16 * v, lanes, x);
    }
  }
}

// C (m, n) walked in blocks of up to 4 rows × 64 columns: block(i0, rows, j0, vectors, last) for each, `vectors`
// vectors of 16 columns, the last masked by `last`. The f32 and bf16 products' common walk.
template <typename Block>
FT_AVX512_INLINE void for_each_block(int64_t m, int64_t n, Block&& block) {
  for (int64_t j0 = 0; j0 < n; j0 += 64) {
    const int64_t nj = std::min<int64_t>(64, n - j0);
    const int64_t vectors = (nj + 15) / 16;
    const __mmask16 last = tail_mask(nj - 16 * (vectors - 1));
    for (int64_t i0 = 0; i0 < m; i0 += 4) block(i0, std::min<int64_t>(4, m - i0), j0, vectors, last);
  }
}

// R rows × NV vectors of 16 columns of C; the last vector is masked by `last`.
template <int R, int NV>
FT_AVX512 void matmul_block_avx512(int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                                   int64_t ldb, float* c, int64_t ldc, bool accumulate, __mmask16 last) {
  __m512 acc[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const float* brow = b + p * ldb;
    const float* acol = a + p * a_cs;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, brow + 16 * v) : _mm512_loadu_ps(brow + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(acol[r * a_rs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  store_block<R, NV>(acc, alpha, c, ldc, accumulate, last);
}

using MatmulBlock = void (*)(int64_t, float, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t,
                             bool, __mmask16);

template <int R>
constexpr MatmulBlock kBlocksOfRows[4] = {matmul_block_avx512<R, 1>, matmul_block_avx512<R, 2>,
                                          matmul_block_avx512<R, 3>, matmul_block_avx512<R, 4>};
constexpr const MatmulBlock* kMatmulBlocks[4] = {kBlocksOfRows<1>, kBlocksOfRows<2>, kBlocksOfRows<3>,
                                                 kBlocksOfRows<4>};

FT_AVX512 void matmul_avx512(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs,
                             const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for_each_block(m, n, [&](int64_t i0, int64_t rows, int64_t j0, int64_t vectors, __mmask16 last) {
    kMatmulBlocks[rows - 1][vectors - 1](k, alpha, a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, c + i0 * ldc + j0, ldc,
                                         accumulate, last);
  });
}

FT_AVX512 void forward_softmax_avx512(float* st, int64_t ld, int64_t nk, int64_t mq, const float* mask,
                                      int64_t causal_offset, float* m, float* l, float* corr) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    const int64_t hidden = std::clamp<int64_t>(j - causal_offset, 0, mq);
    if (!mask && hidden == 0) continue;
    const __m512 bias = _mm512_set1_ps(mask ? mask[j] : 0.0f);
    for (int64_t i = 0; i < mq; i += 16) {
      const __mmask16 lanes = tail_mask(mq - i);
      __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, row + i), bias);
      x = _mm512_mask_mov_ps(x, tail_mask(std::clamp<int64_t>(hidden - i, 0, 16)), neg_inf);
      _mm512_mask_storeu_ps(row + i, lanes, x);
    }
  }
  for (int64_t i = 0; i < mq; i += 16) {
    const __mmask16 lanes = tail_mask(mq - i);
    const __m512 m_old = _mm512_mask_loadu_ps(neg_inf, lanes, m + i);
    __m512 m_new = m_old;
    for (int64_t j = 0; j < nk; ++j)
      m_new = _mm512_max_ps(m_new, _mm512_mask_loadu_ps(neg_inf, lanes, st + j * ld + i));
    // Queries that have seen no key yet keep base 0, so exp(−inf − 0) = 0 and no NaN appears.
    const __m512 base = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    const __m512 c = exp16(_mm512_sub_ps(m_old, base));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; ++j) {
      float* x = st + j * ld + i;
      const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x), base));
      _mm512_mask_storeu_ps(x, lanes, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_mask_storeu_ps(corr + i, lanes, c);
    _mm512_mask_storeu_ps(l + i, lanes, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, l + i), c, sum));
    _mm512_mask_storeu_ps(m + i, lanes, m_new);
  }
}

// Each key's 16 queries gathered from 16 bias rows (lines the next 15 keys read again from L1).
FT_AVX512 void bias_columns_avx512(float* st, int64_t ld, const float* bias, int64_t bias_ld, int64_t mq, int64_t nk) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(bias_ld)));
  for (int64_t i0 = 0; i0 < mq; i0 += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(mq - i0 >= 16 ? 0xFFFF : (1u << (mq - i0)) - 1);
    const float* base = bias + i0 * bias_ld;
    for (int64_t j = 0; j < nk; ++j)
      _mm512_mask_storeu_ps(st + j * ld + i0, lanes,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, rows, base + j, 4));
  }
}

FT_AVX512 void scale_rows_avx512(float* x, int64_t ld, int64_t rows, int64_t n, const float* factor) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 f = _mm512_set1_ps(factor[i]);
    float* row = x + i * ld;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = tail_mask(n - j);
      _mm512_mask_storeu_ps(row + j, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + j), f));
    }
  }
}

FT_AVX512 void backward_probs_avx512(float* s, int64_t ld, int64_t mq, int64_t nk, const float* mask,
                                     int64_t causal_offset, const float* lse) {
  for (int64_t i = 0; i < mq; ++i) {
    float* row = s + i * ld;
    const int64_t visible = std::clamp<int64_t>(i + causal_offset + 1, 0, nk);
    const __m512 shift = _mm512_set1_ps(lse[i]);
    for (int64_t j = 0; j < nk; j += 16) {
      const __mmask16 lanes = tail_mask(nk - j);
      __m512 x = _mm512_maskz_loadu_ps(lanes, row + j);
      if (mask) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(lanes, mask + j));
      const __m512 p =
          _mm512_maskz_mov_ps(tail_mask(std::clamp<int64_t>(visible - j, 0, 16)), exp16(_mm512_sub_ps(x, shift)));
      _mm512_mask_storeu_ps(row + j, lanes, p);
    }
  }
}

FT_AVX512 void backward_ds_row_avx512(float* p, float* dp, int64_t n, float di, const float* keep) {
  const __m512 d = _mm512_set1_ps(di);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    __m512 pv = _mm512_maskz_loadu_ps(lanes, p + j);
    __m512 dv = _mm512_maskz_loadu_ps(lanes, dp + j);
    if (keep) {
      const __m512 k = _mm512_maskz_loadu_ps(lanes, keep + j);
      dv = _mm512_mul_ps(dv, k);
      _mm512_mask_storeu_ps(p + j, lanes, _mm512_mul_ps(pv, k));
    }
    _mm512_mask_storeu_ps(dp + j, lanes, _mm512_mul_ps(pv, _mm512_sub_ps(dv, d)));
  }
}

// Dropout multipliers (0 or 1 / (1 - p)) of stream elements first .. first + n - 1, 64 at a time.
FT_AVX512 void dropout_row_avx512(uint64_t seed, uint64_t offset, uint64_t first, int64_t n, float p, float* out) {
  const __m512 keep_scale = _mm512_set1_ps(1.0f / (1.0f - p));
  const __m512 threshold = _mm512_set1_ps(p);
  const uint64_t end = first + static_cast<uint64_t>(n);
  for (uint64_t block0 = first >> 2; block0 * 4 < end; block0 += 16) {
    alignas(64) uint32_t lo[16], hi[16];
    for (int lane = 0; lane < 16; ++lane) {
      lo[lane] = static_cast<uint32_t>(block0 + lane);
      hi[lane] = static_cast<uint32_t>((block0 + lane) >> 32);
    }
    __m512i bits[4];
    cpu_basic::philox_element_order(
        cpu_basic::philox4x32_16(_mm512_load_si512(lo), _mm512_load_si512(hi), offset, seed), bits);
    alignas(64) float ordered[64];
    for (int q = 0; q < 4; ++q) {
      const __m512 u = cpu_basic::to_uniform16(bits[q]);
      _mm512_store_ps(ordered + 16 * q, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, threshold, _CMP_GE_OQ), keep_scale));
    }
    const uint64_t lo_e = std::max(block0 * 4, first), hi_e = std::min(block0 * 4 + 64, end);
    std::memcpy(out + (lo_e - first), ordered + (lo_e - block0 * 4), (hi_e - lo_e) * sizeof(float));
  }
}

FT_AVX512 void soft_cap_avx512(float* x, int64_t ld, int64_t rows, int64_t n, float cap, float* grad) {
  const __m512 c = _mm512_set1_ps(cap), inverse = _mm512_set1_ps(1.0f / cap), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < rows; ++i) {
    float* row = x + i * ld;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = tail_mask(n - j);
      const __m512 t = cpu_basic::tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + j), inverse));
      _mm512_mask_storeu_ps(row + j, lanes, _mm512_mul_ps(c, t));
      if (grad) _mm512_mask_storeu_ps(grad + i * ld + j, lanes, _mm512_fnmadd_ps(t, t, one));
    }
  }
}

constexpr TileOps kAvx512Ops{matmul_avx512,         forward_softmax_avx512, scale_rows_avx512,
                             backward_probs_avx512, backward_ds_row_avx512, dropout_row_avx512,
                             soft_cap_avx512,       bias_columns_avx512};

// ---------------------------------------------------------------------------
// AVX2 tile ops (CPUs without AVX-512): the AVX-512 ops' arithmetic on 8 lanes
// ---------------------------------------------------------------------------

using cpu_basic::exp8;
using cpu_basic::lanes8;
using cpu_basic::load8;
using cpu_basic::store8;

// R rows × NV vectors of 8 columns of C; the last vector holds `last_n` (1..8) columns.
template <int R, int NV>
FT_AVX2 void matmul_block_avx2(int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                               int64_t ldb, float* c, int64_t ldc, bool accumulate, int64_t last_n) {
  __m256 acc[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const float* brow = b + p * ldb;
    const float* acol = a + p * a_cs;
    __m256 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = load8(brow + 8 * v, v == NV - 1 ? last_n : 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(acol + r * a_rs);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  const __m256 scale = _mm256_set1_ps(alpha);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* crow = c + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const int64_t n = v == NV - 1 ? last_n : 8;
      __m256 x = _mm256_mul_ps(acc[r][v], scale);
      if (accumulate) x = _mm256_add_ps(x, load8(crow + 8 * v, n));
      store8(crow + 8 * v, n, x);
    }
  }
}

using MatmulBlockAvx2 = void (*)(int64_t, float, const float*, int64_t, int64_t, const float*, int64_t, float*,
                                 int64_t, bool, int64_t);
template <int R>
constexpr MatmulBlockAvx2 kAvx2BlocksOfRows[2] = {matmul_block_avx2<R, 1>, matmul_block_avx2<R, 2>};
constexpr const MatmulBlockAvx2* kAvx2MatmulBlocks[4] = {kAvx2BlocksOfRows<1>, kAvx2BlocksOfRows<2>,
                                                         kAvx2BlocksOfRows<3>, kAvx2BlocksOfRows<4>};

// Blocks of 4 rows × 16 columns: 8 accumulators, 2 B vectors and a broadcast A value in 16 registers.
FT_AVX2 void matmul_avx2(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs,
                         const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    const int64_t vectors = (nj + 7) / 8;
    const int64_t last_n = nj - 8 * (vectors - 1);
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const int64_t rows = std::min<int64_t>(4, m - i0);
      kAvx2MatmulBlocks[rows - 1][vectors - 1](k, alpha, a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, c + i0 * ldc + j0,
                                               ldc, accumulate, last_n);
    }
  }
}

FT_AVX2 void forward_softmax_avx2(float* st, int64_t ld, int64_t nk, int64_t mq, const float* mask,
                                  int64_t causal_offset, float* m, float* l, float* corr) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    const int64_t hidden = std::clamp<int64_t>(j - causal_offset, 0, mq);
    if (!mask && hidden == 0) continue;
    const __m256 bias = _mm256_set1_ps(mask ? mask[j] : 0.0f);
    for (int64_t i = 0; i < mq; i += 8) {
      const __m256 x = _mm256_add_ps(load8(row + i, mq - i), bias);
      store8(row + i, mq - i, _mm256_blendv_ps(x, neg_inf, _mm256_castsi256_ps(lanes8(hidden - i))));
    }
  }
  for (int64_t i = 0; i < mq; i += 8) {
    const int64_t n = mq - i;
    const __m256 live = _mm256_castsi256_ps(lanes8(n));
    const __m256 m_old = _mm256_blendv_ps(neg_inf, load8(m + i, n), live);
    __m256 m_new = m_old;
    for (int64_t j = 0; j < nk; ++j) m_new = _mm256_max_ps(m_new, _mm256_blendv_ps(neg_inf, load8(st + j * ld + i, n), live));
    // Queries that have seen no key yet keep base 0, so exp(−inf − 0) = 0 and no NaN appears.
    const __m256 base = _mm256_blendv_ps(m_new, _mm256_setzero_ps(), _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ));
    const __m256 c = exp8(_mm256_sub_ps(m_old, base));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < nk; ++j) {
      float* x = st + j * ld + i;
      const __m256 p = exp8(_mm256_sub_ps(load8(x, n), base));
      store8(x, n, p);
      sum = _mm256_add_ps(sum, p);
    }
    store8(corr + i, n, c);
    store8(l + i, n, _mm256_fmadd_ps(load8(l + i, n), c, sum));
    store8(m + i, n, m_new);
  }
}

FT_AVX2 void scale_rows_avx2(float* x, int64_t ld, int64_t rows, int64_t n, const float* factor) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m256 f = _mm256_set1_ps(factor[i]);
    float* row = x + i * ld;
    for (int64_t j = 0; j < n; j += 8) store8(row + j, n - j, _mm256_mul_ps(load8(row + j, n - j), f));
  }
}

FT_AVX2 void backward_probs_avx2(float* s, int64_t ld, int64_t mq, int64_t nk, const float* mask, int64_t causal_offset,
                                 const float* lse) {
  for (int64_t i = 0; i < mq; ++i) {
    float* row = s + i * ld;
    const int64_t visible = std::clamp<int64_t>(i + causal_offset + 1, 0, nk);
    const __m256 shift = _mm256_set1_ps(lse[i]);
    for (int64_t j = 0; j < nk; j += 8) {
      __m256 x = load8(row + j, nk - j);
      if (mask) x = _mm256_add_ps(x, load8(mask + j, nk - j));
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, shift)), _mm256_castsi256_ps(lanes8(visible - j)));
      store8(row + j, nk - j, p);
    }
  }
}

FT_AVX2 void backward_ds_row_avx2(float* p, float* dp, int64_t n, float di, const float* keep) {
  const __m256 d = _mm256_set1_ps(di);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 pv = load8(p + j, n - j);
    __m256 dv = load8(dp + j, n - j);
    if (keep) {
      const __m256 k = load8(keep + j, n - j);
      dv = _mm256_mul_ps(dv, k);
      store8(p + j, n - j, _mm256_mul_ps(pv, k));
    }
    store8(dp + j, n - j, _mm256_mul_ps(pv, _mm256_sub_ps(dv, d)));
  }
}

FT_AVX2 void soft_cap_avx2(float* x, int64_t ld, int64_t rows, int64_t n, float cap, float* grad) {
  const __m256 c = _mm256_set1_ps(cap), inverse = _mm256_set1_ps(1.0f / cap), one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < rows; ++i) {
    float* row = x + i * ld;
    for (int64_t j = 0; j < n; j += 8) {
      const __m256 t = cpu_basic::tanh8(_mm256_mul_ps(load8(row + j, n - j), inverse));
      store8(row + j, n - j, _mm256_mul_ps(c, t));
      if (grad) store8(grad + i * ld + j, n - j, _mm256_fnmadd_ps(t, t, one));
    }
  }
}

// Dropout multipliers (0 or 1 / (1 - p)) of stream elements first .. first + n - 1, 32 at a time.
FT_AVX2 void dropout_row_avx2(uint64_t seed, uint64_t offset, uint64_t first, int64_t n, float p, float* out) {
  const __m256 keep_scale = _mm256_set1_ps(1.0f / (1.0f - p));
  const __m256 threshold = _mm256_set1_ps(p);
  const uint64_t end = first + static_cast<uint64_t>(n);
  for (uint64_t block0 = first >> 2; block0 * 4 < end; block0 += 8) {
    alignas(32) uint32_t lo[8], hi[8];
    for (int lane = 0; lane < 8; ++lane) {
      lo[lane] = static_cast<uint32_t>(block0 + lane);
      hi[lane] = static_cast<uint32_t>((block0 + lane) >> 32);
    }
    __m256i bits[4];
    cpu_basic::philox_element_order(
        cpu_basic::philox4x32_8(_mm256_load_si256(reinterpret_cast<const __m256i*>(lo)),
                                _mm256_load_si256(reinterpret_cast<const __m256i*>(hi)), offset, seed),
        bits);
    alignas(32) float ordered[32];
    for (int q = 0; q < 4; ++q) {
      const __m256 u = cpu_basic::to_uniform8(bits[q]);
      _mm256_store_ps(ordered + 8 * q, _mm256_and_ps(_mm256_cmp_ps(u, threshold, _CMP_GE_OQ), keep_scale));
    }
    const uint64_t lo_e = std::max(block0 * 4, first), hi_e = std::min(block0 * 4 + 32, end);
    std::memcpy(out + (lo_e - first), ordered + (lo_e - block0 * 4), (hi_e - lo_e) * sizeof(float));
  }
}

constexpr TileOps kAvx2Ops{matmul_avx2,         forward_softmax_avx2, scale_rows_avx2,
                           backward_probs_avx2, backward_ds_row_avx2, dropout_row_avx2,
                           soft_cap_avx2,       bias_columns_portable};  // the bias's transposing copy: scalar

const TileOps& select_ops() {
  return cpu_basic::use_avx512() ? kAvx512Ops : cpu_basic::use_avx2() ? kAvx2Ops : kPortableOps;
}

// ---------------------------------------------------------------------------
// bf16 tile products (AVX512-BF16)
// ---------------------------------------------------------------------------
//
// Under mixed precision (bf16 q, k, v) on a CPU with AVX512-BF16 the tiles' products multiply bf16 pairs
// (vdpbf16ps) and accumulate in f32, as PyTorch's bf16 attention hands its products to the GEMM: q, k, v, already
// bf16, pass exactly; the probabilities P, dS and an f32 dO are rounded to nearest even on the way in. The operands
// are packed as A: 32-bit words holding the pair (A[i, 2p], A[i, 2p + 1]), B: rows p of words holding
// (B[2p, j], B[2p + 1, j]); an odd k pads a zero. Each head's q, k, v and dO are packed once (the kernels' HeadPacks),
// each block's Qᵀ, Kᵀ, Vᵀ once, and P and dS per product.

#define FT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))


// x (n ≤ 16 floats) and y rounded to bf16 and interleaved: word j = (x[j], y[j]), x in the low half.
FT_AVX512_BF16 inline __m512i interleave_bf16(__m512 x, __m512 y) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(y, x));
}

// dst (ceil(rows / 2), ld words): word (p, j) = (src[2p][j], src[2p + 1][j]) for j < cols; rows src_ld apart.
FT_AVX512_BF16 void pack_row_pairs(uint32_t* dst, int64_t ld, const float* src, int64_t src_ld, int64_t rows,
                                   int64_t cols) {
  for (int64_t r = 0; r < rows; r += 2) {
    const float* x = src + r * src_ld;
    const float* y = r + 1 < rows ? x + src_ld : nullptr;
    uint32_t* out = dst + (r / 2) * ld;
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 lanes = tail_mask(cols - j);
      const __m512 xv = _mm512_maskz_loadu_ps(lanes, x + j);
      const __m512 yv = y ? _mm512_maskz_loadu_ps(lanes, y + j) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(out + j, lanes, interleave_bf16(xv, yv));
    }
  }
}

// dst (rows, ld words): row i holds src row i (cols floats) rounded to bf16, pairs of columns per word.
FT_AVX512_BF16 void pack_rows(uint32_t* dst, int64_t ld, const float* src, int64_t src_ld, int64_t rows,
                              int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* x = src + i * src_ld;
    uint16_t* out = reinterpret_cast<uint16_t*>(dst + i * ld);
    for (int64_t j = 0; j < cols; j += 32) {
      const __mmask16 lo = tail_mask(cols - j), hi = tail_mask(std::max<int64_t>(cols - j - 16, 0));
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + j + 16),
                                                     _mm512_maskz_loadu_ps(lo, x + j));
      const int64_t n = std::min<int64_t>(32, (cols - j + 1) / 2 * 2);  // an odd tail takes its zero pad
      _mm512_mask_storeu_epi16(out + j, n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1, v);
    }
  }
}

// x (n floats) rounded to the nearest bf16 in place (to nearest even), still as floats.
FT_AVX512_BF16 void round_to_bf16_values(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_mask(n - i);
    const __m256i half = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, x + i));
    _mm512_mask_storeu_ps(x + i, lanes, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
}

// R rows × NV vectors of 16 columns of C from kp pair-words: A word (r, p) at a[r·a_rs + p·a_cs], B word (p, j) at
// b[p·ldb + j].
template <int R, int NV>
FT_AVX512_BF16 void matmul_bf16_block(int64_t kp, float alpha, const uint32_t* a, int64_t a_rs, int64_t a_cs,
                                      const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                                      __mmask16 last) {
  __m512 acc[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const uint32_t* brow = b + p * ldb;
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_epi32(last, brow + 16 * v) : _mm512_loadu_si512(brow + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a[r * a_rs + p * a_cs]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
    }
  }
  store_block<R, NV>(acc, alpha, c, ldc, accumulate, last);
}

using MatmulBf16Block = void (*)(int64_t, float, const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, float*,
                                 int64_t, bool, __mmask16);
template <int R>
constexpr MatmulBf16Block kBf16BlocksOfRows[4] = {matmul_bf16_block<R, 1>, matmul_bf16_block<R, 2>,
                                                  matmul_bf16_block<R, 3>, matmul_bf16_block<R, 4>};
constexpr const MatmulBf16Block* kMatmulBf16Blocks[4] = {kBf16BlocksOfRows<1>, kBf16BlocksOfRows<2>,
                                                         kBf16BlocksOfRows<3>, kBf16BlocksOfRows<4>};

// A product's operands in pair layout: A word (i, pair p) at p[i·rs + p·cs]; B word (pair p, j) at p[p·ld + j].
struct PackedA {
  const uint32_t* p;
  int64_t rs, cs;
};
struct PackedB {
  const uint32_t* p;
  int64_t ld;
};

// A (m, k), element (i, p) at a[i·a_rs + p·a_cs], packed into dst: row-major A (a_cs = 1) pairs neighbours, A read
// transposed (a_rs = 1) pairs stored rows; m · ((k + 1) / 2) words either way.
FT_AVX512_BF16 PackedA pack_a(int64_t m, int64_t k, const float* a, int64_t a_rs, int64_t a_cs, uint32_t* dst) {
  const int64_t kp = (k + 1) / 2;
  if (a_cs == 1) {
    pack_rows(dst, kp, a, a_rs, m, k);
    return {dst, kp, 1};
  }
  pack_row_pairs(dst, m, a, a_cs, k, m);
  return {dst, 1, m};
}

// B (k, n), rows ldb apart, packed into dst: (k + 1) / 2 rows of n words rounded up to 16.
FT_AVX512_BF16 PackedB pack_b(int64_t k, int64_t n, const float* b, int64_t ldb, uint32_t* dst) {
  const int64_t ld = (n + 15) / 16 * 16;
  pack_row_pairs(dst, ld, b, ldb, k, n);
  return {dst, ld};
}

// C (m, n) = alpha·A·B (+ C) over k, both operands packed.
FT_AVX512_BF16 void matmul_packed(int64_t m, int64_t n, int64_t k, float alpha, PackedA a, PackedB b, float* c,
                                  int64_t ldc, bool accumulate) {
  const int64_t kp = (k + 1) / 2;
  for_each_block(m, n, [&](int64_t i0, int64_t rows, int64_t j0, int64_t vectors, __mmask16 last) {
    kMatmulBf16Blocks[rows - 1][vectors - 1](kp, alpha, a.p + i0 * a.rs, a.rs, a.cs, b.p + j0, b.ld,
                                             c + i0 * ldc + j0, ldc, accumulate, last);
  });
}

// TileOps::matmul's product with both operands rounded to bf16 and multiplied in pairs; an operand already packed
// (pa, pb) is used as it is, the others are packed into a_pack and b_pack. A is either row-major (a_cs = 1) or read
// transposed (a_rs = 1), as every call of the tiles reads it.
FT_AVX512_BF16 void matmul_bf16(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_rs,
                                int64_t a_cs, const PackedA* pa, const float* b, int64_t ldb, const PackedB* pb,
                                float* c, int64_t ldc, bool accumulate, uint32_t* a_pack, uint32_t* b_pack) {
  const PackedA ap = pa ? *pa : pack_a(m, k, a, a_rs, a_cs, a_pack);
  const PackedB bp = pb ? *pb : pack_b(k, n, b, ldb, b_pack);
  matmul_packed(m, n, k, alpha, ap, bp, c, ldc, accumulate);
}

// ---------------------------------------------------------------------------
// Kernels
// Sliding window on a forward tile St (nk, mq), row j = key, column i = query: key j is hidden from
// query i when i + offset − j >= window (offset: the tile's causal offset). Before forward_softmax.
void hide_old_keys_forward(float* st, int64_t ld, int64_t nk, int64_t mq, int64_t offset, int64_t window) {
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    for (int64_t i = std::max<int64_t>(0, j + window - offset); i < mq; ++i) row[i] = kNegInf;
  }
}

// The same on a backward tile P (mq, nk), row i = query: those probabilities become 0. After backward_probs.
void hide_old_keys_backward(float* p, int64_t ld, int64_t mq, int64_t nk, int64_t offset, int64_t window) {
  for (int64_t i = 0; i < mq; ++i) {
    float* row = p + i * ld;
    std::fill(row, row + std::clamp<int64_t>(i + offset - window + 1, 0, nk), 0.0f);
  }
}

// Packed sequences on a forward tile St (nk, mq) whose keys start at kb: key j is hidden from query i when
// kb + j < key_begin[i] (key_begin: the block's queries' first keys). Before forward_softmax.
void hide_other_examples_forward(float* st, int64_t ld, int64_t nk, int64_t mq, int64_t kb, const int64_t* key_begin) {
  for (int64_t i = 0; i < mq; ++i)
    for (int64_t j = 0; j < std::min(nk, key_begin[i] - kb); ++j) st[j * ld + i] = kNegInf;
}

// The same on a backward tile P (mq, nk): those probabilities become 0. After backward_probs.
void hide_other_examples_backward(float* p, int64_t ld, int64_t mq, int64_t nk, int64_t kb, const int64_t* key_begin) {
  for (int64_t i = 0; i < mq; ++i)
    std::fill(p + i * ld, p + i * ld + std::clamp<int64_t>(key_begin[i] - kb, 0, nk), 0.0f);
}

// ---------------------------------------------------------------------------

// Attributes and extents shared by forward and backward, read at plan time.
struct AttentionPlan {
  int64_t B = 0, H = 0, K = 0, T = 0, S = 0, D = 0;
  int64_t group = 1;       // query heads per key/value head, H / K
  bool seq_major = false;  // q, k, v, out and their gradients are (B, T, H, D) rather than (B, H, T, D)
  float scale = 1.0f;
  bool causal = false;
  int64_t window = 0;  // sliding window (causal only): query t sees keys s > t + S − T − window; 0: all
  float softcap = 0.0f;  // scores softcap·tanh(scores / softcap) before the mask; 0: none
  bool has_mask = false;
  size_t mask_at = 0;      // the input index of the mask, when has_mask
  int key_begin_at = -1;   // the input index of key_begin (B, T) i64 (packed sequences), or -1
  int64_t mask_heads = 1;  // 1: a (B, S) mask every head reads; H: a (B, H, S) one (a key bias per head: ALiBi)
  int bias_at = -1;        // the input index of the score bias (B|1, H|1, T, S), or -1
  int64_t bias_batch = 1, bias_heads = 1;  // its extents along B and H (1: broadcast)
  bool grouped = false;  // through packed f32 copies: seq-major layout, bf16 q, k, v or out, or K < H
  bool bf16_tiles = false;  // bf16 q, k, v on a CPU with AVX512-BF16: the tiles' products multiply bf16 pairs
  float dropout_p = 0.0f;
  uint64_t seed = 0;
  int64_t rng_rows = 0, rng_row_start = 0;  // the query rows whose dropout stream these T rows draw
  const TileOps* ops = nullptr;

  // first_extra: the index of the first optional input (the score bias when there is one, else the mask).
  AttentionPlan(const KernelCall& call, size_t q_at, size_t first_extra) {
    const Shape& q = call.inputs[q_at].shape;
    const Shape& k = call.inputs[q_at + 1].shape;
    const ops::AttentionParams& params = call.params<ops::AttentionParams>();
    seq_major = params.seq_major;
    B = q[0], H = seq_major ? q[2] : q[1], T = seq_major ? q[1] : q[2], S = seq_major ? k[1] : k[2], D = q[3];
    K = seq_major ? k[2] : k[1];
    group = K > 0 ? H / K : 1;
    scale = static_cast<float>(params.scale);
    causal = params.causal;
    window = params.window;
    softcap = static_cast<float>(params.softcap);
    dropout_p = static_cast<float>(params.dropout_p);
    seed = params.seed;
    rng_rows = params.stream_rows(T);
    rng_row_start = params.rng_row_start;
    if (params.score_bias) {
      bias_at = static_cast<int>(first_extra);
      bias_batch = call.inputs[first_extra].shape[0];
      bias_heads = call.inputs[first_extra].shape[1];
      ++first_extra;
    }
    const ops::AttentionExtras extras = ops::AttentionExtras::locate(
        call.inputs.size(), first_extra, call.inputs.size() > first_extra && call.inputs[first_extra].dtype == DType::i64);
    has_mask = extras.mask >= 0;
    mask_at = has_mask ? static_cast<size_t>(extras.mask) : 0;
    key_begin_at = extras.key_begin;
    if (has_mask && call.inputs[mask_at].shape.rank() == 3) mask_heads = call.inputs[mask_at].shape[1];
    grouped = seq_major || call.inputs[q_at].dtype != DType::f32 || params.out_dtype != DType::f32 || K != H;
    ops = &select_ops();
    bf16_tiles = call.inputs[q_at].dtype == DType::bf16 && ops == &kAvx512Ops && cpu_features().avx512_bf16;
  }
  // Rows of any tile (m ≤ this), and the largest k or n of a tile product.
  int64_t tile_rows() const { return std::min<int64_t>(std::max(kBlockQ, kBlockK), std::max(T, S)); }
  int64_t tile_extent() const { return std::max(D, tile_rows()); }
  // Words of one product's A and B packed (m × ceil(k / 2) and ceil(k / 2) × n rounded up to 16).
  int64_t a_pack_words() const { return line_floats(tile_rows() * ((tile_extent() + 1) / 2)); }
  int64_t b_pack_words() const { return line_floats((tile_extent() + 1) / 2 * ((tile_extent() + 15) / 16 * 16)); }
  // A key block's Kᵀ or Vᵀ (D, BK), or a query block's Qᵀ (D, BQ), as a packed B operand.
  int64_t block_words() const { return line_floats((D + 1) / 2 * ((tile_rows() + 15) / 16 * 16)); }
  // Scratch floats a thread's tile products need beyond the f32 tiles: with bf16_tiles one product's A and B and two
  // packed blocks, else none; the blocks start at block_pack(pack).
  int64_t pack_floats() const { return bf16_tiles ? a_pack_words() + b_pack_words() + 2 * block_words() : 0; }
  uint32_t* block_pack(float* pack) const { return reinterpret_cast<uint32_t*>(pack + a_pack_words() + b_pack_words()); }
  // C (m, n) = alpha·A·B (+ C): ops->matmul, or with bf16_tiles its bf16 form, which takes an operand already
  // packed where pa or pb is given and packs the others into `pack` (pack_floats()).
  void product(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_rs, int64_t a_cs,
               const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate, float* pack,
               const PackedA* pa = nullptr, const PackedB* pb = nullptr) const {
    if (bf16_tiles)
      matmul_bf16(m, n, k, alpha, a, a_rs, a_cs, pa, b, ldb, pb, c, ldc, accumulate, reinterpret_cast<uint32_t*>(pack),
                  reinterpret_cast<uint32_t*>(pack + a_pack_words()));
    else
      ops->matmul(m, n, k, alpha, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
  }
  // Words of a packed (len, D) block as A rows (len × (D + 1) / 2) and as B pairs of rows ((len + 1) / 2 × D rounded
  // up to 16), each rounded up to whole lines.
  int64_t rows_words(int64_t len) const { return line_floats(len * ((D + 1) / 2)); }
  int64_t pairs_words(int64_t len) const { return line_floats((len + 1) / 2 * ((D + 15) / 16 * 16)); }
  // Elements between consecutive rows, and between consecutive heads, of one batch element's
  // (len, heads, D) seq-major or (heads, len, D) block.
  int64_t row_stride(int64_t heads) const { return seq_major ? heads * D : D; }
  int64_t head_stride(int64_t len) const { return seq_major ? D : len * D; }
  // Local causal offset of a (query block t0, key block kb) tile: key j is visible to
  // query i when j <= i + offset.
  int64_t causal_offset(int64_t t0, int64_t kb) const { return causal ? t0 + S - T - kb : kNoCausal; }
  // Sliding window: the first key query t0 sees; one past the last query that sees key kb + nk − 1.
  int64_t window_key_begin(int64_t t0) const { return window > 0 ? std::max<int64_t>(0, t0 + S - T - window + 1) : 0; }
  int64_t window_query_end(int64_t kb, int64_t nk) const {
    return window > 0 ? std::clamp<int64_t>(kb + nk - 1 + window - (S - T), 0, T) : T;
  }
  // Whether the window hides some key of a tile with this causal offset from one of its mq queries.
  bool window_cuts(int64_t offset, int64_t mq) const { return window > 0 && offset + mq - 1 >= window; }
  // Batch element b's key_begin row (T), or null without packed sequences; the values are checked once per run.
  const int64_t* key_begin_row(const KernelArgs& args, int64_t b) const {
    return key_begin_at >= 0 ? args.inputs[size_t(key_begin_at)].data_as<int64_t>() + b * T : nullptr;
  }
  void check_key_begin(const KernelArgs& args) const {
    if (key_begin_at >= 0) ops::check_key_begin(args.inputs[size_t(key_begin_at)].data_as<int64_t>(), B, T, S);
  }
  // Packed sequences: the first key query block t0 sees (never before the window's), and one past the last query
  // that sees a key of block [kb, kb + nk).
  int64_t first_key(int64_t t0, const int64_t* key_begin) const {
    return std::max(window_key_begin(t0), key_begin ? key_begin[t0] : int64_t{0});
  }
  int64_t query_end(int64_t kb, int64_t nk, const int64_t* key_begin) const {
    const int64_t end = window_query_end(kb, nk);
    if (!key_begin) return end;
    return std::upper_bound(key_begin, key_begin + end, kb + nk - 1) - key_begin;
  }
  // The mask row (S) head bh (= b·H + h) reads, or null without a mask.
  const float* mask_row(const Tensor& mask, int64_t bh) const {
    return has_mask ? static_cast<const float*>(mask.data()) + (mask_heads > 1 ? bh : bh / H) * S : nullptr;
  }
  // The (T, S) score bias head bh (= b·H + h) reads, or null without one.
  const float* bias_of(const KernelArgs& args, int64_t bh) const {
    if (bias_at < 0) return nullptr;
    const int64_t b = bias_batch > 1 ? bh / H : 0, h = bias_heads > 1 ? bh % H : 0;
    return args.inputs[size_t(bias_at)].data_as<float>() + (b * bias_heads + h) * T * S;
  }
  // Head bh's (T, S) slab of the score bias's gradient (B, H, T, S), or null without a score bias.
  float* dbias_of(const KernelArgs& args, int64_t bh) const {
    return bias_at >= 0 ? args.outputs[3].data_as<float>() + bh * T * S : nullptr;
  }
  // Offset of row 0 of head bh in a (B, H, len, D) tensor (not seq-major).
  int64_t head_offset(int64_t bh, int64_t len) const { return bh * len * D; }
  // Dropout stream index of (bh, t, s).
  uint64_t drop_index(int64_t bh, int64_t t, int64_t s) const {
    return static_cast<uint64_t>((bh * rng_rows + rng_row_start + t) * S + s);
  }
};

// Seq-major heads are runs of D elements H·D apart: read head by head they touch a new,
// poorly prefetched line every row (measured: attention at half its contiguous speed). So
// the seq-major kernels work per (batch element, group of heads): the group's rows are
// copied in one sequential pass into (heads, len, D) f32 scratch, every tile loop reads those
// contiguous copies, and results are copied back the same way. bf16 operands (mixed precision
// keeps q, k, v and out in bf16) take the same route in either layout: widened exactly on the
// way in, rounded to nearest even (as Cast) on the way out.
constexpr int64_t kGroupBudgetFloats = int64_t{1} << 19;  // 2 MiB of packed operands per thread

// Heads per group: at most what fits kGroupBudgetFloats at `floats_per_head`, and few enough
// that B · groups keeps every thread busy; a multiple of `kv_group` (the query heads that share a
// key/value head), which divides H.
int64_t heads_per_group(int64_t B, int64_t H, int64_t floats_per_head, int threads, int64_t kv_group) {
  int64_t hg = std::clamp<int64_t>(kGroupBudgetFloats / std::max<int64_t>(floats_per_head, 1), 1, H);
  const int64_t groups_needed = (threads + B - 1) / std::max<int64_t>(B, 1);
  hg = std::max<int64_t>(1, std::min(hg, (H + groups_needed - 1) / groups_needed));
  return std::min(H, std::max<int64_t>(kv_group, hg / kv_group * kv_group));
}

// gather_heads and scatter_heads with AVX-512 and D a multiple of 16: each head's row moved in registers, bf16
// widened or rounded (to nearest even, as Cast) on the way. A row is a few vectors (D = 64: four), so calling the
// library's copy or conversion per row cost more than the row itself (measured: W7's attention, 197 tokens, spent
// a fifth of its time in them).
template <typename T>
FT_AVX512 void gather_heads_avx512(float* dst, const T* src, int64_t len, int64_t D, int64_t h0, int64_t hg,
                                   int64_t row_stride, int64_t head_stride) {
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < hg; ++h) {
      const T* row = src + t * row_stride + (h0 + h) * head_stride;
      float* to = dst + (h * len + t) * D;
      for (int64_t d = 0; d < D; d += 16) {
        if constexpr (std::is_same_v<T, uint16_t>)
          _mm512_storeu_ps(to + d, cpu_basic::bf16_to_f32_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d))));
        else
          _mm512_storeu_ps(to + d, _mm512_loadu_ps(row + d));
      }
    }
}
template <typename T>
FT_AVX512 void scatter_heads_avx512(T* dst, const float* src, int64_t len, int64_t D, int64_t h0, int64_t hg,
                                    int64_t row_stride, int64_t head_stride) {
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < hg; ++h) {
      const float* from = src + (h * len + t) * D;
      T* row = dst + t * row_stride + (h0 + h) * head_stride;
      for (int64_t d = 0; d < D; d += 16) {
        if constexpr (std::is_same_v<T, uint16_t>)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d), cpu_basic::f32_to_bf16_16(_mm512_loadu_ps(from + d)));
        else
          _mm512_storeu_ps(row + d, _mm512_loadu_ps(from + d));
      }
    }
}

// Heads [h0, h0 + hg) of one batch element's block `src` (rows row_stride and heads head_stride
// elements apart) -> dst (hg, len, D) f32, and back.
template <typename T>
void gather_heads(float* dst, const T* src, int64_t len, int64_t D, int64_t h0, int64_t hg, int64_t row_stride,
                  int64_t head_stride) {
  if (D % 16 == 0 && cpu_basic::use_avx512())
    return gather_heads_avx512(dst, src, len, D, h0, hg, row_stride, head_stride);
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < hg; ++h) {
      const T* row = src + t * row_stride + (h0 + h) * head_stride;
      float* to = dst + (h * len + t) * D;
      if constexpr (std::is_same_v<T, uint16_t>)
        bf16_to_float(to, row, static_cast<size_t>(D));
      else
        std::copy(row, row + D, to);
    }
}
template <typename T>
void scatter_heads(T* dst, const float* src, int64_t len, int64_t D, int64_t h0, int64_t hg, int64_t row_stride,
                   int64_t head_stride) {
  if (D % 16 == 0 && cpu_basic::use_avx512())
    return scatter_heads_avx512(dst, src, len, D, h0, hg, row_stride, head_stride);
  [[maybe_unused]] const cpu_basic::RoundBf16Fn round = cpu_basic::round_to_bf16_fn();
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < hg; ++h) {
      const float* from = src + (h * len + t) * D;
      T* row = dst + t * row_stride + (h0 + h) * head_stride;
      if constexpr (std::is_same_v<T, uint16_t>)
        round(row, from, D);
      else
        std::copy(from, from + D, row);
    }
}

// The packed copy of heads [h0, h0 + hg) of batch element b of an f32 or bf16 operand with
// `len` positions and `heads` heads (H, or K for k, v and their gradients), and the way back.
void gather_operand(float* dst, const Tensor& t, const AttentionPlan& p, int64_t len, int64_t heads, int64_t b,
                    int64_t h0, int64_t hg) {
  const int64_t base = b * len * heads * p.D;
  if (t.dtype() == DType::bf16)
    gather_heads(dst, t.data_as<uint16_t>() + base, len, p.D, h0, hg, p.row_stride(heads), p.head_stride(len));
  else
    gather_heads(dst, t.data_as<float>() + base, len, p.D, h0, hg, p.row_stride(heads), p.head_stride(len));
}
void scatter_operand(const Tensor& t, const float* src, const AttentionPlan& p, int64_t len, int64_t heads, int64_t b,
                     int64_t h0, int64_t hg) {
  const int64_t base = b * len * heads * p.D;
  if (t.dtype() == DType::bf16)
    scatter_heads(t.data_as<uint16_t>() + base, src, len, p.D, h0, hg, p.row_stride(heads), p.head_stride(len));
  else
    scatter_heads(t.data_as<float>() + base, src, len, p.D, h0, hg, p.row_stride(heads), p.head_stride(len));
}

// dst (cols, ld): dst[c·ld + r] = src[r·src_ld + c] for r < rows.
void transpose_block(float* dst, int64_t ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = src[r * src_ld + c];
}

class AttentionForwardKernel final : public Kernel {
 public:
  AttentionForwardKernel(const KernelCall& call) : plan_(call, 0, 3) {}

  size_t scratch_bytes(int num_threads) const override {
    const int threads = std::max(num_threads, 1);
    int64_t floats = tile_floats();
    if (plan_.grouped) floats += group_heads(threads) * head_floats() + head_pack_floats();
    return static_cast<size_t>(threads * floats) * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const AttentionPlan& p = plan_;
    const int threads = std::max(ctx.num_threads, 1);
    const int64_t query_blocks = (p.T + kBlockQ - 1) / kBlockQ;
    // Tasks: (b·H + h, query block), or (b, group of heads) when grouped.
    const int64_t hg = p.grouped ? group_heads(threads) : 1;
    const int64_t groups = (p.H + hg - 1) / hg;
    const int64_t tasks = p.grouped ? p.B * groups : p.B * p.H * query_blocks;
    if (tasks == 0 || p.T == 0) return;
    p.check_key_begin(args);
    float* scratch = static_cast<float*>(args.scratch);
    const int64_t per_thread = tile_floats() + (p.grouped ? hg * head_floats() + head_pack_floats() : 0);
    auto task_body = [&](int64_t task, float* work) {
      if (p.grouped)
        forward_group(args, ctx, task / groups, (task % groups) * hg, hg, work);
      else
        forward_direct(args, ctx, task / query_blocks, (task % query_blocks) * kBlockQ, work);
    };
    if (tasks == 1 || threads <= 1) {  // serially, without entering OpenMP
      for (int64_t task = 0; task < tasks; ++task) task_body(task, scratch);
      return;
    }
#pragma omp parallel num_threads(threads)  // always the whole team: changing team sizes makes libgomp allocate
    {
      float* work = scratch + thread_index() * per_thread;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) task_body(task, work);
    }
  }

 private:
  // Per thread: Qt (D, BQ), St (BK, BQ), m, l, corr (BQ), keep (BK), the bf16 packs.
  int64_t tile_floats() const {
    return line_floats(plan_.D * kBlockQ) + line_floats(kBlockK * kBlockQ) + 3 * line_floats(kBlockQ) +
           line_floats(kBlockK) + plan_.pack_floats();
  }
  // Packed copies of one head (seq-major): q and out (T, D), k and v (S, D).
  int64_t head_floats() const { return 2 * plan_.T * plan_.D + 2 * plan_.S * plan_.D; }
  // With bf16_tiles, one key/value head's k as A rows and v as B pairs (HeadPacks).
  int64_t head_pack_floats() const {
    return plan_.bf16_tiles ? plan_.rows_words(plan_.S) + plan_.pairs_words(plan_.S) : 0;
  }
  int64_t group_heads(int threads) const {
    return heads_per_group(plan_.B, plan_.H, head_floats(), threads, plan_.group);
  }

  // A key/value head packed once for the bf16 products of all its query blocks: k (S, D) as A rows, v as B pairs of
  // key rows (used where a key block starts at an even key).
  struct HeadPacks {
    const uint32_t* k_rows;
    const uint32_t* v_pairs;
  };

  // (B, H, T, D) layout: one query block of head bh, read and written in place.
  void forward_direct(const KernelArgs& args, const StepContext& ctx, int64_t bh, int64_t t0, float* work) const {
    const AttentionPlan& p = plan_;
    const float* mask = p.has_mask ? p.mask_row(args.inputs[p.mask_at], bh) : nullptr;
    forward_block(static_cast<const float*>(args.inputs[0].data()) + p.head_offset(bh, p.T),
                  static_cast<const float*>(args.inputs[1].data()) + p.head_offset(bh, p.S),
                  static_cast<const float*>(args.inputs[2].data()) + p.head_offset(bh, p.S), mask, p.bias_of(args, bh),
                  static_cast<float*>(args.outputs[0].data()) + p.head_offset(bh, p.T),
                  static_cast<float*>(args.outputs[1].data()) + bh * p.T, p.key_begin_row(args, bh / p.H), ctx, bh,
                  t0, work);
  }

  // Seq-major layout: heads [h0, h0 + hg) of batch element b, through packed copies.
  void forward_group(const KernelArgs& args, const StepContext& ctx, int64_t b, int64_t h0, int64_t hg,
                     float* work) const {
    const AttentionPlan& p = plan_;
    const int64_t T = p.T, S = p.S, D = p.D, H = p.H;
    uint32_t* head_pack = reinterpret_cast<uint32_t*>(work + tile_floats() + hg * head_floats());
    hg = std::min(hg, H - h0);
    const int64_t kg = hg / p.group;  // key/value heads [h0 / group, h0 / group + kg)
    float* q = work + tile_floats();  // (hg, T, D)
    float* k = q + hg * T * D;        // (kg, S, D)
    float* v = k + kg * S * D;        // (kg, S, D)
    float* out = v + kg * S * D;      // (hg, T, D)
    gather_operand(q, args.inputs[0], p, T, H, b, h0, hg);
    gather_operand(k, args.inputs[1], p, S, p.K, b, h0 / p.group, kg);
    gather_operand(v, args.inputs[2], p, S, p.K, b, h0 / p.group, kg);
    HeadPacks packs{head_pack, head_pack + p.rows_words(S)};
    for (int64_t h = 0; h < hg; ++h) {
      const int64_t bh = b * H + h0 + h, kv = h / p.group;
      const float* mask = p.has_mask ? p.mask_row(args.inputs[p.mask_at], bh) : nullptr;
      if (p.bf16_tiles && h % p.group == 0) {
        pack_a(S, D, k + kv * S * D, D, 1, head_pack);
        pack_b(S, D, v + kv * S * D, D, head_pack + p.rows_words(S));
      }
      for (int64_t t0 = 0; t0 < T; t0 += kBlockQ)
        forward_block(q + h * T * D, k + kv * S * D, v + kv * S * D, mask, p.bias_of(args, bh), out + h * T * D,
                      static_cast<float*>(args.outputs[1].data()) + bh * T, p.key_begin_row(args, b), ctx, bh, t0,
                      work, p.bf16_tiles ? &packs : nullptr);
    }
    scatter_operand(args.outputs[0], out, p, T, H, b, h0, hg);
  }

  // One query block [t0, t0 + BQ) of head bh: q, out (T, D) and k, v (S, D), rows D apart;
  // mask (S) or null; the score bias (T, S) or null; lse (T); key_begin (T) or null; with bf16_tiles, the head's
  // packs or null.
  void forward_block(const float* q, const float* k, const float* v, const float* mask, const float* bias,
                     float* out, float* lse,
                     const int64_t* key_begin_row, const StepContext& ctx, int64_t bh, int64_t t0, float* work,
                     const HeadPacks* packs = nullptr) const {
    const AttentionPlan& p = plan_;
    const TileOps& ops = *p.ops;
    const int64_t D = p.D, S = p.S, T = p.T;
    const int64_t mq = std::min(kBlockQ, T - t0);
    q += t0 * D;    // q_blk: (mq, D)
    out += t0 * D;  // out_blk: (mq, D)
    lse += t0;      // lse_blk: (mq)

    float* qt = work;                                // (D, BQ)
    float* st = qt + line_floats(D * kBlockQ);       // (BK, BQ)
    float* m = st + line_floats(kBlockK * kBlockQ);  // (BQ)
    float* l = m + line_floats(kBlockQ);             // (BQ)
    float* corr = l + line_floats(kBlockQ);          // (BQ)
    float* keep = corr + line_floats(kBlockQ);       // (BK)
    float* pack = keep + line_floats(kBlockK);       // the bf16 products' packs, then Qt packed

    transpose_block(qt, kBlockQ, q, D, mq, D);
    PackedB qt_packed{};
    if (packs) qt_packed = pack_b(D, mq, qt, kBlockQ, p.block_pack(pack));
    const int64_t kp = (D + 1) / 2, ld = (D + 15) / 16 * 16;
    std::fill(m, m + mq, kNegInf);
    std::fill(l, l + mq, 0.0f);
    std::fill(out, out + mq * D, 0.0f);
    // Keys past the last query's causal limit are never visible to this block.
    // Keys before the first query's window or example never are.
    const int64_t key_end = p.causal ? std::min(S, t0 + mq + S - T) : S;
    const int64_t key_begin = p.first_key(t0, key_begin_row);
    const int64_t* block_key_begin = key_begin_row ? key_begin_row + t0 : nullptr;
    for (int64_t kb = key_begin; kb < key_end; kb += kBlockK) {
      const int64_t nk = std::min(kBlockK, key_end - kb);
      const int64_t offset = p.causal_offset(t0, kb);
      const PackedA k_blk{packs ? packs->k_rows + kb * kp : nullptr, kp, 1};
      if (bias) ops.bias_columns(st, kBlockQ, bias + t0 * S + kb, S, mq, nk);  // St = biasᵀ, the product added
      p.product(nk, mq, D, p.scale, k + kb * D, D, 1, qt, kBlockQ, st, kBlockQ, bias != nullptr, pack,
                packs ? &k_blk : nullptr, packs ? &qt_packed : nullptr);
      if (p.softcap > 0.0f) ops.soft_cap(st, kBlockQ, nk, mq, p.softcap, nullptr);
      if (p.window_cuts(offset, mq)) hide_old_keys_forward(st, kBlockQ, nk, mq, offset, p.window);
      if (block_key_begin && block_key_begin[mq - 1] > kb)
        hide_other_examples_forward(st, kBlockQ, nk, mq, kb, block_key_begin);
      ops.forward_softmax(st, kBlockQ, nk, mq, mask ? mask + kb : nullptr, offset, m, l, corr);
      if (kb > key_begin) ops.scale_rows(out, D, mq, D, corr);
      if (p.dropout_p > 0.0f) {
        for (int64_t i = 0; i < mq; ++i) {
          ops.dropout_row(p.seed, ctx.rng_offset, p.drop_index(bh, t0 + i, kb), nk, p.dropout_p, keep);
          for (int64_t j = 0; j < nk; ++j) st[j * kBlockQ + i] *= keep[j];
        }
      }
      const PackedB v_blk{packs ? packs->v_pairs + kb / 2 * ld : nullptr, ld};
      p.product(mq, D, nk, 1.0f, st, 1, kBlockQ, v + kb * D, D, out, D, true, pack, nullptr,  // out += Stᵀ·V_blk
                packs && kb % 2 == 0 ? &v_blk : nullptr);
    }
    for (int64_t i = 0; i < mq; ++i) {
      const bool seen = l[i] > 0.0f;
      corr[i] = seen ? 1.0f / l[i] : 0.0f;
      lse[i] = seen ? m[i] + std::log(l[i]) : 0.0f;
    }
    ops.scale_rows(out, D, mq, D, corr);
  }

  AttentionPlan plan_;
};

class AttentionBackwardKernel final : public Kernel {
 public:
  AttentionBackwardKernel(const KernelCall& call) : plan_(call, 1, 6) {}

  size_t scratch_bytes(int num_threads) const override {
    const int threads = std::max(num_threads, 1);
    int64_t floats = threads * tile_floats();
    if (plan_.grouped) {
      floats += threads * (group_heads(threads) * head_floats() + head_pack_floats());
    } else {
      const int64_t chunks = key_chunks(threads);
      if (chunks > 1) floats += chunks * plan_.B * plan_.H * plan_.T * plan_.D;  // private dq partials
    }
    return static_cast<size_t>(floats) * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const AttentionPlan& p = plan_;
    if (p.B * p.H == 0 || p.T == 0) return;
    p.check_key_begin(args);
    if (p.grouped)
      run_groups(args, ctx);
    else
      run_direct(args, ctx);
  }

 private:
  // One head's operands, every one (len, D) with rows D apart: q, dout, out, dq (T, D);
  // k, v, dk, dv (S, D); lse (T); mask (S) or null.
  struct Head {
    const float *dout, *q, *k, *v, *out, *lse, *mask;
    float *dq, *dk, *dv;
    const int64_t* key_begin;  // (T) or null
    const float* bias;         // the score bias (T, S), or null
    float* dbias;              // its gradient (T, S), with a bias
  };

  // (B, H, T, D) layout: one task per (b·H + h, run of key blocks), operands read in place.
  void run_direct(const KernelArgs& args, const StepContext& ctx) const {
    const AttentionPlan& p = plan_;
    const int64_t BH = p.B * p.H;
    const int threads = std::max(ctx.num_threads, 1);
    const int64_t chunks = key_chunks(threads);
    const int64_t tasks = BH * chunks;
    float* scratch = static_cast<float*>(args.scratch);
    float* partials = scratch + threads * tile_floats();  // (chunks, B·H, T, D) when chunks > 1
    float* dq = static_cast<float*>(args.outputs[0].data());
    const int64_t rows = BH * p.T;
#pragma omp parallel num_threads(threads)
    {
      float* work = scratch + thread_index() * tile_floats();
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bh = task / chunks, chunk = task % chunks;
        Head head = direct_head(args, bh);
        if (chunks > 1) head.dq = partials + (chunk * BH + bh) * p.T * p.D;
        backward_chunk(head, ctx, bh, chunk, chunks, work);
      }
      if (chunks > 1) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = dq + r * p.D;  // row (bh, t) = r
          std::copy(partials + r * p.D, partials + (r + 1) * p.D, dst);
          for (int64_t c = 1; c < chunks; ++c) {
            const float* src = partials + (c * BH * p.T + r) * p.D;
            for (int64_t d = 0; d < p.D; ++d) dst[d] += src[d];
          }
        }
      }
    }
  }

  Head direct_head(const KernelArgs& args, int64_t bh) const {
    const AttentionPlan& p = plan_;
    const int64_t q_at = p.head_offset(bh, p.T), k_at = p.head_offset(bh, p.S);
    auto in = [&](size_t i, int64_t at) { return static_cast<const float*>(args.inputs[i].data()) + at; };
    auto out = [&](size_t i, int64_t at) { return static_cast<float*>(args.outputs[i].data()) + at; };
    return Head{in(0, q_at),
                in(1, q_at),
                in(2, k_at),
                in(3, k_at),
                in(4, q_at),
                in(5, bh * p.T),
                p.has_mask ? p.mask_row(args.inputs[p.mask_at], bh) : nullptr,
                out(0, q_at),
                out(1, k_at),
                out(2, k_at),
                p.key_begin_row(args, bh / p.H),
                p.bias_of(args, bh),
                p.dbias_of(args, bh)};
  }

  // Seq-major layout: one task per (b, group of heads), through packed copies (see gather_heads).
  void run_groups(const KernelArgs& args, const StepContext& ctx) const {
    const AttentionPlan& p = plan_;
    const int threads = std::max(ctx.num_threads, 1);
    const int64_t hg = group_heads(threads);
    const int64_t groups = (p.H + hg - 1) / hg;
    const int64_t tasks = p.B * groups;
    const int64_t per_thread = tile_floats() + hg * head_floats() + head_pack_floats();
    float* scratch = static_cast<float*>(args.scratch);
    auto task_body = [&](int64_t task, float* work) {
      backward_group(args, ctx, task / groups, (task % groups) * hg, hg, work);
    };
    if (tasks == 1 || threads <= 1) {
      for (int64_t task = 0; task < tasks; ++task) task_body(task, scratch);
      return;
    }
#pragma omp parallel num_threads(threads)
    {
      float* work = scratch + thread_index() * per_thread;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) task_body(task, work);
    }
  }

  void backward_group(const KernelArgs& args, const StepContext& ctx, int64_t b, int64_t h0, int64_t hg,
                      float* work) const {
    const AttentionPlan& p = plan_;
    const int64_t T = p.T, S = p.S, D = p.D, H = p.H;
    uint32_t* head_pack = reinterpret_cast<uint32_t*>(work + tile_floats() + hg * head_floats());
    hg = std::min(hg, H - h0);
    const int64_t kg = hg / p.group, k0 = h0 / p.group;  // key/value heads [k0, k0 + kg)
    const int64_t tq = hg * T * D, tk = kg * S * D;
    float* dout = work + tile_floats();  // (hg, T, D) each: dout, q, out, dq
    float* q = dout + tq;
    float* out = q + tq;
    float* dq = out + tq;
    float* k = dq + tq;  // (kg, S, D) each: k, v, dk, dv
    float* v = k + tk;
    float* dk = v + tk;
    float* dv = dk + tk;
    gather_operand(dout, args.inputs[0], p, T, H, b, h0, hg);
    // bf16 products read dO rounded to bf16 (as autocast's bf16 output's gradient is); so does Di = rowsum(dO ⊙ out),
    // or dS = P ⊙ (dP − Di) would not vanish where it should (a single visible key).
    if (p.bf16_tiles && args.inputs[0].dtype() != DType::bf16) round_to_bf16_values(dout, tq);
    gather_operand(q, args.inputs[1], p, T, H, b, h0, hg);
    gather_operand(k, args.inputs[2], p, S, p.K, b, k0, kg);
    gather_operand(v, args.inputs[3], p, S, p.K, b, k0, kg);
    gather_operand(out, args.inputs[4], p, T, H, b, h0, hg);
    const HeadPacks packs{head_pack, head_pack + p.rows_words(T), head_pack + 2 * p.rows_words(T),
                          head_pack + 2 * p.rows_words(T) + p.pairs_words(T),
                          head_pack + 2 * p.rows_words(T) + 2 * p.pairs_words(T)};
    for (int64_t h = 0; h < hg; ++h) {
      const int64_t bh = b * H + h0 + h, kv = h / p.group;
      if (p.bf16_tiles) {
        pack_a(T, D, q + h * T * D, D, 1, head_pack);
        pack_a(T, D, dout + h * T * D, D, 1, head_pack + p.rows_words(T));
        pack_b(T, D, q + h * T * D, D, head_pack + 2 * p.rows_words(T));
        pack_b(T, D, dout + h * T * D, D, head_pack + 2 * p.rows_words(T) + p.pairs_words(T));
        if (h % p.group == 0) pack_b(S, D, k + kv * S * D, D, head_pack + 2 * p.rows_words(T) + 2 * p.pairs_words(T));
      }
      Head head{dout + h * T * D,
                q + h * T * D,
                k + kv * S * D,
                v + kv * S * D,
                out + h * T * D,
                static_cast<const float*>(args.inputs[5].data()) + bh * T,
                p.has_mask ? p.mask_row(args.inputs[p.mask_at], bh) : nullptr,
                dq + h * T * D,
                dk + kv * S * D,
                dv + kv * S * D,
                p.key_begin_row(args, b),
                p.bias_of(args, bh),
                p.dbias_of(args, bh)};
      // The first query head of a key/value head starts its dk, dv; the others add to them.
      backward_chunk(head, ctx, bh, 0, 1, work, h % p.group == 0, p.bf16_tiles ? &packs : nullptr);
    }
    scatter_operand(args.outputs[0], dq, p, T, H, b, h0, hg);
    scatter_operand(args.outputs[1], dk, p, S, p.K, b, k0, kg);
    scatter_operand(args.outputs[2], dv, p, S, p.K, b, k0, kg);
  }

  // Splits each (b, h) into runs of key blocks only when B·H alone cannot occupy the threads.
  int64_t key_chunks(int threads) const {
    const int64_t BH = plan_.B * plan_.H;
    const int64_t key_blocks = (plan_.S + kBlockK - 1) / kBlockK;
    if (BH == 0 || BH >= threads) return 1;
    return std::max<int64_t>(1, std::min<int64_t>(key_blocks, (threads + BH - 1) / BH));
  }

  // Per thread: Kt, Vt (D, BK), P, dP (BQ, BK), Di (T), keep (BK), with a softcap its derivative (BQ, BK), and the
  // bf16 packs.
  int64_t tile_floats() const {
    return 2 * line_floats(plan_.D * kBlockK) + (plan_.softcap > 0.0f ? 3 : 2) * line_floats(kBlockQ * kBlockK) +
           line_floats(plan_.T) + line_floats(kBlockK) + plan_.pack_floats();
  }
  // Packed copies of one head (seq-major): dout, q, out, dq (T, D); k, v, dk, dv (S, D).
  int64_t head_floats() const { return 4 * plan_.T * plan_.D + 4 * plan_.S * plan_.D; }
  // With bf16_tiles, one query head's q and dO as A rows and as B pairs of query rows, and its key/value head's k as
  // B pairs of key rows (HeadPacks).
  int64_t head_pack_floats() const {
    const AttentionPlan& p = plan_;
    return p.bf16_tiles ? 2 * p.rows_words(p.T) + 2 * p.pairs_words(p.T) + p.pairs_words(p.S) : 0;
  }
  // A head packed once for the bf16 products of all its key blocks.
  struct HeadPacks {
    const uint32_t *q_rows, *dout_rows, *q_pairs, *dout_pairs, *k_pairs;
  };
  int64_t group_heads(int threads) const {
    return heads_per_group(plan_.B, plan_.H, head_floats(), threads, plan_.group);
  }

  // Key blocks [chunk·per_chunk, (chunk + 1)·per_chunk) of one head: writes their dk, dv rows (adds to
  // them unless `fresh_kv`) and all of head.dq (this chunk's share of it).
  // With bf16_tiles, `packs` (or null) are the head's operands packed once.
  void backward_chunk(const Head& head, const StepContext& ctx, int64_t bh, int64_t chunk, int64_t chunks,
                      float* work, bool fresh_kv = true, const HeadPacks* packs = nullptr) const {
    const AttentionPlan& p = plan_;
    const TileOps& ops = *p.ops;
    const int64_t D = p.D, S = p.S, T = p.T;
    const float *dout = head.dout, *q = head.q, *k = head.k, *v = head.v, *out = head.out, *lse = head.lse;
    const float* mask = head.mask;
    float *dq = head.dq, *dk = head.dk, *dv = head.dv;

    float* kt = work;                                 // (D, BK)
    float* vt = kt + line_floats(D * kBlockK);        // (D, BK)
    float* pt = vt + line_floats(D * kBlockK);        // P then P·keep: (BQ, BK)
    float* dp = pt + line_floats(kBlockQ * kBlockK);  // dP then dS: (BQ, BK)
    float* di = dp + line_floats(kBlockQ * kBlockK);  // (T)
    float* keep = di + line_floats(T);                // (BK)
    float* cap_grad = keep + line_floats(kBlockK);    // 1 − tanh² of the capped scores: (BQ, BK)
    float* pack = cap_grad + (p.softcap > 0.0f ? line_floats(kBlockQ * kBlockK) : 0);  // the bf16 products' packs
    uint32_t* kt_pack = p.block_pack(pack);  // then Kᵀ, Vᵀ packed
    uint32_t* vt_pack = kt_pack + p.block_words();
    const int64_t kp = (D + 1) / 2, ld = (D + 15) / 16 * 16;

    std::fill(dq, dq + T * D, 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += dout[t * D + d] * out[t * D + d];
      di[t] = sum;
    }
    const int64_t key_blocks = (S + kBlockK - 1) / kBlockK;
    const int64_t per_chunk = (key_blocks + chunks - 1) / chunks;
    const int64_t block_end = std::min(key_blocks, (chunk + 1) * per_chunk);
    for (int64_t block = chunk * per_chunk; block < block_end; ++block) {
      const int64_t kb = block * kBlockK, nk = std::min(kBlockK, S - kb);
      float* dk_blk = dk + kb * D;  // (nk, D)
      float* dv_blk = dv + kb * D;  // (nk, D)
      if (fresh_kv) {
        std::fill(dk_blk, dk_blk + nk * D, 0.0f);
        std::fill(dv_blk, dv_blk + nk * D, 0.0f);
      }
      transpose_block(kt, kBlockK, k + kb * D, D, nk, D);
      transpose_block(vt, kBlockK, v + kb * D, D, nk, D);
      PackedB kt_blk{}, vt_blk{};
      if (packs) {
        kt_blk = pack_b(D, nk, kt, kBlockK, kt_pack);
        vt_blk = pack_b(D, nk, vt, kBlockK, vt_pack);
      }
      const PackedB k_blk{packs ? packs->k_pairs + kb / 2 * ld : nullptr, ld};  // kb is a whole block: even
      if (head.dbias)  // rows no query block below visits have no gradient
        for (int64_t t = 0; t < T; ++t) std::fill(head.dbias + t * S + kb, head.dbias + t * S + kb + nk, 0.0f);
      // Queries before t_begin cannot see any key of this block, nor (sliding window, packed sequences) those
      // from t_end on.
      const int64_t t_begin = p.causal ? std::max<int64_t>(0, kb - (S - T)) : 0;
      const int64_t t_end = p.query_end(kb, nk, head.key_begin);
      for (int64_t t0 = t_begin; t0 < t_end; t0 += kBlockQ) {
        const int64_t mq = std::min(kBlockQ, t_end - t0);
        const int64_t offset = p.causal_offset(t0, kb);
        const float* q_blk = q + t0 * D;        // (mq, D)
        const float* dout_blk = dout + t0 * D;  // (mq, D)
        // Operands packed per head: A rows from query t0, B pairs of query rows where t0 is even.
        const PackedA q_rows{packs ? packs->q_rows + t0 * kp : nullptr, kp, 1};
        const PackedA dout_rows{packs ? packs->dout_rows + t0 * kp : nullptr, kp, 1};
        const bool paired = packs && t0 % 2 == 0;
        const PackedB q_pairs{paired ? packs->q_pairs + t0 / 2 * ld : nullptr, ld};
        const PackedB dout_pairs{paired ? packs->dout_pairs + t0 / 2 * ld : nullptr, ld};
        if (head.bias)  // P = the bias, the product added
          for (int64_t i = 0; i < mq; ++i)
            std::copy(head.bias + (t0 + i) * S + kb, head.bias + (t0 + i) * S + kb + nk, pt + i * kBlockK);
        p.product(mq, nk, D, p.scale, q_blk, D, 1, kt, kBlockK, pt, kBlockK, head.bias != nullptr, pack,
                  packs ? &q_rows : nullptr, packs ? &kt_blk : nullptr);
        if (p.softcap > 0.0f) ops.soft_cap(pt, kBlockK, mq, nk, p.softcap, cap_grad);
        ops.backward_probs(pt, kBlockK, mq, nk, mask ? mask + kb : nullptr, offset, lse + t0);
        if (p.window_cuts(offset, mq)) hide_old_keys_backward(pt, kBlockK, mq, nk, offset, p.window);
        if (head.key_begin && head.key_begin[t0 + mq - 1] > kb)
          hide_other_examples_backward(pt, kBlockK, mq, nk, kb, head.key_begin + t0);
        p.product(mq, nk, D, 1.0f, dout_blk, D, 1, vt, kBlockK, dp, kBlockK, false, pack,
                  packs ? &dout_rows : nullptr, packs ? &vt_blk : nullptr);
        for (int64_t i = 0; i < mq; ++i) {
          const float* row_keep = nullptr;
          if (p.dropout_p > 0.0f) {
            ops.dropout_row(p.seed, ctx.rng_offset, p.drop_index(bh, t0 + i, kb), nk, p.dropout_p, keep);
            row_keep = keep;
          }
          ops.backward_ds_row(pt + i * kBlockK, dp + i * kBlockK, nk, di[t0 + i], row_keep);
          if (p.softcap > 0.0f)  // dS through the cap: · (1 − tanh²)
            for (int64_t j = 0; j < nk; ++j) dp[i * kBlockK + j] *= cap_grad[i * kBlockK + j];
          if (head.dbias) std::copy(dp + i * kBlockK, dp + i * kBlockK + nk, head.dbias + (t0 + i) * S + kb);
        }
        p.product(nk, D, mq, 1.0f, pt, 1, kBlockK, dout_blk, D, dv_blk, D, true, pack, nullptr,  // dV += Pᵀ·dO
                  paired ? &dout_pairs : nullptr);
        p.product(nk, D, mq, p.scale, dp, 1, kBlockK, q_blk, D, dk_blk, D, true, pack, nullptr,  // dK += scale·dSᵀ·Q
                  paired ? &q_pairs : nullptr);
        p.product(mq, D, nk, p.scale, dp, kBlockK, 1, k + kb * D, D, dq + t0 * D, D, true, pack, nullptr,  // dQ
                  packs ? &k_blk : nullptr);
      }
    }
  }

  AttentionPlan plan_;
};

}  // namespace

std::unique_ptr<Kernel> make_cpu_attention_kernel(const KernelCall& call) {
  switch (call.op) {
    case OpKind::Attention:
      return std::make_unique<AttentionForwardKernel>(call);
    case OpKind::AttentionBackward:
      return std::make_unique<AttentionBackwardKernel>(call);
    default:
      return nullptr;
  }
}

}  // namespace fusetrain::kernels
