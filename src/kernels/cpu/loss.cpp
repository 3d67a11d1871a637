// Tuned SoftmaxCrossEntropy and its backward, f32 logits, i64/i32 targets.
//
// Shape legend: N rows (product of the leading axes), V vocabulary.
//   forward:  logits (N, V), targets (N) -> loss (), lse (N) = log sum_v exp(logits)
//             loss = mean over counted rows (target != ignore_index) of lse - logit[target]
//   backward: dloss (), logits (N, V), targets (N), lse (N)
//             -> dlogits (N, V) = dloss * (softmax - onehot) / count on counted rows, 0 elsewhere
// No vocabulary-sized temporary: the forward keeps only lse per row, the
// backward recomputes softmax = exp(logits - lse). Targets are checked before
// anything is written; one outside [0, V) that is not ignore_index throws.
// Per-row losses are summed in double per thread, then across threads in order.
#include <cmath>
#include <limits>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// ---- log-sum-exp of one row ---------------------------------------------------------------------

float row_lse_portable(const float* x, int64_t V) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) max = std::max(max, x[v]);
  float sum = 0.0f;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(x[v] - max);
  return max + std::log(sum);
}

FT_AVX512 float row_lse_avx512(const float* x, int64_t V) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = neg_inf, m1 = neg_inf;
  int64_t v = 0;
  for (; v + 32 <= V; v += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + v));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + v + 16));
  }
  for (; v < V; v += 16) m0 = _mm512_max_ps(m0, _mm512_mask_loadu_ps(neg_inf, tail_mask(V - v), x + v));
  const float max = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  const __m512 vmax = _mm512_set1_ps(max);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (v = 0; v + 32 <= V; v += 32) {
    s0 = _mm512_add_ps(s0, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + v), vmax)));
    s1 = _mm512_add_ps(s1, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + v + 16), vmax)));
  }
  for (; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    s0 = _mm512_mask_add_ps(s0, m, s0, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + v), vmax)));
  }
  return max + std::log(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
}

FT_AVX2 float row_lse_avx2(const float* x, int64_t V) {
  const float max = row_max8(x, V);
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + v), vmax)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + v + 8), vmax)));
  }
  for (; v < V; v += 8) {
    const __m256 e = exp8(_mm256_sub_ps(load8(x + v, V - v), vmax));
    s0 = _mm256_add_ps(s0, _mm256_and_ps(e, _mm256_castsi256_ps(lanes8(V - v))));
  }
  return max + std::log(reduce_add8(_mm256_add_ps(s0, s1)));
}

// ---- token statistics of one row: entropy lse − Σ exp(x − lse)·x, and whether x[target] is the first maximum ----

RowStats row_stats_portable(const float* x, int64_t V, float lse, int64_t target) {
  float expected = 0.0f;
  for (int64_t v = 0; v < V; ++v) expected += std::exp(x[v] - lse) * x[v];
  bool top1 = true;
  for (int64_t v = 0; v < V && top1; ++v) top1 = v < target ? x[v] < x[target] : x[v] <= x[target];
  return {lse - expected, top1};
}

FT_AVX512 float row_max_avx512(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = neg_inf;
  for (int64_t v = 0; v < n; v += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(neg_inf, tail_mask(n - v), x + v));
  return _mm512_reduce_max_ps(m);
}

FT_AVX512 RowStats row_stats_avx512(const float* x, int64_t V, float lse, int64_t target) {
  const __m512 vlse = _mm512_set1_ps(lse);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t v = 0;
  for (; v + 32 <= V; v += 32) {
    const __m512 a = _mm512_loadu_ps(x + v), b = _mm512_loadu_ps(x + v + 16);
    s0 = _mm512_fmadd_ps(exp16(_mm512_sub_ps(a, vlse)), a, s0);
    s1 = _mm512_fmadd_ps(exp16(_mm512_sub_ps(b, vlse)), b, s1);
  }
  for (; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    const __m512 a = _mm512_maskz_loadu_ps(m, x + v);
    s0 = _mm512_mask3_fmadd_ps(exp16(_mm512_sub_ps(a, vlse)), a, s0, m);
  }
  const float t = x[target];
  const bool top1 = row_max_avx512(x, target) < t && row_max_avx512(x + target + 1, V - target - 1) <= t;
  return {lse - _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)), top1};
}

FT_AVX2 RowStats row_stats_avx2(const float* x, int64_t V, float lse, int64_t target) {
  const __m256 vlse = _mm256_set1_ps(lse);
  __m256 s = _mm256_setzero_ps();
  for (int64_t v = 0; v < V; v += 8) {
    const __m256 a = load8(x + v, V - v);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(a, vlse)), _mm256_castsi256_ps(lanes8(V - v)));
    s = _mm256_fmadd_ps(e, a, s);
  }
  const float t = x[target];
  const bool top1 = row_max8(x, target) < t && row_max8(x + target + 1, V - target - 1) <= t;
  return {lse - reduce_add8(s), top1};
}

// ---- dlogits of one row: exp(x - lse) * scale ------------------------------------------------------

void row_grad_portable(float* d, const float* x, int64_t V, float lse, float scale) {
  for (int64_t v = 0; v < V; ++v) d[v] = std::exp(x[v] - lse) * scale;
}

FT_AVX512 void row_grad_avx512(float* d, const float* x, int64_t V, float lse, float scale) {
  const __m512 vlse = _mm512_set1_ps(lse), vscale = _mm512_set1_ps(scale);
  int64_t v = 0;
  for (; v + 16 <= V; v += 16)
    _mm512_storeu_ps(d + v, _mm512_mul_ps(exp16(_mm512_sub_ps(_mm512_loadu_ps(x + v), vlse)), vscale));
  if (v < V) {
    const __mmask16 m = tail_mask(V - v);
    _mm512_mask_storeu_ps(d + v, m, _mm512_mul_ps(exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + v), vlse)), vscale));
  }
}

FT_AVX2 void row_grad_avx2(float* d, const float* x, int64_t V, float lse, float scale) {
  const __m256 vlse = _mm256_set1_ps(lse), vscale = _mm256_set1_ps(scale);
  for (int64_t v = 0; v < V; v += 8)
    store8(d + v, V - v, _mm256_mul_ps(exp8(_mm256_sub_ps(load8(x + v, V - v), vlse)), vscale));
}

// ---- kernels ---------------------------------------------------------------------------------------

class CrossEntropyKernel final : public Kernel {
 public:
  CrossEntropyKernel(int64_t N, int64_t V, int64_t ignore_index, bool i64, std::string name)
      : N_(N),
        V_(V),
        ignore_index_(ignore_index),
        i64_(i64),
        name_(std::move(name)),
        row_lse_(row_lse_fn()) {}

  size_t scratch_bytes(int num_threads) const override {
    return static_cast<size_t>(std::max(num_threads, 1)) * kAlignment;
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* logits = static_cast<const float*>(args.inputs[0].data());  // (N, V)
    const void* targets = args.inputs[1].data();                             // (N)
    float* loss = static_cast<float*>(args.outputs[0].data());               // ()
    float* lse = static_cast<float*>(args.outputs[1].data());                // (N)
    const int64_t count = count_targets("SoftmaxCrossEntropy", name_, targets, i64_, N_, V_, ignore_index_);
    constexpr size_t kSlot = kAlignment / sizeof(double);
    double* partial = static_cast<double*>(args.scratch);
    const int threads = threads_for(N_ * V_, ctx.num_threads);
    for (int t = 0; t < threads; ++t) partial[t * kSlot] = 0.0;
    const int64_t V = V_;
    parallel_for(N_, threads, [&](int64_t begin, int64_t end, int t) {
      double sum = 0.0;
      for (int64_t r = begin; r < end; ++r) {
        const float* row = logits + r * V;
        const float row_lse = row_lse_(row, V);
        lse[r] = row_lse;
        const int64_t target = load_target(targets, i64_, r);
        if (target != ignore_index_) sum += static_cast<double>(row_lse) - static_cast<double>(row[target]);
      }
      partial[t * kSlot] = sum;
    });
    double total = 0.0;
    for (int t = 0; t < threads; ++t) total += partial[t * kSlot];
    *loss = count > 0 ? static_cast<float>(total / static_cast<double>(count)) : 0.0f;
  }

 private:
  int64_t N_, V_, ignore_index_;
  bool i64_;
  std::string name_;
  float (*row_lse_)(const float*, int64_t);
};

class CrossEntropyBackwardKernel final : public Kernel {
 public:
  CrossEntropyBackwardKernel(int64_t N, int64_t V, int64_t ignore_index, bool i64, std::string name)
      : N_(N),
        V_(V),
        ignore_index_(ignore_index),
        i64_(i64),
        name_(std::move(name)),
        row_grad_(row_softmax_grad_fn()) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float dloss = *static_cast<const float*>(args.inputs[0].data());   // ()
    const float* logits = static_cast<const float*>(args.inputs[1].data());  // (N, V)
    const void* targets = args.inputs[2].data();                             // (N)
    const float* lse = static_cast<const float*>(args.inputs[3].data());     // (N)
    float* dlogits = static_cast<float*>(args.outputs[0].data());            // (N, V)
    const int64_t count = count_targets("SoftmaxCrossEntropyBackward", name_, targets, i64_, N_, V_, ignore_index_);
    const float scale = count > 0 ? static_cast<float>(static_cast<double>(dloss) / static_cast<double>(count)) : 0.0f;
    const int64_t V = V_;
    parallel_for(N_, threads_for(N_ * V_, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) {
        float* d = dlogits + r * V;
        const float* row = logits + r * V;
        const int64_t target = load_target(targets, i64_, r);
        if (target == ignore_index_ || count == 0) {
          std::fill(d, d + V, 0.0f);
          continue;
        }
        const float target_logit = row[target];  // read first: d may be row itself (in place)
        row_grad_(d, row, V, lse[r], scale);
        d[target] = (std::exp(target_logit - lse[r]) - 1.0f) * scale;
      }
    });
  }

 private:
  int64_t N_, V_, ignore_index_;
  bool i64_;
  std::string name_;
  void (*row_grad_)(float*, const float*, int64_t, float, float);
};

bool targets_dtype(DType t, bool* i64) {
  if (t != DType::i64 && t != DType::i32) return false;
  *i64 = t == DType::i64;
  return true;
}

}  // namespace

// Counts rows whose target is not ignore_index; throws on a target outside [0, V).
int64_t count_targets(const char* op, const std::string& node, const void* targets, bool i64, int64_t N, int64_t V,
                      int64_t ignore_index) {
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) {
    int64_t t = load_target(targets, i64, i);
    if (t == ignore_index) continue;
    if (t < 0 || t >= V)
      throw Error(str(op, node.empty() ? "" : str(" \"", node, "\""), ": target ", t, " at row ", i,
                      " is outside the vocabulary [0, ", V, ") and is not ignore_index ", ignore_index));
    ++count;
  }
  return count;
}

RowLseFn row_lse_fn() { return pick_path<RowLseFn>(row_lse_portable, row_lse_avx2, row_lse_avx512); }

RowStatsFn row_stats_fn() { return pick_path<RowStatsFn>(row_stats_portable, row_stats_avx2, row_stats_avx512); }

RowSoftmaxGradFn row_softmax_grad_fn() {
  return pick_path<RowSoftmaxGradFn>(row_grad_portable, row_grad_avx2, row_grad_avx512);
}

std::unique_ptr<Kernel> make_cross_entropy_kernel(const KernelCall& call) {
  const Shape& logits = input_shape(call, 0);
  bool i64;
  if (!targets_dtype(input_dtype(call, 1), &i64) || logits[-1] == 0) return nullptr;
  return std::make_unique<CrossEntropyKernel>(logits.numel() / logits[-1], logits[-1],
                                              call.params<ops::CrossEntropyParams>().ignore_index, i64, call.name);
}

std::unique_ptr<Kernel> make_cross_entropy_backward_kernel(const KernelCall& call) {
  const Shape& logits = input_shape(call, 1);
  bool i64;
  if (!targets_dtype(input_dtype(call, 2), &i64) || logits.rank() < 1 || logits[-1] == 0) return nullptr;
  const int64_t ignore_index = call.params<ops::CrossEntropyParams>().ignore_index;
  return std::make_unique<CrossEntropyBackwardKernel>(logits.numel() / logits[-1], logits[-1], ignore_index, i64,
                                                      call.name);
}

}  // namespace fusetrain::kernels::cpu_basic
