// LinearCrossEntropy: a language-model head and its loss in chunks of rows, with
// the gradients formed in the same pass (see docs/ops.md).
//
// Legend: R rows (product of x's leading axes), K features, V vocabulary, m rows of one chunk.
//   inputs:  x (R, K) and w (V, K), both f32 or both bf16; targets (R) i64/i32; bias (V) f32, optional
//   outputs: loss () = mean over counted rows (target != ignore_index) of lse - logit[target]
//            dx (R, K), dw (V, K), dbias (V): d(loss)/d(x, w, bias), f32
//            dx, dw and dbias are added into (KernelArgs::accumulate) when they are a parameter's gradient buffer
//            with token_stats, a last (3): Σ entropy, top-1 hits and counted rows (TokenStats), from each row's
//            logits before they become G
// Only counted rows are computed: they are gathered into chunks of m, and per chunk
//   logits (m, V) = x_c · wᵀ + bias           one GEMM, bias in its epilogue (as Linear)
//   G = (softmax - onehot) / count            per row, in place (as SoftmaxCrossEntropyBackward)
//   dx_c = G · w,  dw += Gᵀ · x_c,  dbias += Σ_rows G
// With bf16 operands G is rounded to bf16 for the two GEMMs (as the unfused backward casts dlogits),
// written over the first half of each f32 row, so the chunk needs no second buffer. The (R, V)
// logits are never stored: scratch holds one chunk. Ignored rows get dx = 0 and cost nothing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/dense_kernels.h"
#include "kernels/cpu/gemm.h"

namespace fusetrain::kernels {

namespace {

using cpu_basic::load_target;

// Rows of one chunk when the call leaves it to the kernel (chunk_rows 0): about 32 MiB of f32 logits, but at least
// kMinChunkRows, because the logits and dx GEMMs pack all of w again for every chunk (gpt2's 50257-word
// head: 13 chunks of 166 rows cost 25% more than the three unchunked GEMMs, 4 chunks of 512 about 10%).
constexpr int64_t kChunkBytes = int64_t{32} << 20;
constexpr int64_t kMinChunkRows = 512;

// The bias in the epilogue of the logits GEMM, exactly as LinearEpilogue adds it.
struct BiasEpilogue {
  const float* bias;
  cpu_basic::AddRowsFn add_rows;
  static void apply(const void* context, float* c, int64_t ldc, int64_t, int64_t col, int64_t rows, int64_t cols) {
    const BiasEpilogue& e = *static_cast<const BiasEpilogue*>(context);
    for (int64_t r = 0; r < rows; ++r) e.add_rows(c + r * ldc, e.bias + col, 0, 1, cols);
  }
};

class LinearCrossEntropyKernel final : public Kernel {
 public:
  LinearCrossEntropyKernel(const KernelCall& call) : name_(call.name) {
    const Shape& x = call.inputs[0].shape;
    bf16_ = call.inputs[0].dtype == DType::bf16;
    i64_ = call.inputs[2].dtype == DType::i64;
    has_bias_ = call.inputs.size() == 4;
    weight_grad_ = call.params<ops::LinearCrossEntropyParams>().weight_grad;
    token_stats_ = call.params<ops::LinearCrossEntropyParams>().token_stats;
    K_ = x[-1];
    R_ = x.numel() / K_;
    V_ = call.inputs[1].shape[0];
    const ops::LinearCrossEntropyParams& params = call.params<ops::LinearCrossEntropyParams>();
    ignore_index_ = params.ignore_index;
    const int64_t chunk = params.chunk_rows;
    m_ = std::clamp<int64_t>(chunk > 0 ? chunk : std::max(kMinChunkRows, kChunkBytes / (V_ * 4)), 1,
                             std::max<int64_t>(R_, 1));
    row_lse_ = cpu_basic::row_lse_fn();
    add_rows_ = cpu_basic::add_rows_fn();
    row_stats_ = cpu_basic::row_stats_fn();
    softmax_grad_ = cpu_basic::row_softmax_grad_fn();
    round_ = cpu_basic::round_to_bf16_fn();
    const int64_t ldg = g_stride();
    logits_shape_ = GemmShape{m_, V_, K_, false, true, K_, K_, V_};
    dx_shape_ = GemmShape{m_, K_, V_, false, false, ldg, K_, K_};
    dw_shape_ = GemmShape{V_, K_, m_, true, false, ldg, K_, K_};
  }

  bool accumulates() const override { return true; }

  size_t scratch_bytes(int num_threads) const override {
    const int threads = std::max(num_threads, 1);
    auto gemm_bytes = [&](const GemmShape& s) {
      return bf16_ ? gemm_bf16_scratch_bytes(s, threads) : gemm_f32_scratch_bytes(s, threads);
    };
    Layout l = layout(threads);
    return l.gemm + std::max({gemm_bytes(logits_shape_), gemm_bytes(dx_shape_), gemm_bytes(dw_shape_)});
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const int threads = std::max(ctx.num_threads, 1);
    const Layout l = layout(threads);
    char* scratch = static_cast<char*>(args.scratch);
    auto* rows = reinterpret_cast<int64_t*>(scratch + l.rows);            // (R) counted rows, in order
    auto* logits = reinterpret_cast<float*>(scratch + l.logits);          // (m, V), then G
    char* x_chunk = scratch + l.x_chunk;                                  // (m, K) gathered rows of x
    auto* dx_chunk = reinterpret_cast<float*>(scratch + l.dx_chunk);      // (m, K)
    auto* bias_partial = reinterpret_cast<float*>(scratch + l.bias_sums); // (threads, V)
    auto* loss_partial = reinterpret_cast<double*>(scratch + l.loss_sums);
    auto* stats_partial = reinterpret_cast<double*>(scratch + l.stats_sums);  // (threads) × entropy, top-1 hits
    void* gemm_scratch = scratch + l.gemm;

    const char* x = static_cast<const char*>(args.inputs[0].data());
    const void* w = args.inputs[1].data();
    const void* targets = args.inputs[2].data();
    const float* bias = has_bias_ ? static_cast<const float*>(args.inputs[3].data()) : nullptr;
    float* loss = static_cast<float*>(args.outputs[0].data());
    float* dx = static_cast<float*>(args.outputs[1].data());
    float* dw = weight_grad_ ? static_cast<float*>(args.outputs[2].data()) : nullptr;
    float* dbias = weight_grad_ ? static_cast<float*>(args.outputs[3].data()) : nullptr;
    const bool bias_grad = has_bias_ && weight_grad_;

    const int64_t count =
        cpu_basic::count_targets("LinearCrossEntropy", name_, targets, i64_, R_, V_, ignore_index_);
    float* stats = token_stats_ ? static_cast<float*>(args.outputs.back().data()) : nullptr;
    if (stats) stats[0] = stats[1] = 0.0f, stats[2] = static_cast<float>(count);
    // Outputs that are a parameter's gradient buffer are added into; the rest are written.
    const bool add_dx = args.accumulate.size() > 1 && args.accumulate[1];
    const bool add_dw = dw != nullptr && args.accumulate.size() > 2 && args.accumulate[2];
    const bool add_dbias = dbias != nullptr && args.accumulate.size() > 3 && args.accumulate[3];
    if (!add_dx) std::memset(dx, 0, static_cast<size_t>(R_ * K_) * sizeof(float));
    if (dbias != nullptr && !add_dbias) std::fill(dbias, dbias + V_, 0.0f);
    *loss = 0.0f;
    if (count == 0) {
      if (dw != nullptr && !add_dw) std::memset(dw, 0, static_cast<size_t>(V_ * K_) * sizeof(float));
      return;
    }
    for (int64_t r = 0, c = 0; r < R_; ++r)
      if (load_target(targets, i64_, r) != ignore_index_) rows[c++] = r;

    const float scale = static_cast<float>(1.0 / static_cast<double>(count));
    const size_t x_row_bytes = static_cast<size_t>(K_) * (bf16_ ? 2 : 4);
    const int row_threads = cpu_basic::threads_for(m_ * V_, threads);
    constexpr size_t kSlot = kAlignment / sizeof(double);
    for (int t = 0; t < threads; ++t) loss_partial[t * kSlot] = stats_partial[t * kSlot] = stats_partial[t * kSlot + 1] = 0.0;
    if (bias_grad) std::fill(bias_partial, bias_partial + threads * V_, 0.0f);
    const BiasEpilogue bias_epilogue{bias, add_rows_};
    const GemmEpilogue epilogue{&BiasEpilogue::apply, &bias_epilogue};

    for (int64_t begin = 0; begin < count; begin += m_) {
      const int64_t mc = std::min(m_, count - begin);
      for (int64_t i = 0; i < mc; ++i)
        std::memcpy(x_chunk + static_cast<size_t>(i) * x_row_bytes, x + rows[begin + i] * x_row_bytes, x_row_bytes);
      GemmShape s = logits_shape_;
      s.M = mc;
      gemm(s, x_chunk, w, 0.0f, logits, gemm_scratch, threads, bias ? &epilogue : nullptr);

      cpu_basic::parallel_for(mc, row_threads, [&](int64_t r0, int64_t r1, int t) {
        double sum = 0.0;
        float* bias_sum = bias_partial + t * V_;
        for (int64_t i = r0; i < r1; ++i) {
          float* row = logits + i * V_;
          const int64_t target = load_target(targets, i64_, rows[begin + i]);
          const float lse = row_lse_(row, V_);
          const float target_logit = row[target];
          sum += static_cast<double>(lse) - static_cast<double>(target_logit);
          if (stats) {
            const cpu_basic::RowStats s = row_stats_(row, V_, lse, target);
            stats_partial[t * kSlot] += s.entropy;
            stats_partial[t * kSlot + 1] += s.top1 ? 1.0 : 0.0;
          }
          softmax_grad_(row, row, V_, lse, scale);
          row[target] = (std::exp(target_logit - lse) - 1.0f) * scale;
          if (bias_grad)
            for (int64_t v = 0; v < V_; ++v) bias_sum[v] += row[v];
          if (bf16_) round_(reinterpret_cast<uint16_t*>(row), row, V_);  // over the row's first half
        }
        loss_partial[t * kSlot] += sum;
      });

      s = dx_shape_;
      s.M = mc;
      gemm(s, logits, w, 0.0f, dx_chunk, gemm_scratch, threads, nullptr);
      for (int64_t i = 0; i < mc; ++i) {
        float* row = dx + rows[begin + i] * K_;
        if (add_dx)
          for (int64_t k = 0; k < K_; ++k) row[k] += dx_chunk[i * K_ + k];
        else
          std::memcpy(row, dx_chunk + i * K_, static_cast<size_t>(K_) * sizeof(float));
      }
      if (dw == nullptr) continue;  // a frozen head: no weight gradient
      s = dw_shape_;
      s.K = mc;
      gemm(s, logits, x_chunk, begin == 0 && !add_dw ? 0.0f : 1.0f, dw, gemm_scratch, threads, nullptr);
    }
    double total = 0.0, entropy = 0.0, hits = 0.0;
    for (int t = 0; t < threads; ++t) {
      total += loss_partial[t * kSlot];
      entropy += stats_partial[t * kSlot];
      hits += stats_partial[t * kSlot + 1];
    }
    if (stats) stats[0] = static_cast<float>(entropy), stats[1] = static_cast<float>(hits);
    *loss = static_cast<float>(total / static_cast<double>(count));
    if (bias_grad)
      for (int t = 0; t < threads; ++t)
        for (int64_t v = 0; v < V_; ++v) dbias[v] += bias_partial[t * V_ + v];
  }

 private:
  // Byte offsets into scratch, each 64-byte aligned; `gemm` is where the GEMMs' workspace starts.
  struct Layout {
    size_t rows, logits, x_chunk, dx_chunk, bias_sums, loss_sums, stats_sums, gemm;
  };

  Layout layout(int threads) const {
    Layout l{};
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t start = at;
      at += align_up(bytes);
      return start;
    };
    l.rows = take(static_cast<size_t>(R_) * sizeof(int64_t));
    l.logits = take(static_cast<size_t>(m_ * V_) * sizeof(float));
    l.x_chunk = take(static_cast<size_t>(m_ * K_) * (bf16_ ? 2 : 4));
    l.dx_chunk = take(static_cast<size_t>(m_ * K_) * sizeof(float));
    l.bias_sums = take(has_bias_ ? static_cast<size_t>(threads * V_) * sizeof(float) : 0);
    l.loss_sums = take(static_cast<size_t>(threads) * kAlignment);
    l.stats_sums = take(static_cast<size_t>(threads) * kAlignment);
    l.gemm = at;
    return l;
  }

  // Elements between rows of G as the GEMMs read it: bf16 G lies in the first half of each f32 row.
  int64_t g_stride() const { return bf16_ ? 2 * V_ : V_; }

  void gemm(const GemmShape& s, const void* a, const void* b, float beta, float* c, void* scratch, int threads,
            const GemmEpilogue* epilogue) const {
    if (bf16_)
      gemm_bf16(s, 1.0f, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), beta, c, scratch, threads,
                epilogue);
    else
      gemm_f32(s, 1.0f, static_cast<const float*>(a), static_cast<const float*>(b), beta, c, scratch, threads,
               epilogue);
  }

  std::string name_;
  bool bf16_ = false, i64_ = true, has_bias_ = false, weight_grad_ = true, token_stats_ = false;
  int64_t R_ = 0, K_ = 0, V_ = 0, m_ = 1, ignore_index_ = -100;
  GemmShape logits_shape_{}, dx_shape_{}, dw_shape_{};
  cpu_basic::RowLseFn row_lse_ = nullptr;
  cpu_basic::AddRowsFn add_rows_ = nullptr;  // the logits' bias
  cpu_basic::RowStatsFn row_stats_ = nullptr;
  cpu_basic::RowSoftmaxGradFn softmax_grad_ = nullptr;
  cpu_basic::RoundBf16Fn round_ = nullptr;
};

// LinearLogProbs (forward) and LinearLogProbsWeightGrad (its dw, dbias): per-row log-probabilities of an LM head
// in chunks of counted rows, as LinearCrossEntropy works through them.
//   LinearLogProbs:  logits GEMM; per row lse, log p = logit[target] − lse, row statistics (entropy, top-1 hit,
//                    mean logit); with input_grad G = onehot − softmax in place and dx_c = G · w (each row's unit
//                    gradient: backward only scales it by the gradient its log-probability received).
//   WeightGrad:      logits GEMM again; G = dlogp[row] · (onehot − exp(logit − lse)) with the forward's lse;
//                    dw += Gᵀ · x_c, dbias += Σ_rows G.
// Ignored rows get log p = 0, lse = 0, dx = 0 and stats 0, and cost nothing.
class LinearLogProbsKernel final : public Kernel {
 public:
  LinearLogProbsKernel(const KernelCall& call) : name_(call.name), weight_grad_(call.op == OpKind::LinearLogProbsWeightGrad) {
    const size_t at = weight_grad_ ? 1 : 0;
    const ops::LogProbsParams& params = call.params<ops::LogProbsParams>();
    const Shape& x = call.inputs[at].shape;
    bf16_ = call.inputs[at].dtype == DType::bf16;
    i64_ = call.inputs[at + 2].dtype == DType::i64;
    bias_at_ = weight_grad_ ? 5 : 3;  // after lse for the weight gradient
    has_bias_ = call.inputs.size() == bias_at_ + 1;
    input_grad_ = !weight_grad_ && params.input_grad;
    row_stats_out_ = !weight_grad_ && params.row_stats;
    ignore_index_ = params.ignore_index;
    K_ = x[-1];
    R_ = x.numel() / K_;
    V_ = call.inputs[at + 1].shape[0];
    m_ = std::clamp<int64_t>(params.chunk_rows > 0 ? params.chunk_rows : std::max(kMinChunkRows, kChunkBytes / (V_ * 4)),
                             1, std::max<int64_t>(R_, 1));
    row_lse_ = cpu_basic::row_lse_fn();
    add_rows_ = cpu_basic::add_rows_fn();
    row_stats_ = cpu_basic::row_stats_fn();
    softmax_grad_ = cpu_basic::row_softmax_grad_fn();
    round_ = cpu_basic::round_to_bf16_fn();
    const int64_t ldg = bf16_ ? 2 * V_ : V_;
    logits_shape_ = GemmShape{m_, V_, K_, false, true, K_, K_, V_};
    dx_shape_ = GemmShape{m_, K_, V_, false, false, ldg, K_, K_};
    dw_shape_ = GemmShape{V_, K_, m_, true, false, ldg, K_, K_};
  }

  bool accumulates() const override { return true; }

  size_t scratch_bytes(int num_threads) const override {
    const int threads = std::max(num_threads, 1);
    auto gemm_bytes = [&](const GemmShape& s) {
      return bf16_ ? gemm_bf16_scratch_bytes(s, threads) : gemm_f32_scratch_bytes(s, threads);
    };
    return layout(threads).gemm +
           std::max({gemm_bytes(logits_shape_), gemm_bytes(dx_shape_), gemm_bytes(dw_shape_)});
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const int threads = std::max(ctx.num_threads, 1);
    const Layout l = layout(threads);
    char* scratch = static_cast<char*>(args.scratch);
    auto* rows = reinterpret_cast<int64_t*>(scratch + l.rows);
    auto* logits = reinterpret_cast<float*>(scratch + l.logits);
    char* x_chunk = scratch + l.x_chunk;
    auto* dx_chunk = reinterpret_cast<float*>(scratch + l.dx_chunk);
    auto* bias_partial = reinterpret_cast<float*>(scratch + l.bias_sums);
    void* gemm_scratch = scratch + l.gemm;

    const size_t at = weight_grad_ ? 1 : 0;
    const char* x = static_cast<const char*>(args.inputs[at].data());
    const void* w = args.inputs[at + 1].data();
    const void* targets = args.inputs[at + 2].data();
    const float* bias = has_bias_ ? static_cast<const float*>(args.inputs[bias_at_].data()) : nullptr;
    const int64_t count = cpu_basic::count_targets(weight_grad_ ? "LinearLogProbsWeightGrad" : "LinearLogProbs", name_,
                                                   targets, i64_, R_, V_, ignore_index_);
    for (int64_t r = 0, c = 0; r < R_; ++r)
      if (cpu_basic::load_target(targets, i64_, r) != ignore_index_) rows[c++] = r;

    // Outputs. Forward: log p, lse, [dx], [stats], every row written (ignored rows 0). Weight grad: dw, [dbias],
    // added into when they are a parameter's gradient buffer.
    const float* dlogp = weight_grad_ ? static_cast<const float*>(args.inputs[0].data()) : nullptr;
    const float* saved_lse = weight_grad_ ? static_cast<const float*>(args.inputs[4].data()) : nullptr;
    float* logp = weight_grad_ ? nullptr : static_cast<float*>(args.outputs[0].data());
    float* lse_out = weight_grad_ ? nullptr : static_cast<float*>(args.outputs[1].data());
    float* dx = input_grad_ ? static_cast<float*>(args.outputs[2].data()) : nullptr;
    float* stats = row_stats_out_ ? static_cast<float*>(args.outputs.back().data()) : nullptr;
    float* dw = weight_grad_ ? static_cast<float*>(args.outputs[0].data()) : nullptr;
    float* dbias = weight_grad_ && has_bias_ ? static_cast<float*>(args.outputs[1].data()) : nullptr;
    const bool add_dw = dw != nullptr && !args.accumulate.empty() && args.accumulate[0];
    const bool add_dbias = dbias != nullptr && args.accumulate.size() > 1 && args.accumulate[1];
    if (logp) std::fill(logp, logp + R_, 0.0f), std::fill(lse_out, lse_out + R_, 0.0f);
    if (dx) std::memset(dx, 0, static_cast<size_t>(R_ * K_) * sizeof(float));
    if (stats) std::fill(stats, stats + 3 * R_, 0.0f);
    if (dbias != nullptr && !add_dbias) std::fill(dbias, dbias + V_, 0.0f);
    if (count == 0) {
      if (dw != nullptr && !add_dw) std::memset(dw, 0, static_cast<size_t>(V_ * K_) * sizeof(float));
      return;
    }
    if (dbias) std::fill(bias_partial, bias_partial + threads * V_, 0.0f);
    const size_t x_row_bytes = static_cast<size_t>(K_) * (bf16_ ? 2 : 4);
    const int row_threads = cpu_basic::threads_for(m_ * V_, threads);
    const BiasEpilogue bias_epilogue{bias, add_rows_};
    const GemmEpilogue epilogue{&BiasEpilogue::apply, &bias_epilogue};
    const bool gradient = weight_grad_ || input_grad_;  // the chunk's logits become G

    for (int64_t begin = 0; begin < count; begin += m_) {
      const int64_t mc = std::min(m_, count - begin);
      for (int64_t i = 0; i < mc; ++i)
        std::memcpy(x_chunk + static_cast<size_t>(i) * x_row_bytes, x + rows[begin + i] * x_row_bytes, x_row_bytes);
      GemmShape s = logits_shape_;
      s.M = mc;
      gemm(s, x_chunk, w, 0.0f, logits, gemm_scratch, threads, bias ? &epilogue : nullptr);

      cpu_basic::parallel_for(mc, row_threads, [&](int64_t r0, int64_t r1, int t) {
        float* bias_sum = bias_partial + t * V_;
        for (int64_t i = r0; i < r1; ++i) {
          float* row = logits + i * V_;
          const int64_t r = rows[begin + i];
          const int64_t target = cpu_basic::load_target(targets, i64_, r);
          const float lse = weight_grad_ ? saved_lse[r] : row_lse_(row, V_);
          const float target_logit = row[target];
          if (!weight_grad_) {
            logp[r] = target_logit - lse;
            lse_out[r] = lse;
          }
          if (stats) {
            const cpu_basic::RowStats rs = row_stats_(row, V_, lse, target);
            float total = 0.0f;
            for (int64_t v = 0; v < V_; ++v) total += row[v];
            stats[r * 3] = rs.entropy;
            stats[r * 3 + 1] = rs.top1 ? 1.0f : 0.0f;
            stats[r * 3 + 2] = total / static_cast<float>(V_);
          }
          if (!gradient) continue;
          // G = scale · (onehot − softmax): scale 1 for the unit gradient, dlogp[r] for the weight gradient.
          const float scale = weight_grad_ ? dlogp[r] : 1.0f;
          softmax_grad_(row, row, V_, lse, -scale);
          row[target] = (1.0f - std::exp(target_logit - lse)) * scale;
          if (dbias)
            for (int64_t v = 0; v < V_; ++v) bias_sum[v] += row[v];
          if (bf16_) round_(reinterpret_cast<uint16_t*>(row), row, V_);  // over the row's first half
        }
      });
      if (input_grad_) {
        s = dx_shape_;
        s.M = mc;
        gemm(s, logits, w, 0.0f, dx_chunk, gemm_scratch, threads, nullptr);
        for (int64_t i = 0; i < mc; ++i)
          std::memcpy(dx + rows[begin + i] * K_, dx_chunk + i * K_, static_cast<size_t>(K_) * sizeof(float));
      }
      if (dw != nullptr) {
        s = dw_shape_;
        s.K = mc;
        gemm(s, logits, x_chunk, begin == 0 && !add_dw ? 0.0f : 1.0f, dw, gemm_scratch, threads, nullptr);
      }
    }
    if (dbias)
      for (int t = 0; t < threads; ++t)
        for (int64_t v = 0; v < V_; ++v) dbias[v] += bias_partial[t * V_ + v];
  }

 private:
  struct Layout {
    size_t rows, logits, x_chunk, dx_chunk, bias_sums, gemm;
  };

  Layout layout(int threads) const {
    Layout l{};
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t start = at;
      at += align_up(bytes);
      return start;
    };
    l.rows = take(static_cast<size_t>(R_) * sizeof(int64_t));
    l.logits = take(static_cast<size_t>(m_ * V_) * sizeof(float));
    l.x_chunk = take(static_cast<size_t>(m_ * K_) * (bf16_ ? 2 : 4));
    l.dx_chunk = take(input_grad_ ? static_cast<size_t>(m_ * K_) * sizeof(float) : 0);
    l.bias_sums = take(weight_grad_ && has_bias_ ? static_cast<size_t>(threads * V_) * sizeof(float) : 0);
    l.gemm = at;
    return l;
  }

  void gemm(const GemmShape& s, const void* a, const void* b, float beta, float* c, void* scratch, int threads,
            const GemmEpilogue* epilogue) const {
    if (bf16_)
      gemm_bf16(s, 1.0f, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), beta, c, scratch, threads,
                epilogue);
    else
      gemm_f32(s, 1.0f, static_cast<const float*>(a), static_cast<const float*>(b), beta, c, scratch, threads,
               epilogue);
  }

  std::string name_;
  size_t bias_at_ = 3;
  bool weight_grad_ = false, bf16_ = false, i64_ = true, has_bias_ = false, input_grad_ = false,
       row_stats_out_ = false;
  int64_t R_ = 0, K_ = 0, V_ = 0, m_ = 1, ignore_index_ = -100;
  GemmShape logits_shape_{}, dx_shape_{}, dw_shape_{};
  cpu_basic::RowLseFn row_lse_ = nullptr;
  cpu_basic::AddRowsFn add_rows_ = nullptr;  // the logits' bias
  cpu_basic::RowStatsFn row_stats_ = nullptr;
  cpu_basic::RowSoftmaxGradFn softmax_grad_ = nullptr;
  cpu_basic::RoundBf16Fn round_ = nullptr;
};

}  // namespace

std::unique_ptr<Kernel> make_cpu_linear_cross_entropy_kernel(const KernelCall& call) {
  if (call.op != OpKind::LinearCrossEntropy || call.inputs[1].shape[0] == 0) return nullptr;
  return std::make_unique<LinearCrossEntropyKernel>(call);
}

std::unique_ptr<Kernel> make_cpu_linear_log_probs_kernel(const KernelCall& call) {
  if (call.op != OpKind::LinearLogProbs && call.op != OpKind::LinearLogProbsWeightGrad) return nullptr;
  const size_t at = call.op == OpKind::LinearLogProbsWeightGrad ? 1 : 0;
  if (call.inputs[at + 1].shape[0] == 0) return nullptr;
  return std::make_unique<LinearLogProbsKernel>(call);
}

}  // namespace fusetrain::kernels
