// Tuned sums over axes, f32: ReduceSum, ReduceMean (axes, keepdims) and
// ReduceSumTo (sum down to a shape that broadcasts to x).
//
// Shape legend: after dropping extent-1 axes and merging neighbours of the same
// kind, x is viewed as (O, R, I): O kept outer, R reduced, I kept inner; the
// output is (O, I). Any other pattern (reduced groups on both sides of a kept
// one, e.g. (R1, K, R2)) takes a generic walk: outputs split across threads,
// each summing its reduced index space run by run along the innermost group.
//   I == 1: row sums, rows split across threads; a few long rows split R and
//           add per-thread partials (double) in thread order.
//   I > 1:  column sums in one order for any thread count (cpu_basic::kColumnSumRows): each block of 84
//           rows summed in order into its own partial (O, blocks, I) in scratch, blocks split across
//           threads; then each output adds its blocks' partials in order, outputs split across threads.
//           MatMulGeluBackward's epilogue forms its column sums in the same order, so it keeps the bits.
// Row sums are deterministic for a given thread count. All kernels honour accumulate (out += sum).
//
// CastColumnSum (x viewed as (R, N)) casts x and forms ReduceSum's column sums of it in one pass over
// x, each block of rows cast and summed into its partial while it is in cache, the partials then added
// as ReduceSum adds them, so both results are the separate ops' bits.
#include <cstring>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/half.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

constexpr int64_t kColumnBlock = 256;    // floats per column job

// ---- row sums and column sums ---------------------------------------------------------------

float row_sum_portable(const float* x, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += x[i + l];
  for (; i < n; ++i) lanes[0] += x[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

FT_AVX512 float row_sum_avx512(const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(x + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(x + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(x + i + 48));
  }
  for (; i < n; i += 16) a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// acc (width) += sum over rows r of x[r * row_stride + c]
void add_rows_portable(float* acc, const float* x, int64_t row_stride, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    for (int64_t c = 0; c < width; ++c) acc[c] += row[c];
  }
}

FT_AVX512 void add_rows_avx512(float* acc, const float* x, int64_t row_stride, int64_t rows, int64_t width) {
  int64_t c = 0;
  for (; c + 64 <= width; c += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
    __m512 a2 = _mm512_loadu_ps(acc + c + 32), a3 = _mm512_loadu_ps(acc + c + 48);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * row_stride + c;
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(row));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(row + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(row + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(row + 48));
    }
    _mm512_storeu_ps(acc + c, a0);
    _mm512_storeu_ps(acc + c + 16, a1);
    _mm512_storeu_ps(acc + c + 32, a2);
    _mm512_storeu_ps(acc + c + 48, a3);
  }
  for (; c < width; c += 16) {
    const __mmask16 m = tail_mask(width - c);
    __m512 a = _mm512_maskz_loadu_ps(m, acc + c);
    for (int64_t r = 0; r < rows; ++r) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(m, x + r * row_stride + c));
    _mm512_mask_storeu_ps(acc + c, m, a);
  }
}

// ---- kernel ---------------------------------------------------------------------------------------

class ReduceKernel final : public Kernel {
 public:
  ReduceKernel(int64_t O, int64_t R, int64_t I, float scale)
      : O_(O), R_(R), I_(I), scale_(scale) {
    const bool avx512 = use_avx512();
    row_sum_ = avx512 ? row_sum_avx512 : row_sum_portable;
    add_rows_ = avx512 ? add_rows_avx512 : add_rows_portable;
  }
  bool accumulates() const override { return true; }

  size_t scratch_bytes(int num_threads) const override {
    const size_t threads = static_cast<size_t>(std::max(num_threads, 1));
    if (I_ == 1) return threads * kAlignment;  // one double per thread, a cache line apart
    return align_up(static_cast<size_t>(O_ * blocks() * I_) * sizeof(float));  // one partial per block of rows
  }

  /// Column sums (I > 1), in two phases: block b of output row o (rows [b·kColumnSumRows, ...) of R) summed in
  /// order into block_partial(scratch, o, b) (which the caller may fill itself, as CastColumnSum does), then
  /// sum_blocks adds each output's partials in block order.
  int64_t blocks() const { return (R_ + kColumnSumRows - 1) / kColumnSumRows; }
  float* block_partial(void* scratch, int64_t o, int64_t b) const {
    return static_cast<float*>(scratch) + (o * blocks() + b) * I_;
  }
  void sum_blocks(float* out, const void* scratch, bool acc, int threads) const {
    sum_column_blocks(out, static_cast<const float*>(scratch), O_, blocks(), I_, scale_, acc, threads);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());  // (O, R, I)
    float* out = static_cast<float*>(args.outputs[0].data());           // (O, I)
    const bool acc = accumulate_flag(args, 0);
    const int threads = threads_for(O_ * R_ * I_, ctx.num_threads);
    if (I_ == 1)
      row_sums(out, x, acc, threads, args.scratch);
    else
      column_sums(out, x, acc, threads, args.scratch);
  }

 private:
  void finish(float* out, int64_t i, float sum, bool acc) const {
    const float v = sum * scale_;
    out[i] = acc ? out[i] + v : v;
  }

  // out (O) = sums of rows x (O, R).
  void row_sums(float* out, const float* x, bool acc, int threads, void* scratch) const {
    const int64_t R = R_;
    if (O_ >= threads) {
      parallel_for(O_, threads, [&](int64_t begin, int64_t end, int) {
        for (int64_t o = begin; o < end; ++o) finish(out, o, row_sum_(x + o * R, R), acc);
      });
      return;
    }
    constexpr size_t kSlot = kAlignment / sizeof(double);
    double* partial = static_cast<double*>(scratch);
    for (int64_t o = 0; o < O_; ++o) {
      for (int t = 0; t < threads; ++t) partial[t * kSlot] = 0.0;
      parallel_for(
          R, threads,
          [&](int64_t begin, int64_t end, int t) { partial[t * kSlot] = row_sum_(x + o * R + begin, end - begin); },
          16);
      double sum = 0.0;
      for (int t = 0; t < threads; ++t) sum += partial[t * kSlot];
      finish(out, o, static_cast<float>(sum), acc);
    }
  }

  // out (O, I) = sums over R of x (O, R, I), in blocks of kColumnSumRows rows (see blocks()).
  void column_sums(float* out, const float* x, bool acc, int threads, void* scratch) const {
    const int64_t R = R_, I = I_, nb = blocks();
    parallel_for(O_ * nb, threads, [&](int64_t begin, int64_t end, int) {
      for (int64_t job = begin; job < end; ++job) {
        const int64_t o = job / nb, r0 = (job % nb) * kColumnSumRows;
        float* part = block_partial(scratch, o, job % nb);
        std::memset(part, 0, static_cast<size_t>(I) * sizeof(float));
        add_rows_(part, x + (o * R + r0) * I, I, std::min(kColumnSumRows, R - r0), I);
      }
    });
    sum_blocks(out, scratch, acc, threads);
  }

  int64_t O_, R_, I_;
  float scale_;
  float (*row_sum_)(const float*, int64_t);
  void (*add_rows_)(float*, const float*, int64_t, int64_t, int64_t);
};

// CastColumnSum on x (R, N), R and N above 1: out 0 = x cast to bf16 (Cast's rounding) or f16, out 1 (N) = the
// column sums of ReduceKernel (1, R, N), bit for bit: each block of kColumnSumRows rows is cast kCastRows rows at a
// time and each run added into the block's partial while it is still in cache, so x is read from memory once; the
// partials are then added as ReduceKernel adds them.
class CastColumnSumKernel final : public Kernel {
 public:
  CastColumnSumKernel(int64_t R, int64_t N, DType to)
      : R_(R), N_(N), to_(to), sums_(1, R, N, 1.0f), round_(round_to_bf16_fn()),
        add_rows_(use_avx512() ? add_rows_avx512 : add_rows_portable) {}
  bool accumulates() const override { return true; }
  size_t scratch_bytes(int num_threads) const override { return sums_.scratch_bytes(num_threads); }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());  // (R, N)
    void* y = args.outputs[0].data();                                     // (R, N) bf16 or f16
    const bool add_cast = accumulate_flag(args, 0);  // never a parameter's gradient: kept simple
    const int threads = threads_for(R_ * N_, ctx.num_threads);
    if (add_cast) {
      parallel_for(
          R_ * N_, threads,
          [&](int64_t begin, int64_t end, int) { add_cast_into(static_cast<uint16_t*>(y), x, begin, end); }, 16);
      KernelArgs sum_args;
      sum_args.inputs = {args.inputs[0]};
      sum_args.outputs = {args.outputs[1]};
      sum_args.accumulate = {static_cast<uint8_t>(accumulate_flag(args, 1))};
      sum_args.scratch = args.scratch;
      sums_.run(sum_args, ctx);
      return;
    }
    // Each block of rows cast and summed into its partial kCastRows rows at a time, while they are in cache.
    const int64_t nb = sums_.blocks();
    parallel_for(nb, threads, [&](int64_t begin, int64_t end, int) {
      for (int64_t b = begin; b < end; ++b) {
        float* part = sums_.block_partial(args.scratch, 0, b);
        std::memset(part, 0, static_cast<size_t>(N_) * sizeof(float));
        const int64_t r1 = std::min(R_, (b + 1) * kColumnSumRows);
        for (int64_t r = b * kColumnSumRows; r < r1; r += kCastRows) {
          const int64_t rows = std::min(kCastRows, r1 - r);
          cast(y, x, r * N_, rows * N_);
          add_rows_(part, x + r * N_, N_, rows, N_);
        }
      }
    });
    sums_.sum_blocks(static_cast<float*>(args.outputs[1].data()), args.scratch, accumulate_flag(args, 1), threads);
  }

 private:
  static constexpr int64_t kCastRows = 16;

  // y[first, first + n) = x[first, first + n) cast.
  void cast(void* y, const float* x, int64_t first, int64_t n) const {
    uint16_t* to = static_cast<uint16_t*>(y) + first;
    if (to_ == DType::bf16)
      round_(to, x + first, n);
    else
      float_to_f16(to, x + first, static_cast<size_t>(n));
  }

  // y[i] = y[i] + x[i] for i in [begin, end), the sum rounded to y's dtype once.
  void add_cast_into(uint16_t* y, const float* x, int64_t begin, int64_t end) const {
    for (int64_t i = begin; i < end; ++i) {
      const double old = to_ == DType::bf16 ? bf16_to_float(y[i]) : f16_to_float(y[i]);
      const float sum = static_cast<float>(old + static_cast<double>(x[i]));
      y[i] = to_ == DType::bf16 ? float_to_bf16(sum) : float_to_f16(sum);
    }
  }

  int64_t R_, N_;
  DType to_;
  ReduceKernel sums_;
  RoundBf16Fn round_;
  void (*add_rows_)(float*, const float*, int64_t, int64_t, int64_t);
};

// Any pattern: kept groups (output order) and reduced groups, each with its
// input stride. out[k] = sum over the reduced index space of x[base(k) + ...].
struct GroupLayout {
  int rank = 0;
  std::array<int64_t, kMaxRank> dims{};
  std::array<int64_t, kMaxRank> strides{};
};

class GenericReduceKernel final : public Kernel {
 public:
  GenericReduceKernel(GroupLayout kept, GroupLayout reduced, int64_t outputs, int64_t count, float scale)
      : kept_(kept),
        reduced_(reduced),
        outputs_(outputs),
        count_(count),
        scale_(scale),
        row_sum_(use_avx512() ? row_sum_avx512 : row_sum_portable) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());
    float* out = static_cast<float*>(args.outputs[0].data());
    const bool acc = accumulate_flag(args, 0);
    parallel_for(outputs_, threads_for(outputs_ * count_, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t k = begin; k < end; ++k) {
        const float v = sum_one(x + kept_offset(k)) * scale_;
        out[k] = acc ? out[k] + v : v;
      }
    });
  }

 private:
  int64_t kept_offset(int64_t k) const {
    int64_t offset = 0;
    for (int i = kept_.rank - 1; i >= 0; --i) {
      offset += (k % kept_.dims[i]) * kept_.strides[i];
      k /= kept_.dims[i];
    }
    return offset;
  }

  float sum_one(const float* base) const {
    const int last = reduced_.rank - 1;
    const int64_t n = reduced_.dims[last], stride = reduced_.strides[last];
    std::array<int64_t, kMaxRank> index{};
    int64_t offset = 0;
    float sum = 0.0f;
    for (;;) {
      if (stride == 1) {
        sum += row_sum_(base + offset, n);
      } else {
        for (int64_t i = 0; i < n; ++i) sum += base[offset + i * stride];
      }
      int axis = last - 1;
      for (; axis >= 0; --axis) {
        offset += reduced_.strides[axis];
        if (++index[axis] < reduced_.dims[axis]) break;
        offset -= reduced_.strides[axis] * reduced_.dims[axis];
        index[axis] = 0;
      }
      if (axis < 0) return sum;
    }
  }

  GroupLayout kept_, reduced_;
  int64_t outputs_, count_;
  float scale_;
  float (*row_sum_)(const float*, int64_t);
};

}  // namespace

AddRowsFn add_rows_fn() { return use_avx512() ? add_rows_avx512 : add_rows_portable; }

void sum_column_blocks(float* out, const float* partials, int64_t outer, int64_t blocks, int64_t width, float scale,
                       bool accumulate, int threads) {
  const AddRowsFn add_rows = add_rows_fn();
  const int64_t jobs_per_row = (width + kColumnBlock - 1) / kColumnBlock;
  parallel_for(outer * jobs_per_row, threads, [&](int64_t begin, int64_t end, int) {
    alignas(64) float sums[kColumnBlock];
    for (int64_t job = begin; job < end; ++job) {
      const int64_t o = job / jobs_per_row, c0 = (job % jobs_per_row) * kColumnBlock;
      const int64_t n = std::min(kColumnBlock, width - c0);
      std::memset(sums, 0, sizeof(sums));
      add_rows(sums, partials + o * blocks * width + c0, width, blocks, n);
      for (int64_t c = 0; c < n; ++c) {
        const float v = sums[c] * scale;
        float& y = out[o * width + c0 + c];
        y = accumulate ? y + v : v;
      }
    }
  });
}

std::unique_ptr<Kernel> make_reduce_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  if (input_dtype(call, 0) != DType::f32 || x.numel() == 0) return nullptr;
  const int64_t rank = x.rank();
  std::vector<bool> reduced(static_cast<size_t>(rank), false);
  if (call.op == OpKind::ReduceSumTo) {
    const Shape target(call.params<ops::ShapeParams>().shape);
    const int64_t lead = rank - target.rank();
    for (int64_t a = 0; a < rank; ++a) reduced[a] = a < lead || (target[a - lead] == 1 && x[a] != 1);
  } else {
    for (int64_t a : call.params<ops::ReduceParams>().axes) reduced[static_cast<size_t>(a < 0 ? a + rank : a)] = true;
  }
  // Merge into (extent, reduced) groups, skipping extent-1 axes.
  std::vector<std::pair<int64_t, bool>> groups;
  int64_t count = 1;
  for (int64_t a = 0; a < rank; ++a) {
    if (reduced[a]) count *= x[a];
    if (x[a] == 1) continue;
    if (!groups.empty() && groups.back().second == reduced[a])
      groups.back().first *= x[a];
    else
      groups.push_back({x[a], reduced[a]});
  }
  int64_t O = 1, R = 1, I = 1;
  size_t at = 0;
  if (at < groups.size() && !groups[at].second) O = groups[at++].first;
  if (at < groups.size() && groups[at].second) R = groups[at++].first;
  if (at < groups.size() && !groups[at].second) I = groups[at++].first;
  const float scale = call.op == OpKind::ReduceMean ? static_cast<float>(1.0 / static_cast<double>(count)) : 1.0f;
  if (at == groups.size()) return std::make_unique<ReduceKernel>(O, R, I, scale);
  // Reduced groups on both sides of a kept one: the generic walk.
  GroupLayout kept, summed;
  int64_t stride = x.numel(), outputs = 1;
  for (const auto& [extent, is_reduced] : groups) {
    stride /= extent;
    GroupLayout& layout = is_reduced ? summed : kept;
    if (layout.rank == kMaxRank) return nullptr;
    layout.dims[layout.rank] = extent;
    layout.strides[layout.rank] = stride;
    ++layout.rank;
    if (!is_reduced) outputs *= extent;
  }
  return std::make_unique<GenericReduceKernel>(kept, summed, outputs, count, scale);
}

std::unique_ptr<Kernel> make_cast_column_sum_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  const int64_t N = x.rank() > 0 ? x[-1] : 1, R = N > 0 ? x.numel() / N : 0;
  const DType to = output_dtype(call, 0);
  // R or N of 1 makes ReduceSum's view another one (row sums, or no sum); the pass never forms those.
  if (input_dtype(call, 0) != DType::f32 || R < 2 || N < 2 || (to != DType::bf16 && to != DType::f16)) return nullptr;
  return std::make_unique<CastColumnSumKernel>(R, N, to);
}

}  // namespace fusetrain::kernels::cpu_basic
