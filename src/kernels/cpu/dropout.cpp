// Tuned Dropout, f32: y[i] = keep(i) ? x[i] / (1 - p) : 0 with
// keep(i) = uniform_at(seed, rng_offset, map(i)) >= p (kernels/rng.h, StreamIndexMap), bit for bit;
// DropoutAdd adds residual[i] to that in the same pass.
//
// Shape legend: any shape, seen as n contiguous elements; y may alias x.
// Philox4x32-10 yields four uniforms per counter (block = i / 4). The AVX-512
// path runs 16 counters per vector (64 elements), the AVX2 path 8 (32 elements),
// then interleaves the four result vectors into element order.
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/philox_avx2.h"
#include "kernels/cpu/philox_avx512.h"
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

FT_AVX512 void dropout_avx512(float* y, const float* x, const float* residual, int64_t n, uint64_t first,
                              uint64_t seed, uint64_t offset, float p, float scale) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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
    const __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block))), lane);
    const __m512i c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32)));
    __m512i ordered[4];
    philox_element_order(philox4x32_16(c0, c1, offset, seed), ordered);
    for (int q = 0; q < 4; ++q) {
      const __mmask16 keep = _mm512_cmp_ps_mask(to_uniform16(ordered[q]), vp, _CMP_GE_OQ);
      __m512 dropped = _mm512_maskz_mul_ps(keep, _mm512_loadu_ps(x + i + 16 * q), vscale);
      if (residual) dropped = _mm512_add_ps(dropped, _mm512_loadu_ps(residual + i + 16 * q));
      _mm512_storeu_ps(y + i + 16 * q, dropped);
    }
  }
  if (i < end) dropout_portable_from(y, x, residual, i, end, first, seed, offset, p, scale);
}

FT_AVX2 void dropout_avx2(float* y, const float* x, const float* residual, int64_t n, uint64_t first, uint64_t seed,
                          uint64_t offset, float p, float scale) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 vp = _mm256_set1_ps(p), vscale = _mm256_set1_ps(scale);

  const int64_t end = n;
  int64_t i = 0;
  // Head up to a stream index that is a multiple of 4 (whole Philox blocks from there on).
  if (first & 3) {
    const int64_t head_end = std::min(end, static_cast<int64_t>(4 - (first & 3)));
    dropout_portable_from(y, x, residual, 0, head_end, first, seed, offset, p, scale);
    i = head_end;
  }
  for (; i + 32 <= end; i += 32) {
    const uint64_t block = (first + static_cast<uint64_t>(i)) >> 2;
    if (static_cast<uint32_t>(block) > 0xFFFFFFFFu - 7u) {  // low counter word would carry
      dropout_portable_from(y, x, residual, i, i + 32, first, seed, offset, p, scale);
      continue;
    }
    const __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block))), lane);
    const __m256i c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32)));
    __m256i ordered[4];
    philox_element_order(philox4x32_8(c0, c1, offset, seed), ordered);
    for (int q = 0; q < 4; ++q) {
      // x * scale where kept, +0 where dropped: the portable path's values, bit for bit.
      const __m256 keep = _mm256_cmp_ps(to_uniform8(ordered[q]), vp, _CMP_GE_OQ);
      __m256 dropped = _mm256_and_ps(keep, _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * q), vscale));
      if (residual) dropped = _mm256_add_ps(dropped, _mm256_loadu_ps(residual + i + 8 * q));
      _mm256_storeu_ps(y + i + 8 * q, dropped);
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

DropoutRangeFn dropout_range_fn() { return pick_path(dropout_portable, dropout_avx2, dropout_avx512); }

std::unique_ptr<Kernel> make_dropout_kernel(const KernelCall& call) {
  if (input_dtype(call, 0) != DType::f32) return nullptr;
  const ops::DropoutParams& params = call.params<ops::DropoutParams>();
  return std::make_unique<DropoutKernel>(output_shape(call, 0).numel(), params.p, params.seed,
                                         stream_index_map(params), call.op == OpKind::DropoutAdd);
}

}  // namespace fusetrain::kernels::cpu_basic
