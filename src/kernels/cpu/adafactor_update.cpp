// Adafactor's update on the CPU devices (transformers.optimization.Adafactor's order of operations, in f32 with the
// sums in double), one phase at a time over one parameter or a ZeRO shard's part of it.
#include <algorithm>
#include <cmath>

#include "core/loops.h"
#include "fusetrain/core/error.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {
namespace {

// Calls fn(start, stop, br, col0) for each row piece of a factored parameter's elements [begin, end): elements
// [start, stop) lie in row br (batch × rows index) from column col0 on.
template <typename Fn>
void for_each_row_piece(int64_t begin, int64_t end, int64_t cols, Fn&& fn) {
  for (int64_t start = begin; start < end;) {
    const int64_t br = start / cols;
    const int64_t stop = std::min(end, (br + 1) * cols);
    fn(start, stop, br, start - br * cols);
    start = stop;
  }
}

// The span's share of the statistics: a factored parameter's row and column sums of u = g² + ε, a vector's new
// moving average of u.
void statistics(const AdafactorUpdate& u, const OptimizerSpan& s, int threads) {
  const float scale = u.grad_scale, eps = u.eps, beta2t = u.beta2t, one_minus = u.one_minus_beta2t;
  const float* g = s.g;
  if (u.rows == 0) {
    const float* v = u.square;
    double* out = u.new_square;
#pragma omp parallel for num_threads(threads) schedule(static) if (s.end - s.begin > 65536)
    for (int64_t k = s.begin; k < s.end; ++k) {
      const float grad = g[k] * scale;
      out[k] = v[k] * beta2t + one_minus * (grad * grad + eps);
    }
    return;
  }
  double* rs = u.row_sums;
  double* cs = u.col_sums;
  for_each_row_piece(s.begin, s.end, u.cols, [&](int64_t start, int64_t stop, int64_t br, int64_t col0) {
    double* c = cs + (br / u.rows) * u.cols + col0 - start;
    double sum = 0;
    for (int64_t k = start; k < stop; ++k) {
      const float grad = g[k] * scale;
      const float value = grad * grad + eps;
      sum += value;
      c[k] += value;
    }
    rs[br] += sum;
  });
}

// The whole parameter's states from the (rank-summed) statistics, and each factored row's factor rsqrt(R / mean(R)).
void states(const AdafactorUpdate& u) {
  const float beta2t = u.beta2t, one_minus = u.one_minus_beta2t;
  if (u.rows == 0) {
    for (int64_t k = 0; k < u.numel; ++k) u.square[k] = static_cast<float>(u.new_square[k]);
    return;
  }
  for (int64_t b = 0; b < u.batch; ++b) {
    float* rb = u.row + b * u.rows;
    float* cb = u.col + b * u.cols;
    const double* rs = u.row_sums + b * u.rows;
    const double* cs = u.col_sums + b * u.cols;
    for (int64_t row = 0; row < u.rows; ++row)
      rb[row] = rb[row] * beta2t + one_minus * static_cast<float>(rs[row] / static_cast<double>(u.cols));
    for (int64_t k = 0; k < u.cols; ++k)
      cb[k] = cb[k] * beta2t + one_minus * static_cast<float>(cs[k] / static_cast<double>(u.rows));
    double row_total = 0;
    for (int64_t row = 0; row < u.rows; ++row) row_total += rb[row];
    const float row_mean = static_cast<float>(row_total / static_cast<double>(u.rows));
    float* fr = u.row_factor + b * u.rows;
    for (int64_t row = 0; row < u.rows; ++row) fr[row] = 1.0f / std::sqrt(rb[row] / row_mean);
  }
}

// Adds the sum of squares of the span's update before clipping, f_k · g_k (f: the inverse root of the second-moment
// estimate), to *update_squares.
void update_squares(const AdafactorUpdate& u, const OptimizerSpan& s, int threads) {
  const float scale = u.grad_scale;
  const float* g = s.g;
  double sum = *u.update_squares;
  if (u.rows == 0) {
    const float* v = u.square;
#pragma omp parallel for num_threads(threads) reduction(+ : sum) schedule(static) if (s.end - s.begin > 65536)
    for (int64_t k = s.begin; k < s.end; ++k) {
      const float value = 1.0f / std::sqrt(v[k]) * (g[k] * scale);
      sum += static_cast<double>(value) * value;
    }
  } else {
    const float* fr = u.row_factor;
    for_each_row_piece(s.begin, s.end, u.cols, [&](int64_t start, int64_t stop, int64_t br, int64_t col0) {
      const float* cb = u.col + (br / u.rows) * u.cols + col0 - start;
      for (int64_t k = start; k < stop; ++k) {
        const float value = fr[br] * (1.0f / std::sqrt(cb[k])) * (g[k] * scale);
        sum += static_cast<double>(value) * value;
      }
    });
  }
  *u.update_squares = sum;
}

// The span's clipped update: p −= lr · f_k·g_k / max(1, RMS / clip_threshold), after p += decay·p where decayed.
void apply(const AdafactorUpdate& u, const OptimizerSpan& s, int threads) {
  const float scale = u.grad_scale, lr = u.lr, decay = u.decay;
  const float rms = static_cast<float>(std::sqrt(*u.update_squares) / std::sqrt(static_cast<double>(u.numel)));
  const float divisor = std::max(rms / u.clip_threshold, 1.0f);
  const bool decays = s.decay && decay != 0.0f, zero = s.zero_grads;
  float* p = s.p;
  float* g = s.g;
  auto element = [&](int64_t k, float factor) {
    const float grad = g[k] * scale;
    if (zero) g[k] = 0.0f;
    const float step = factor * grad / divisor * lr;
    float pk = p[k];
    if (decays) pk = pk + decay * pk;
    p[k] = pk - step;
  };
  if (u.rows == 0) {
    const float* v = u.square;
#pragma omp parallel for num_threads(threads) schedule(static) if (s.end - s.begin > 65536)
    for (int64_t k = s.begin; k < s.end; ++k) element(k, 1.0f / std::sqrt(v[k]));
    return;
  }
  const float* fr = u.row_factor;
  const int64_t first_row = s.begin / u.cols, last_row = (s.end + u.cols - 1) / u.cols;
#pragma omp parallel for num_threads(threads) schedule(static) if (last_row - first_row > 64)
  for (int64_t br = first_row; br < last_row; ++br) {
    const int64_t start = std::max(s.begin, br * u.cols), stop = std::min(s.end, (br + 1) * u.cols);
    const float* cb = u.col + (br / u.rows) * u.cols - br * u.cols;
    for (int64_t k = start; k < stop; ++k) element(k, fr[br] * (1.0f / std::sqrt(cb[k])));
  }
}

}  // namespace

void cpu_adafactor_update(const AdafactorUpdate& u, const OptimizerSpan& s, const StepContext& ctx) {
  const int threads = threads_or_default(ctx.num_threads);
  switch (u.phase) {
    case AdafactorUpdate::Phase::Statistics:
      return statistics(u, s, threads);
    case AdafactorUpdate::Phase::States:
      return states(u);
    case AdafactorUpdate::Phase::UpdateSquares:
      return update_squares(u, s, threads);
    case AdafactorUpdate::Phase::Apply:
      return apply(u, s, threads);
  }
  throw Error("adafactor_update: unknown phase");
}

}  // namespace fusetrain::kernels
