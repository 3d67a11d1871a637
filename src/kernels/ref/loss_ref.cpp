// Reference SoftmaxCrossEntropy and its backward. Row log-sum-exps and the
// loss sum are computed in double.
//
// Shape letters: R rows (product of all leading axes), V vocabulary.
#include <algorithm>
#include <cmath>

#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

// Reads target r and checks it is ignore_index or lies in [0, V).
int64_t checked_target(const void* targets, DType dtype, int64_t r, int64_t V, int64_t ignore_index,
                       const std::string& label) {
  const int64_t t = load_index(targets, dtype, r);
  if (t != ignore_index && (t < 0 || t >= V))
    throw Error(str(label, ": target ", t, " at row ", r, " is outside the vocabulary [0, ", V,
                    ") and is not ignore_index ", ignore_index));
  return t;
}

// loss () = mean over rows with target ≠ ignore_index of lse − logits[target] (0 if none);
// lse (R) = log Σ_v exp(logits (R, V)) for every row, ignored or not.
void cross_entropy_forward(float* loss, float* lse, const float* logits, const void* targets, DType targets_dtype,
                           int64_t R, int64_t V, int64_t ignore_index, const bool accumulate[2],
                           const std::string& label) {
  double loss_sum = 0.0;
  int64_t count = 0;
  for (int64_t r = 0; r < R; ++r) {
    const float* row = logits + r * V;
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) max = std::max(max, static_cast<double>(row[v]));
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
    const double row_lse = max + std::log(sum);
    store(lse, DType::f32, r, row_lse, accumulate[1]);
    const int64_t t = checked_target(targets, targets_dtype, r, V, ignore_index, label);
    if (t == ignore_index) continue;
    loss_sum += row_lse - row[t];
    ++count;
  }
  store(loss, DType::f32, 0, count > 0 ? loss_sum / static_cast<double>(count) : 0.0, accumulate[0]);
}

// dlogits (R, V) = dloss · (exp(logits − lse) − onehot(target)) / count on counted
// rows, 0 on ignored rows; count = number of rows with target ≠ ignore_index.
void cross_entropy_backward(float* dlogits, float dloss, const float* logits, const void* targets, DType targets_dtype,
                            const float* lse, int64_t R, int64_t V, int64_t ignore_index, bool accumulate,
                            const std::string& label) {
  int64_t count = 0;
  for (int64_t r = 0; r < R; ++r)
    if (checked_target(targets, targets_dtype, r, V, ignore_index, label) != ignore_index) ++count;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = load_index(targets, targets_dtype, r);
    const bool counted = t != ignore_index;
    for (int64_t v = 0; v < V; ++v) {
      double d = 0.0;
      if (counted) {
        double p = std::exp(static_cast<double>(logits[r * V + v]) - lse[r]);
        d = static_cast<double>(dloss) * (p - (v == t ? 1.0 : 0.0)) / static_cast<double>(count);
      }
      store(dlogits, DType::f32, r * V + v, d, accumulate);
    }
  }
}

class CrossEntropyRef final : public RefKernel {
 public:
  CrossEntropyRef(const KernelCall& call)
      : label_(node_label(call)),
        targets_dtype_(input_dtype(call, 1)),
        ignore_index_(call.params<ops::CrossEntropyParams>().ignore_index) {
    const Shape& logits = input_shape(call, 0);
    V_ = logits[-1];
    R_ = logits.numel(0, logits.rank() - 1);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const bool acc[2] = {accumulate_flag(args, 0), accumulate_flag(args, 1)};
    // inputs: logits, targets; outputs: loss, lse
    cross_entropy_forward(args.outputs[0].data_as<float>(), args.outputs[1].data_as<float>(),
                          args.inputs[0].data_as<float>(), args.inputs[1].data(), targets_dtype_, R_, V_, ignore_index_,
                          acc, label_);
  }

 private:
  std::string label_;
  DType targets_dtype_;
  int64_t ignore_index_;
  int64_t R_ = 0, V_ = 0;
};

class CrossEntropyBackwardRef final : public RefKernel {
 public:
  CrossEntropyBackwardRef(const KernelCall& call)
      : label_(node_label(call)),
        targets_dtype_(input_dtype(call, 2)),
        ignore_index_(call.params<ops::CrossEntropyParams>().ignore_index) {
    const Shape& logits = input_shape(call, 1);
    V_ = logits[-1];
    R_ = logits.numel(0, logits.rank() - 1);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    // inputs: dloss, logits, targets, lse; output: dlogits
    cross_entropy_backward(args.outputs[0].data_as<float>(), args.inputs[0].data_as<float>()[0],
                           args.inputs[1].data_as<float>(), args.inputs[2].data(), targets_dtype_,
                           args.inputs[3].data_as<float>(), R_, V_, ignore_index_, accumulate_flag(args, 0), label_);
  }

 private:
  std::string label_;
  DType targets_dtype_;
  int64_t ignore_index_;
  int64_t R_ = 0, V_ = 0;
};

// LinearCrossEntropy: logits = x · wᵀ (+ bias) in double, then the loss of SoftmaxCrossEntropy and
// d(loss)/d(x, w, bias) for a unit upstream gradient. With bf16 x and w, d(logits) is rounded to
// bf16 before the products, as the unfused backward rounds it.
// One counted row's share of the token statistics: its entropy lse − Σ p·z, whether the target is its first
// largest logit, and the row itself.
void add_token_stats(const double* logits, int64_t V, double lse, int64_t target, double stats[3]) {
  double expected = 0.0;
  for (int64_t v = 0; v < V; ++v) expected += std::exp(logits[v] - lse) * logits[v];
  stats[0] += lse - expected;
  bool top1 = true;
  for (int64_t v = 0; v < V && top1; ++v)
    top1 = v < target ? logits[v] < logits[target] : logits[v] <= logits[target];
  stats[1] += top1 ? 1.0 : 0.0;
  stats[2] += 1.0;
}

class LinearCrossEntropyRef final : public RefKernel {
 public:
  LinearCrossEntropyRef(const KernelCall& call)
      : label_(node_label(call)),
        x_dtype_(input_dtype(call, 0)),
        targets_dtype_(input_dtype(call, 2)),
        ignore_index_(call.params<ops::LinearCrossEntropyParams>().ignore_index),
        has_bias_(call.inputs.size() == 4),
        weight_grad_(call.params<ops::LinearCrossEntropyParams>().weight_grad),
        token_stats_(call.params<ops::LinearCrossEntropyParams>().token_stats) {
    const Shape& x = input_shape(call, 0);
    K_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
    V_ = input_shape(call, 1)[0];
  }

  size_t scratch_bytes(int) const override {
    return static_cast<size_t>(R_ * K_ + V_ * K_ + 2 * V_) * sizeof(double);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    const void* w = args.inputs[1].data();
    const void* targets = args.inputs[2].data();
    int64_t count = 0;
    for (int64_t r = 0; r < R_; ++r)
      if (checked_target(targets, targets_dtype_, r, V_, ignore_index_, label_) != ignore_index_) ++count;
    // Sums in double, in scratch: dx (R, K), dw (V, K), dbias (V), one row of logits (V).
    double* dx = static_cast<double*>(args.scratch);
    double* dw = dx + R_ * K_;
    double* dbias = dw + V_ * K_;
    double* logits = dbias + V_;
    std::fill(dx, logits, 0.0);
    double loss_sum = 0.0, stats[3] = {0.0, 0.0, 0.0};
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t t = load_index(targets, targets_dtype_, r);
      if (t == ignore_index_) continue;
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t v = 0; v < V_; ++v) {
        double z = has_bias_ ? load(args.inputs[3].data(), DType::f32, v) : 0.0;
        for (int64_t k = 0; k < K_; ++k) z += load(x, x_dtype_, r * K_ + k) * load(w, x_dtype_, v * K_ + k);
        logits[v] = z;
        max = std::max(max, z);
      }
      double sum = 0.0;
      for (int64_t v = 0; v < V_; ++v) sum += std::exp(logits[v] - max);
      const double lse = max + std::log(sum);
      loss_sum += lse - logits[t];
      add_token_stats(logits, V_, lse, t, stats);
      for (int64_t v = 0; v < V_; ++v) {
        const double d = (std::exp(logits[v] - lse) - (v == t ? 1.0 : 0.0)) / count;
        dbias[v] += d;
        const double dg = x_dtype_ == DType::bf16 ? bf16_to_float(float_to_bf16(static_cast<float>(d))) : d;
        for (int64_t k = 0; k < K_; ++k) {
          dx[r * K_ + k] += dg * load(w, x_dtype_, v * K_ + k);
          dw[v * K_ + k] += dg * load(x, x_dtype_, r * K_ + k);
        }
      }
    }
    store(args.outputs[0].data(), DType::f32, 0, count > 0 ? loss_sum / static_cast<double>(count) : 0.0,
          accumulate_flag(args, 0));
    for (int64_t i = 0; i < R_ * K_; ++i) store(args.outputs[1].data(), DType::f32, i, dx[i], accumulate_flag(args, 1));
    if (token_stats_) {
      const size_t at = args.outputs.size() - 1;
      for (int64_t i = 0; i < 3; ++i) store(args.outputs[at].data(), DType::f32, i, stats[i], accumulate_flag(args, at));
    }
    if (!weight_grad_) return;
    for (int64_t i = 0; i < V_ * K_; ++i) store(args.outputs[2].data(), DType::f32, i, dw[i], accumulate_flag(args, 2));
    for (int64_t i = 0; i < V_; ++i)
      store(args.outputs[3].data(), DType::f32, i, has_bias_ ? dbias[i] : 0.0, accumulate_flag(args, 3));
  }

 private:
  std::string label_;
  DType x_dtype_, targets_dtype_;
  int64_t ignore_index_;
  bool has_bias_, weight_grad_, token_stats_;
  int64_t R_ = 0, K_ = 0, V_ = 0;
};

// TokenStats: over the rows whose target counts, in double: Σ entropy, top-1 hits, rows (add_token_stats).
class TokenStatsRef final : public RefKernel {
 public:
  TokenStatsRef(const KernelCall& call)
      : label_(node_label(call)),
        targets_dtype_(input_dtype(call, 1)),
        ignore_index_(call.params<ops::CrossEntropyParams>().ignore_index) {
    const Shape& logits = input_shape(call, 0);
    V_ = logits[-1];
    R_ = logits.numel() / std::max<int64_t>(V_, 1);
  }
  size_t scratch_bytes(int) const override { return static_cast<size_t>(V_) * sizeof(double); }
  void run(const KernelArgs& args, const StepContext&) override {
    double* row = static_cast<double*>(args.scratch);
    double stats[3] = {0.0, 0.0, 0.0};
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t t = checked_target(args.inputs[1].data(), targets_dtype_, r, V_, ignore_index_, label_);
      if (t == ignore_index_) continue;
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t v = 0; v < V_; ++v) max = std::max(max, row[v] = load(args.inputs[0].data(), DType::f32, r * V_ + v));
      double sum = 0.0;
      for (int64_t v = 0; v < V_; ++v) sum += std::exp(row[v] - max);
      add_token_stats(row, V_, max + std::log(sum), t, stats);
    }
    for (int64_t i = 0; i < 3; ++i) store(args.outputs[0].data(), DType::f32, i, stats[i], accumulate_flag(args, 0));
  }

 private:
  std::string label_;
  DType targets_dtype_;
  int64_t ignore_index_;
  int64_t R_ = 0, V_ = 0;
};

// Row r of logits (V), in double, and its log-sum-exp.
double load_row(const void* logits, int64_t r, int64_t V, double* row) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < V; ++v) max = std::max(max, row[v] = load(logits, DType::f32, r * V + v));
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
  return max + std::log(sum);
}

// A row's statistics as TokenLogProbs and LinearLogProbs write them: entropy, top-1 hit, mean logit.
void row_statistics(const double* logits, int64_t V, double lse, int64_t target, double out[3]) {
  double stats[3] = {0.0, 0.0, 0.0};
  add_token_stats(logits, V, lse, target, stats);
  double total = 0.0;
  for (int64_t v = 0; v < V; ++v) total += logits[v];
  out[0] = stats[0];
  out[1] = stats[1];
  out[2] = total / static_cast<double>(V);
}

// TokenLogProbs: logp (R) = logits[target] − lse per row (0 where ignored), and with row_stats (R, 3).
class TokenLogProbsRef final : public RefKernel {
 public:
  TokenLogProbsRef(const KernelCall& call)
      : label_(node_label(call)),
        targets_dtype_(input_dtype(call, 1)),
        ignore_index_(call.params<ops::LogProbsParams>().ignore_index),
        row_stats_(call.params<ops::LogProbsParams>().row_stats) {
    V_ = input_shape(call, 0)[-1];
    R_ = input_shape(call, 0).numel() / std::max<int64_t>(V_, 1);
  }
  size_t scratch_bytes(int) const override { return static_cast<size_t>(V_) * sizeof(double); }
  void run(const KernelArgs& args, const StepContext&) override {
    double* row = static_cast<double*>(args.scratch);
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t t = checked_target(args.inputs[1].data(), targets_dtype_, r, V_, ignore_index_, label_);
      double logp = 0.0, stats[3] = {0.0, 0.0, 0.0};
      if (t != ignore_index_) {
        const double lse = load_row(args.inputs[0].data(), r, V_, row);
        logp = row[t] - lse;
        row_statistics(row, V_, lse, t, stats);
      }
      store(args.outputs[0].data(), DType::f32, r, logp, accumulate_flag(args, 0));
      if (row_stats_)
        for (int64_t i = 0; i < 3; ++i) store(args.outputs[1].data(), DType::f32, r * 3 + i, stats[i], accumulate_flag(args, 1));
    }
  }

 private:
  std::string label_;
  DType targets_dtype_;
  int64_t ignore_index_;
  bool row_stats_;
  int64_t R_ = 0, V_ = 0;
};

// TokenLogProbsBackward: dlogits (R, V) = dlogp[r] · (onehot(target) − softmax) on counted rows, 0 on ignored ones.
class TokenLogProbsBackwardRef final : public RefKernel {
 public:
  TokenLogProbsBackwardRef(const KernelCall& call)
      : label_(node_label(call)),
        targets_dtype_(input_dtype(call, 2)),
        ignore_index_(call.params<ops::LogProbsParams>().ignore_index) {
    V_ = input_shape(call, 1)[-1];
    R_ = input_shape(call, 1).numel() / std::max<int64_t>(V_, 1);
  }
  size_t scratch_bytes(int) const override { return static_cast<size_t>(V_) * sizeof(double); }
  void run(const KernelArgs& args, const StepContext&) override {
    double* row = static_cast<double*>(args.scratch);
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t t = checked_target(args.inputs[2].data(), targets_dtype_, r, V_, ignore_index_, label_);
      const double g = load(args.inputs[0].data(), DType::f32, r);
      const double lse = t != ignore_index_ ? load_row(args.inputs[1].data(), r, V_, row) : 0.0;
      for (int64_t v = 0; v < V_; ++v) {
        const double d = t == ignore_index_ ? 0.0 : g * ((v == t ? 1.0 : 0.0) - std::exp(row[v] - lse));
        store(args.outputs[0].data(), DType::f32, r * V_ + v, d, accumulate_flag(args, 0));
      }
    }
  }

 private:
  std::string label_;
  DType targets_dtype_;
  int64_t ignore_index_;
  int64_t R_ = 0, V_ = 0;
};

// LinearLogProbs and LinearLogProbsWeightGrad: the logits of row r are x[r]·wᵀ + bias, computed in double; a row's
// gradient of its log-probability, onehot − softmax, is rounded to bf16 before the products for bf16 operands (as
// the unfused backward rounds d(logits)).
class LinearLogProbsRef final : public RefKernel {
 public:
  LinearLogProbsRef(const KernelCall& call)
      : label_(node_label(call)),
        weight_grad_(call.op == OpKind::LinearLogProbsWeightGrad),
        params_(call.params<ops::LogProbsParams>()) {
    const size_t at = weight_grad_ ? 1 : 0;
    x_dtype_ = input_dtype(call, at);
    targets_dtype_ = input_dtype(call, at + 2);
    bias_at_ = weight_grad_ ? 5 : 3;  // after lse for the weight gradient
    has_bias_ = call.inputs.size() == bias_at_ + 1;
    const Shape& x = input_shape(call, at);
    K_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
    V_ = input_shape(call, at + 1)[0];
  }

  size_t scratch_bytes(int) const override {
    return static_cast<size_t>(V_ + (weight_grad_ ? V_ * K_ + V_ : K_)) * sizeof(double);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const size_t at = weight_grad_ ? 1 : 0;
    const void* x = args.inputs[at].data();
    const void* w = args.inputs[at + 1].data();
    const void* targets = args.inputs[at + 2].data();
    double* logits = static_cast<double*>(args.scratch);
    double* acc = logits + V_;  // (K) dx of a row, or (V, K) dw then (V) dbias
    if (weight_grad_) std::fill(acc, acc + V_ * K_ + V_, 0.0);
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t t = checked_target(targets, targets_dtype_, r, V_, params_.ignore_index, label_);
      const bool counted = t != params_.ignore_index;
      double lse = 0.0;
      if (counted) {
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t v = 0; v < V_; ++v) {
          double z = has_bias_ ? load(args.inputs[bias_at_].data(), DType::f32, v) : 0.0;
          for (int64_t k = 0; k < K_; ++k) z += load(x, x_dtype_, r * K_ + k) * load(w, x_dtype_, v * K_ + k);
          logits[v] = z;
          max = std::max(max, z);
        }
        double sum = 0.0;
        for (int64_t v = 0; v < V_; ++v) sum += std::exp(logits[v] - max);
        lse = max + std::log(sum);
      }
      if (weight_grad_) {
        if (!counted) continue;
        const double g = load(args.inputs[0].data(), DType::f32, r);
        // The forward's lse (input 4), as the fast kernel reads it; equal to this one up to f32 rounding.
        const double saved_lse = load(args.inputs[4].data(), DType::f32, r);
        for (int64_t v = 0; v < V_; ++v) {
          const double d = g * ((v == t ? 1.0 : 0.0) - std::exp(logits[v] - saved_lse));
          acc[V_ * K_ + v] += d;
          const double dg = rounded(d);
          for (int64_t k = 0; k < K_; ++k) acc[v * K_ + k] += dg * load(x, x_dtype_, r * K_ + k);
        }
        continue;
      }
      store(args.outputs[0].data(), DType::f32, r, counted ? logits[t] - lse : 0.0, accumulate_flag(args, 0));
      store(args.outputs[1].data(), DType::f32, r, lse, accumulate_flag(args, 1));
      size_t out = 2;
      if (params_.input_grad) {
        std::fill(acc, acc + K_, 0.0);
        if (counted)
          for (int64_t v = 0; v < V_; ++v) {
            const double dg = rounded((v == t ? 1.0 : 0.0) - std::exp(logits[v] - lse));
            for (int64_t k = 0; k < K_; ++k) acc[k] += dg * load(w, x_dtype_, v * K_ + k);
          }
        for (int64_t k = 0; k < K_; ++k) store(args.outputs[out].data(), DType::f32, r * K_ + k, acc[k], accumulate_flag(args, out));
        ++out;
      }
      if (params_.row_stats) {
        double stats[3] = {0.0, 0.0, 0.0};
        if (counted) row_statistics(logits, V_, lse, t, stats);
        for (int64_t i = 0; i < 3; ++i) store(args.outputs[out].data(), DType::f32, r * 3 + i, stats[i], accumulate_flag(args, out));
      }
    }
    if (!weight_grad_) return;
    for (int64_t i = 0; i < V_ * K_; ++i) store(args.outputs[0].data(), DType::f32, i, acc[i], accumulate_flag(args, 0));
    if (has_bias_)
      for (int64_t v = 0; v < V_; ++v) store(args.outputs[1].data(), DType::f32, v, acc[V_ * K_ + v], accumulate_flag(args, 1));
  }

 private:
  double rounded(double d) const {
    return x_dtype_ == DType::bf16 ? bf16_to_float(float_to_bf16(static_cast<float>(d))) : d;
  }

  std::string label_;
  bool weight_grad_;
  ops::LogProbsParams params_;
  DType x_dtype_ = DType::f32, targets_dtype_ = DType::i64;
  size_t bias_at_ = 3;
  bool has_bias_ = false;
  int64_t R_ = 0, K_ = 0, V_ = 0;
};

// PreferenceLoss and its backward, in double. Pair i (of P) has chosen sequence i and rejected sequence P + i; its
// margin is δ = (c − c_ref) − (r − r_ref). Per pair: sigmoid −log σ(βδ), hinge max(0, 1 − βδ), ipo
// (δ_c / n_c − δ_r / n_r − 1/(2β))² with each log-ratio averaged over its completion tokens (n at least 1), as TRL
// computes them; the loss is their mean.
class PreferenceLossRef final : public RefKernel {
 public:
  PreferenceLossRef(const KernelCall& call)
      : backward_(call.op == OpKind::PreferenceLossBackward), params_(call.params<ops::PreferenceParams>()) {
    P_ = input_shape(call, backward_ ? 1 : 0)[0] / 2;
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const size_t at = backward_ ? 1 : 0;
    auto in = [&](size_t i, int64_t j) { return load(args.inputs[at + i].data(), DType::f32, j); };
    const double beta = params_.beta;
    const double dloss = backward_ ? load(args.inputs[0].data(), DType::f32, 0) / static_cast<double>(P_) : 0.0;
    double total = 0.0;
    for (int64_t i = 0; i < P_; ++i) {
      const double chosen = in(0, i) - in(1, i), rejected = in(0, P_ + i) - in(1, P_ + i);
      double loss = 0.0, d_chosen = 0.0, d_rejected = 0.0;  // d(loss)/d(chosen and rejected log-probs)
      if (params_.loss_type == "ipo") {
        const double nc = std::max(in(2, i), 1.0), nr = std::max(in(2, P_ + i), 1.0);
        const double u = chosen / nc - rejected / nr - 1.0 / (2.0 * beta);
        loss = u * u;
        d_chosen = 2.0 * u / nc;
        d_rejected = -2.0 * u / nr;
      } else {
        const double z = beta * (chosen - rejected);
        double d_margin = 0.0;  // d(loss)/dδ
        if (params_.loss_type == "hinge") {
          loss = std::max(0.0, 1.0 - z);
          d_margin = 1.0 - z > 0.0 ? -beta : 0.0;
        } else {  // −log σ(z) = log(1 + e^−z), stable for both signs
          loss = std::max(-z, 0.0) + std::log1p(std::exp(-std::abs(z)));
          d_margin = -beta / (1.0 + std::exp(z));
        }
        d_chosen = d_margin;
        d_rejected = -d_margin;
      }
      total += loss;
      if (backward_) {
        store(args.outputs[0].data(), DType::f32, i, dloss * d_chosen, accumulate_flag(args, 0));
        store(args.outputs[0].data(), DType::f32, P_ + i, dloss * d_rejected, accumulate_flag(args, 0));
      }
    }
    if (!backward_) store(args.outputs[0].data(), DType::f32, 0, total / static_cast<double>(P_), accumulate_flag(args, 0));
  }

 private:
  bool backward_;
  ops::PreferenceParams params_;
  int64_t P_ = 1;
};

// loss () = mean over all N elements of max(x, 0) − x·y + log(1 + exp(−|x|)).
class SigmoidCrossEntropyRef final : public RefKernel {
 public:
  SigmoidCrossEntropyRef(const KernelCall& call) : N_(input_shape(call, 0).numel()) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const float* x = args.inputs[0].data_as<float>();
    const float* y = args.inputs[1].data_as<float>();
    double sum = 0.0;
    for (int64_t i = 0; i < N_; ++i) {
      double xi = x[i];
      sum += std::max(xi, 0.0) - xi * y[i] + std::log1p(std::exp(-std::abs(xi)));
    }
    store(args.outputs[0].data(), DType::f32, 0, N_ > 0 ? sum / static_cast<double>(N_) : 0.0,
          accumulate_flag(args, 0));
  }

 private:
  int64_t N_;
};

// dlogits = dloss · (sigmoid(x) − y) / N.
class SigmoidCrossEntropyBackwardRef final : public RefKernel {
 public:
  SigmoidCrossEntropyBackwardRef(const KernelCall& call) : N_(input_shape(call, 1).numel()) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const double dloss = args.inputs[0].data_as<float>()[0];
    const float* x = args.inputs[1].data_as<float>();
    const float* y = args.inputs[2].data_as<float>();
    for (int64_t i = 0; i < N_; ++i) {
      double sigmoid = 1.0 / (1.0 + std::exp(-static_cast<double>(x[i])));
      store(args.outputs[0].data(), DType::f32, i, dloss * (sigmoid - y[i]) / static_cast<double>(N_),
            accumulate_flag(args, 0));
    }
  }

 private:
  int64_t N_;
};

}  // namespace

std::unique_ptr<Kernel> make_sigmoid_cross_entropy_ref(const KernelCall& call) {
  return std::make_unique<SigmoidCrossEntropyRef>(call);
}

std::unique_ptr<Kernel> make_sigmoid_cross_entropy_backward_ref(const KernelCall& call) {
  return std::make_unique<SigmoidCrossEntropyBackwardRef>(call);
}

std::unique_ptr<Kernel> make_cross_entropy_ref(const KernelCall& call) {
  return std::make_unique<CrossEntropyRef>(call);
}

std::unique_ptr<Kernel> make_linear_cross_entropy_ref(const KernelCall& call) {
  return std::make_unique<LinearCrossEntropyRef>(call);
}

std::unique_ptr<Kernel> make_token_stats_ref(const KernelCall& call) { return std::make_unique<TokenStatsRef>(call); }

std::unique_ptr<Kernel> make_token_log_probs_ref(const KernelCall& call) {
  return std::make_unique<TokenLogProbsRef>(call);
}

std::unique_ptr<Kernel> make_token_log_probs_backward_ref(const KernelCall& call) {
  return std::make_unique<TokenLogProbsBackwardRef>(call);
}

std::unique_ptr<Kernel> make_linear_log_probs_ref(const KernelCall& call) {
  return std::make_unique<LinearLogProbsRef>(call);
}

std::unique_ptr<Kernel> make_preference_loss_ref(const KernelCall& call) {
  return std::make_unique<PreferenceLossRef>(call);
}

std::unique_ptr<Kernel> make_cross_entropy_backward_ref(const KernelCall& call) {
  return std::make_unique<CrossEntropyBackwardRef>(call);
}

}  // namespace fusetrain::kernels::ref
