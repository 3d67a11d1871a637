// Reference scaled dot-product attention, forward and backward, one query row at
// a time. Scores, softmax denominators and every dot product are computed in
// double. Dropout on probability (b, h, t, s) uses element index
// ((b·H + h)·T + t)·S + s of the stream (seed, rng_offset), as docs/ops.md says.
//
// Shape letters: B batch, H heads, K key/value heads (H a multiple of K: grouped-query attention,
// query head h reads key/value head h / (H / K)), T query length, S key length, D head size.
//   q, out, dout, dq: (B, H, T, D)   k, v, dk, dv: (B, K, S, D)
//   lse: (B, H, T)                   mask: (B, S) or (B, H, S) additive (a bias per head: ALiBi), optional
//   key_begin: (B, T) i64, optional: query t of batch element b sees no key before key_begin[b, t] (packing)
//   bias: (B|1, H|1, T, S) f32 added to the scaled scores (score_bias, before the mask); its gradient dbias
//   (B, H, T, S) is the backward's fourth output
// With softcap c > 0 the scores scale·q·k become c·tanh(scale·q·k / c) before the mask is added (Gemma 2).
// With seq_major: q, out, dout, dq (B, T, H, D) and k, v, dk, dv (B, S, K, D).
#include <algorithm>
#include <cmath>

#include "kernels/ref/ref_kernels.h"
#include "kernels/rng.h"

namespace fusetrain::kernels::ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct AttentionDims {
  int64_t B = 0, H = 0, K = 0, T = 0, S = 0, D = 0;
  bool seq_major = false;
  double scale = 1.0;
  bool causal = false;
  int64_t window = 0;  // sliding window (causal only); 0: none
  double softcap = 0.0;  // scores c·tanh(s / c) before the mask; 0: none
  double dropout_p = 0.0;
  uint64_t seed = 0;
  int64_t rng_rows = 0, rng_row_start = 0;  // dropout draws the stream of rows [start, start + T) of rng_rows
  int64_t mask_heads = 1;  // 1: a (B, S) mask every head reads; H: a (B, H, S) one, a row per head
  ops::AttentionExtras extras;  // where the optional mask and key_begin inputs are
  int bias_at = -1;             // the score bias input (score_bias), or -1
  int64_t bias_batch = 1, bias_heads = 1;  // its extents along B and H (1: broadcast)
  const float* bias = nullptr;  // bound per run
  const int64_t* key_begin = nullptr;  // (B, T), bound per run; null: none
};

AttentionDims parse_attention(const KernelCall& call, size_t q_input) {
  const Shape& q = input_shape(call, q_input);
  const Shape& k = input_shape(call, q_input + 1);
  AttentionDims a;
  const ops::AttentionParams& params = call.params<ops::AttentionParams>();
  a.seq_major = params.seq_major;
  a.B = q[0];
  a.H = a.seq_major ? q[2] : q[1];
  a.T = a.seq_major ? q[1] : q[2];
  a.D = q[3];
  a.S = a.seq_major ? k[1] : k[2];
  a.K = a.seq_major ? k[2] : k[1];
  a.scale = params.scale;
  a.causal = params.causal;
  a.window = params.window;
  a.softcap = params.softcap;
  a.dropout_p = params.dropout_p;
  a.seed = params.seed;
  a.rng_rows = params.stream_rows(a.T);
  a.rng_row_start = params.rng_row_start;
  const size_t first = params.first_extra(q_input != 0);
  if (params.score_bias) {
    a.bias_at = static_cast<int>(params.bias_input(q_input != 0));
    a.bias_batch = call.inputs[size_t(a.bias_at)].shape[0];
    a.bias_heads = call.inputs[size_t(a.bias_at)].shape[1];
  }
  a.extras = ops::AttentionExtras::locate(call.inputs.size(), first,
                                          call.inputs.size() > first && input_dtype(call, first) == DType::i64);
  if (a.extras.mask >= 0 && call.inputs[size_t(a.extras.mask)].shape.rank() == 3)
    a.mask_heads = call.inputs[size_t(a.extras.mask)].shape[1];
  return a;
}

// Element offset of position t of query head (b, h) in a tensor of `len` positions (T or S).
int64_t row_at(const AttentionDims& a, int64_t b, int64_t h, int64_t t, int64_t len) {
  return a.seq_major ? ((b * len + t) * a.H + h) * a.D : ((b * a.H + h) * len + t) * a.D;
}

// Element offset of key position s of the key/value head that query head (b, h) reads.
int64_t kv_row_at(const AttentionDims& a, int64_t b, int64_t h, int64_t s) {
  const int64_t kh = h / (a.H / a.K);
  return a.seq_major ? ((b * a.S + s) * a.K + kh) * a.D : ((b * a.K + kh) * a.S + s) * a.D;
}

// Query t sees key s unless causal and s > t + S − T, or a sliding window leaves it out: s <= t + S − T − window,
// or s is before the query's key_begin (another packed example's key).
bool key_allowed(const AttentionDims& a, int64_t b, int64_t t, int64_t s) {
  const int64_t age = t + a.S - a.T - s;  // how many keys newer than s the query has seen
  if (a.key_begin != nullptr && s < a.key_begin[b * a.T + t]) return false;
  return !a.causal || (age >= 0 && (a.window == 0 || age < a.window));
}

// scores (S) for query row t of head (b, h): scale·q·k (soft-capped) + mask[b, s] on allowed
// keys, −inf on the others. Returns the maximum (−inf if no key counts). With a softcap and `capped_grad`, also
// the cap's derivative 1 − tanh² per key (S).
double attention_scores(double* scores, const float* q_row, const float* k, const float* mask,
                        const AttentionDims& a, int64_t b, int64_t h, int64_t t, double* capped_grad = nullptr) {
  double max = kNegInf;
  for (int64_t s = 0; s < a.S; ++s) {
    if (!key_allowed(a, b, t, s)) {
      scores[s] = kNegInf;
      continue;
    }
    double dot = 0.0;
    const float* k_row = k + kv_row_at(a, b, h, s);
    for (int64_t d = 0; d < a.D; ++d) dot += static_cast<double>(q_row[d]) * k_row[d];
    const int64_t row = a.mask_heads > 1 ? b * a.H + h : b;
    double score = a.scale * dot;
    if (a.softcap > 0.0) {
      const double th = std::tanh(score / a.softcap);
      score = a.softcap * th;
      if (capped_grad) capped_grad[s] = 1.0 - th * th;
    }
    if (a.bias)
      score += a.bias[(((a.bias_batch > 1 ? b : 0) * a.bias_heads + (a.bias_heads > 1 ? h : 0)) * a.T + t) * a.S + s];
    scores[s] = score + (mask != nullptr ? static_cast<double>(mask[row * a.S + s]) : 0.0);
    max = std::max(max, scores[s]);
  }
  return max;
}

// The dropout factor of probability (b, h, t, s): 1/(1−p) if kept, 0 if dropped.
double dropout_factor(const AttentionDims& a, uint64_t rng_offset, int64_t b, int64_t h, int64_t t, int64_t s) {
  if (a.dropout_p == 0.0) return 1.0;
  const uint64_t index = static_cast<uint64_t>(((b * a.H + h) * a.rng_rows + a.rng_row_start + t) * a.S + s);
  return dropout_keep(a.seed, rng_offset, index, static_cast<float>(a.dropout_p)) ? 1.0 / (1.0 - a.dropout_p) : 0.0;
}

// out = dropout(softmax(scale·q·kᵀ + mask)) · v;  lse = log Σ_s exp(scores) over allowed keys.
// A row with no allowed key (or only −inf scores) has no softmax: its output is 0
// and its lse is stored as 0 (not −inf), so backward recomputes all-zero
// probabilities for it. probs: S doubles of scratch.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const float* mask,
                       const AttentionDims& a, uint64_t rng_offset, const bool accumulate[2], double* probs) {
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t head = b * a.H + h;
      for (int64_t t = 0; t < a.T; ++t) {
        const int64_t row = head * a.T + t;  // of lse
        const int64_t q_at = row_at(a, b, h, t, a.T);
        const double max = attention_scores(probs, q + q_at, k, mask, a, b, h, t);
        double row_lse = 0.0;
        if (max == kNegInf) {
          for (int64_t s = 0; s < a.S; ++s) probs[s] = 0.0;
        } else {
          double sum = 0.0;
          for (int64_t s = 0; s < a.S; ++s) sum += std::exp(probs[s] - max);
          row_lse = max + std::log(sum);
          for (int64_t s = 0; s < a.S; ++s)
            probs[s] = std::exp(probs[s] - row_lse) * dropout_factor(a, rng_offset, b, h, t, s);
        }
        store(lse, DType::f32, row, row_lse, accumulate[1]);
        for (int64_t d = 0; d < a.D; ++d) {
          double sum = 0.0;
          for (int64_t s = 0; s < a.S; ++s) sum += probs[s] * v[kv_row_at(a, b, h, s) + d];
          store(out, DType::f32, q_at + d, sum, accumulate[0]);
        }
      }
    }
}

// With P = exp(scores − lse) (recomputed from the saved lse), m the dropout
// factor (keep/(1−p)) and Pd = P·m the probabilities the forward pass used:
//   dV = Pdᵀ·dO
//   dPd = (dO·Vᵀ)·m                         (gradient w.r.t. P through dropout)
//   dS = P ⊙ (dPd − Σ_s P·dPd)              (Σ_s P·dPd equals rowsum(dO ⊙ out))
//   dS ⊙= 1 − tanh²(scale·q·k / c)          (with a softcap c)
//   dQ = scale·dS·K,  dK = scale·dSᵀ·Q,  dbias = dS (with a score bias)
// Scratch: probs, dprobs_dropped, probs_dropped, capped_grad (S each), dk_sum, dv_sum (S·D each).
void attention_backward(float* dq, float* dk, float* dv, float* dbias, const float* dout, const float* q, const float* k,
                        const float* v, const float* lse, const float* mask, const AttentionDims& a,
                        uint64_t rng_offset, const bool accumulate[4], double* scratch) {
  double* probs = scratch;
  double* probs_dropped = probs + a.S;
  double* dprobs_dropped = probs_dropped + a.S;
  double* capped_grad = dprobs_dropped + a.S;
  double* dk_sum = capped_grad + a.S;
  double* dv_sum = dk_sum + a.S * a.D;
  const int64_t group = a.H / a.K;  // query heads per key/value head; their dk, dv contributions add up
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t head = b * a.H + h;
      if (h % group == 0)
        for (int64_t e = 0; e < a.S * a.D; ++e) dk_sum[e] = dv_sum[e] = 0.0;
      for (int64_t t = 0; t < a.T; ++t) {
        const int64_t row = head * a.T + t;  // of lse
        const int64_t q_at = row_at(a, b, h, t, a.T);
        const float* q_row = q + q_at;
        const float* dout_row = dout + q_at;
        attention_scores(probs, q_row, k, mask, a, b, h, t, capped_grad);
        double row_term = 0.0;  // Σ_s P·dPd
        for (int64_t s = 0; s < a.S; ++s) {
          const double factor = dropout_factor(a, rng_offset, b, h, t, s);
          probs[s] = probs[s] == kNegInf ? 0.0 : std::exp(probs[s] - static_cast<double>(lse[row]));
          probs_dropped[s] = probs[s] * factor;
          double dot = 0.0;  // (dO·Vᵀ)[t, s]
          const float* v_row = v + kv_row_at(a, b, h, s);
          for (int64_t d = 0; d < a.D; ++d) dot += static_cast<double>(dout_row[d]) * v_row[d];
          dprobs_dropped[s] = dot * factor;
          row_term += probs[s] * dprobs_dropped[s];
        }
        for (int64_t s = 0; s < a.S; ++s) {
          double dscore = probs[s] * (dprobs_dropped[s] - row_term);
          if (a.softcap > 0.0 && probs[s] != 0.0) dscore *= capped_grad[s];
          if (dbias) store(dbias, DType::f32, (head * a.T + t) * a.S + s, dscore, accumulate[3]);
          for (int64_t d = 0; d < a.D; ++d) {
            dv_sum[s * a.D + d] += probs_dropped[s] * dout_row[d];
            dk_sum[s * a.D + d] += a.scale * dscore * q_row[d];
          }
          probs[s] = dscore;  // probs now holds dS for the dQ loop below
        }
        for (int64_t d = 0; d < a.D; ++d) {
          double sum = 0.0;
          for (int64_t s = 0; s < a.S; ++s) sum += probs[s] * k[kv_row_at(a, b, h, s) + d];
          store(dq, DType::f32, q_at + d, a.scale * sum, accumulate[0]);
        }
      }
      if (h % group != group - 1) continue;
      for (int64_t s = 0; s < a.S; ++s)
        for (int64_t d = 0; d < a.D; ++d) {
          store(dk, DType::f32, kv_row_at(a, b, h, s) + d, dk_sum[s * a.D + d], accumulate[1]);
          store(dv, DType::f32, kv_row_at(a, b, h, s) + d, dv_sum[s * a.D + d], accumulate[2]);
        }
    }
}

// q, k, v (and out) may be bf16: they are widened into f32 scratch first (exactly), and a bf16
// out is computed in f32 scratch and rounded once when stored.
const float* as_f32(const Tensor& t, float* scratch) {
  if (t.dtype() == DType::f32) return t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) scratch[i] = static_cast<float>(load(t.data(), t.dtype(), i));
  return scratch;
}

size_t widened_floats(const KernelCall& call, size_t first, size_t count) {
  size_t floats = 0;
  for (size_t i = first; i < first + count; ++i)
    if (input_dtype(call, i) != DType::f32) floats += static_cast<size_t>(input_shape(call, i).numel());
  return floats;
}

// The key_begin input of this run, or null; its values checked (the kernel indexes keys with them).
const int64_t* key_begin_of(const KernelArgs& args, const AttentionDims& a) {
  if (a.extras.key_begin < 0) return nullptr;
  const int64_t* begin = args.inputs[size_t(a.extras.key_begin)].data_as<int64_t>();
  ops::check_key_begin(begin, a.B, a.T, a.S);
  return begin;
}

class AttentionRef final : public RefKernel {
 public:
  AttentionRef(const KernelCall& call)
      : dims_(parse_attention(call, 0)),
        widened_(widened_floats(call, 0, 3)),
        out_bf16_(output_dtype(call, 0) == DType::bf16),
        out_numel_(output_shape(call, 0).numel()) {}

  size_t scratch_bytes(int) const override {
    return static_cast<size_t>(dims_.S) * sizeof(double) +
           (widened_ + (out_bf16_ ? static_cast<size_t>(out_numel_) : 0)) * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const bool acc[2] = {accumulate_flag(args, 0) && !out_bf16_, accumulate_flag(args, 1)};
    // inputs: q, k, v, [mask]; outputs: out, lse
    const float* mask = dims_.extras.mask >= 0 ? args.inputs[size_t(dims_.extras.mask)].data_as<float>() : nullptr;
    dims_.key_begin = key_begin_of(args, dims_);
    dims_.bias = dims_.bias_at >= 0 ? args.inputs[size_t(dims_.bias_at)].data_as<float>() : nullptr;
    double* probs = static_cast<double*>(args.scratch);
    float* floats = reinterpret_cast<float*>(probs + dims_.S);
    const float* qkv[3];
    for (size_t i = 0; i < 3; ++i) {
      qkv[i] = as_f32(args.inputs[i], floats);
      if (qkv[i] == floats) floats += args.inputs[i].numel();
    }
    float* out = out_bf16_ ? floats : args.outputs[0].data_as<float>();
    attention_forward(out, args.outputs[1].data_as<float>(), qkv[0], qkv[1], qkv[2], mask, dims_, ctx.rng_offset, acc,
                      probs);
    if (out_bf16_)
      for (int64_t i = 0; i < out_numel_; ++i)
        store(args.outputs[0].data(), DType::bf16, i, out[i], accumulate_flag(args, 0));
  }

 private:
  AttentionDims dims_;
  size_t widened_;
  bool out_bf16_;
  int64_t out_numel_;
};

class AttentionBackwardRef final : public RefKernel {
 public:
  AttentionBackwardRef(const KernelCall& call)
      : dims_(parse_attention(call, 1)), widened_(widened_floats(call, 1, 3)) {}

  size_t scratch_bytes(int) const override {
    return static_cast<size_t>(4 * dims_.S + 2 * dims_.S * dims_.D) * sizeof(double) + widened_ * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const bool acc[4] = {accumulate_flag(args, 0), accumulate_flag(args, 1), accumulate_flag(args, 2),
                         dims_.bias_at >= 0 && accumulate_flag(args, 3)};
    // inputs: dout, q, k, v, out, lse, [bias], [mask]; outputs: dq, dk, dv, [dbias]. `out` is not
    // needed: the row term Σ_s P·dPd is computed directly.
    const float* mask = dims_.extras.mask >= 0 ? args.inputs[size_t(dims_.extras.mask)].data_as<float>() : nullptr;
    dims_.key_begin = key_begin_of(args, dims_);
    dims_.bias = dims_.bias_at >= 0 ? args.inputs[size_t(dims_.bias_at)].data_as<float>() : nullptr;
    double* work = static_cast<double*>(args.scratch);
    float* floats = reinterpret_cast<float*>(work + 4 * dims_.S + 2 * dims_.S * dims_.D);
    const float* qkv[3];
    for (size_t i = 0; i < 3; ++i) {
      qkv[i] = as_f32(args.inputs[i + 1], floats);
      if (qkv[i] == floats) floats += args.inputs[i + 1].numel();
    }
    attention_backward(args.outputs[0].data_as<float>(), args.outputs[1].data_as<float>(),
                       args.outputs[2].data_as<float>(), dims_.bias ? args.outputs[3].data_as<float>() : nullptr,
                       args.inputs[0].data_as<float>(), qkv[0], qkv[1], qkv[2],
                       args.inputs[5].data_as<float>(), mask, dims_, ctx.rng_offset, acc, work);
  }

 private:
  AttentionDims dims_;
  size_t widened_;
};

}  // namespace

std::unique_ptr<Kernel> make_attention_ref(const KernelCall& call) {
  return std::make_unique<AttentionRef>(call);
}

std::unique_ptr<Kernel> make_attention_backward_ref(const KernelCall& call) {
  return std::make_unique<AttentionBackwardRef>(call);
}

}  // namespace fusetrain::kernels::ref
