// Tuned Dropout, f32: y[i] = keep(i) ? x[i] / (1 - p) : 0 with
// keep(i) = uniform_at(seed, rng_offset, map(i)) >= p (kernels/rng.h, StreamIndexMap), bit for bit;
// DropoutAdd adds residual[i] to that in the same pass.
//
// Shape legend: any shape, seen as n contiguous elements; y may alias x.
// Philox4x32-10 yields four uniforms per counter (block = i / 4). The AVX-512
// path runs 16 counters per vector (64 elements), then interleaves the four
// result vectors into element order.
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/rng.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// Elements [begin, end) of the arrays, which draw stream indices first + begin .. first + end,
// the scalar way, one uniform4 per block of four. residual: null for Dropout, else added (DropoutAdd).
void dropout_portable_from(float* y, const float* x, const float* residual, int64_t begin, int64_t end,
                           uint64_t first, uint64_t seed, uint64_t offset, float p, float scale) {
  int64_t i = begin;
  while (i < end) {
    const uint64_t index = first + static_cast<uint64_t>(i);
    float u[4];
    uniform4(seed, offset, index >> 2, u);
    const int64_t block_end = std::min<int64_t>(end, i + static_cast<int64_t>(4 - (index & 3)));
    for (; i < block_end; ++i) {
      const float dropped = u[(first + static_cast<uint64_t>(i)) & 3] >= p ? x[i] * scale : 0.0f;
      y[i] = residual ? dropped + residual[i] : dropped;
    }
  }
}

void dropout_portable(float* y, const float* x, const float* residual, int64_t n, uint64_t first, uint64_t seed,
                      uint64_t offset, float p, float scale) {
  dropout_portable_from(y, x, residual, 0, n, first, seed, offset, p, scale);
}

// 32x32 -> 64 bit products of 16 lanes: high and low halves.
FT_AVX512_INLINE void mulhilo16(__m512i a, __m512i multiplier, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, multiplier);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), multiplier);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

FT_AVX512_INLINE __m512 to_uniform16(__m512i bits) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(1.0f / 16777216.0f));
}

FT_AVX512 void dropout_avx512(float* y, const float* x, const float* residual, int64_t n, uint64_t first,
                              uint64_t seed, uint64_t offset, float p, float scale) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  // Interleave lanes of two vectors: pairs (a[l], b[l]) for l = 0..7 and l = 8..15.
  const __m512i pair_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i pair_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  // Interleave 64-bit pairs: quads for lanes 0..3 and 4..7 of the pair vectors.
  const __m512i quad_lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  const __m512i quad_hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  const __m512 vp = _mm512_set1_ps(p), vscale = _mm512_set1_ps(scale);

  const int64_t end = n;
  int64_t i = 0;
  // Head up to a stream index that is a multiple of 4 (whole Philox blocks from there on).
  if (first & 3) {
    const int64_t head_end = std::min(end, static_cast<int64_t>(4 - (first & 3)));
    dropout_portable_from(y, x, residual, 0, head_end, first, seed, offset, p, scale);
    i = head_end;
  }
  for (; i + 64 <= end; i += 64) {
    const uint64_t block = (first + static_cast<uint64_t>(i)) >> 2;
    if (static_cast<uint32_t>(block) > 0xFFFFFFFFu - 15u) {  // low counter word would carry
      dropout_portable_from(y, x, residual, i, i + 64, first, seed, offset, p, scale);
      continue;
    }
    __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block))), lane);
    __m512i c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32)));
    __m512i c2 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
    __m512i c3 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      __m512i hi0, lo0, hi1, lo1;
      mulhilo16(c0, mul0, &hi0, &lo0);
      mulhilo16(c2, mul1, &hi1, &lo1);
      c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    // c_j[l] is uniform j of block (block + l); element order wants block-major.
    const __m512i p01_lo = _mm512_permutex2var_epi32(c0, pair_lo, c1);
    const __m512i p01_hi = _mm512_permutex2var_epi32(c0, pair_hi, c1);
    const __m512i p23_lo = _mm512_permutex2var_epi32(c2, pair_lo, c3);
    const __m512i p23_hi = _mm512_permutex2var_epi32(c2, pair_hi, c3);
    const __m512i ordered[4] = {
        _mm512_permutex2var_epi64(p01_lo, quad_lo, p23_lo), _mm512_permutex2var_epi64(p01_lo, quad_hi, p23_lo),
        _mm512_permutex2var_epi64(p01_hi, quad_lo, p23_hi), _mm512_permutex2var_epi64(p01_hi, quad_hi, p23_hi)};
    for (int q = 0; q < 4; ++q) {
      const __mmask16 keep = _mm512_cmp_ps_mask(to_uniform16(ordered[q]), vp, _CMP_GE_OQ);
      __m512 dropped = _mm512_maskz_mul_ps(keep, _mm512_loadu_ps(x + i + 16 * q), vscale);
      if (residual) dropped = _mm512_add_ps(dropped, _mm512_loadu_ps(residual + i + 16 * q));
      _mm512_storeu_ps(y + i + 16 * q, dropped);
    }
  }
  if (i < end) dropout_portable_from(y, x, residual, i, end, first, seed, offset, p, scale);
}

class DropoutKernel final : public Kernel {
 public:
  DropoutKernel(int64_t numel, double p, uint64_t seed, StreamIndexMap map, bool residual)
      : numel_(numel),
        residual_(residual),
        p_(static_cast<float>(p)),
        scale_(static_cast<float>(1.0 / (1.0 - p))),
        seed_(seed),
        map_(map),
        fn_(dropout_range_fn()) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());
    const float* residual = residual_ ? static_cast<const float*>(args.inputs[1].data()) : nullptr;
    float* y = static_cast<float*>(args.outputs[0].data());
    const uint64_t offset = ctx.rng_offset;
    // Philox costs far more than the memory traffic: parallelise earlier.
    parallel_for(
        numel_, threads_for(numel_ * 8, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          map_.for_each_run(begin, end, [&](int64_t b, int64_t e, uint64_t first) {
            fn_(y + b, x + b, residual ? residual + b : nullptr, e - b, first, seed_, offset, p_, scale_);
          });
        },
        64);
  }

 private:
  int64_t numel_;
  bool residual_;
  float p_, scale_;
  uint64_t seed_;
  StreamIndexMap map_;
  DropoutRangeFn fn_;
};

}  // namespace

DropoutRangeFn dropout_range_fn() { return use_avx512() ? dropout_avx512 : dropout_portable; }

std::unique_ptr<Kernel> make_dropout_kernel(const ir::Graph& g, const ir::Node& n) {
  if (input_dtype(g, n, 0) != DType::f32) return nullptr;
  return std::make_unique<DropoutKernel>(output_shape(g, n, 0).numel(), n.attrs.get_float("p"),
                                         static_cast<uint64_t>(n.attrs.get_int("seed")), stream_index_map(n.attrs),
                                         n.op == ir::OpKind::DropoutAdd);
}

}  // namespace fusetrain::kernels::cpu_basic
