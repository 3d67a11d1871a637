// Reference CtcLoss and its backward, in double: the forward-backward recursions of connectionist temporal
// classification over log_softmax(logits), in log space.
//
// Shape letters: B examples, T frames, V classes, L label slots; an example's target l (its labels >= 0, in order)
// is extended with blanks to l' = (blank, l1, blank, l2, ..., blank) of S = 2|l| + 1 states.
//   alpha_t(s): log-probability of the paths that emit l'_1..l'_s over frames 0..t and sit in state s at t;
//   beta_t(s):  log-probability of finishing l' over frames t+1.. from state s at t.
// The loss is -log p(l | x) = -lse(alpha_{T-1}(S-1), alpha_{T-1}(S-2)). The gradient of the loss in logit (t, k)
// is softmax_t(k) - sum over states s with l'_s = k of exp(alpha_t(s) + beta_t(s) + loss): the posterior of
// class k at frame t, which is what torch.nn.functional.ctc_loss followed by log_softmax's backward gives.
// A state may skip the blank before it when its label differs from the label two states back (torch's rule).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double log_add(double a, double b) {
  if (a == kNegInf) return b;
  if (b == kNegInf) return a;
  const double m = std::max(a, b);
  return m + std::log1p(std::exp(-std::abs(a - b)));
}

class CtcLossRef final : public RefKernel {
 public:
  explicit CtcLossRef(const KernelCall& call)
      : backward_(call.op == OpKind::CtcLossBackward), params_(call.params<ops::CtcParams>()) {
    const size_t at = backward_ ? 1 : 0;
    const Shape& logits = input_shape(call, at);
    B_ = logits[0];
    T_ = logits[1];
    V_ = logits[2];
    L_ = input_shape(call, at + 1)[1];
    lengths_ = call.inputs.size() == at + 3;
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const size_t at = backward_ ? 1 : 0;
    const float* logits = args.inputs[at].data_as<float>();
    const void* labels = args.inputs[at + 1].data();
    for (int64_t b = 0; b < B_; ++b) {
      const int64_t frames =
          lengths_ ? std::clamp<int64_t>(load_index(args.inputs[at + 2].data(), DType::i64, b), 0, T_) : T_;
      target_.clear();
      for (int64_t j = 0; j < L_; ++j) {
        const int64_t label = load_index(labels, DType::i64, b * L_ + j);
        if (label < 0) continue;
        FT_CHECK(label < V_, "CTC label ", label, " of example ", b, " is not one of the ", V_, " classes");
        target_.push_back(label);
      }
      const double loss = forward(logits + b * T_ * V_, frames);
      const double scale = params_.per_target ? 1.0 / double(std::max<size_t>(target_.size(), 1)) : 1.0;
      const bool impossible = std::isinf(loss);
      if (!backward_) {
        const double value = impossible && params_.zero_infinity ? 0.0 : loss * scale;
        store(args.outputs[0].data(), DType::f32, b, value, accumulate_flag(args, 0));
        continue;
      }
      const double g = load(args.inputs[0].data(), DType::f32, b) * scale;
      float* out = args.outputs[0].data_as<float>() + b * T_ * V_;
      const bool accumulate = accumulate_flag(args, 0);
      if (impossible) {  // torch's gradient of an infinite loss is NaN; zero_infinity zeroes it
        const double value = params_.zero_infinity ? 0.0 : std::numeric_limits<double>::quiet_NaN();
        for (int64_t i = 0; i < T_ * V_; ++i) store(out, DType::f32, i, value, accumulate);
        continue;
      }
      gradient(logits + b * T_ * V_, frames, loss, g, out, accumulate);
    }
  }

 private:
  int64_t state_label(int64_t s) const { return s % 2 == 0 ? params_.blank : target_[size_t(s / 2)]; }
  bool may_skip(int64_t s) const { return s % 2 == 1 && s >= 3 && state_label(s) != state_label(s - 2); }

  // Row log-sum-exps of the first `frames` frames, then alpha; returns the loss (+inf: no alignment).
  double forward(const float* x, int64_t frames) {
    const int64_t S = 2 * int64_t(target_.size()) + 1;
    lse_.assign(size_t(frames), 0.0);
    for (int64_t t = 0; t < frames; ++t) {
      double m = kNegInf;
      for (int64_t k = 0; k < V_; ++k) m = std::max(m, double(x[t * V_ + k]));
      double sum = 0.0;
      for (int64_t k = 0; k < V_; ++k) sum += std::exp(double(x[t * V_ + k]) - m);
      lse_[size_t(t)] = m + std::log(sum);
    }
    if (frames == 0) return target_.empty() ? 0.0 : std::numeric_limits<double>::infinity();
    auto lp = [&](int64_t t, int64_t s) { return double(x[t * V_ + state_label(s)]) - lse_[size_t(t)]; };
    alpha_.assign(size_t(frames * S), kNegInf);
    alpha_[0] = lp(0, 0);
    if (S > 1) alpha_[1] = lp(0, 1);
    for (int64_t t = 1; t < frames; ++t)
      for (int64_t s = 0; s < S; ++s) {
        const double* prev = &alpha_[size_t((t - 1) * S)];
        double a = prev[s];
        if (s >= 1) a = log_add(a, prev[s - 1]);
        if (may_skip(s)) a = log_add(a, prev[s - 2]);
        alpha_[size_t(t * S + s)] = a == kNegInf ? kNegInf : a + lp(t, s);
      }
    const double* last = &alpha_[size_t((frames - 1) * S)];
    const double ll = S > 1 ? log_add(last[S - 1], last[S - 2]) : last[S - 1];
    return -ll;
  }

  // beta, then each frame's softmax minus the posterior of each class, times g (forward() ran just before).
  void gradient(const float* x, int64_t frames, double loss, double g, float* out, bool accumulate) {
    const int64_t S = 2 * int64_t(target_.size()) + 1;
    auto lp = [&](int64_t t, int64_t s) { return double(x[t * V_ + state_label(s)]) - lse_[size_t(t)]; };
    beta_.assign(size_t(frames * S), kNegInf);
    beta_[size_t((frames - 1) * S + S - 1)] = 0.0;
    if (S > 1) beta_[size_t((frames - 1) * S + S - 2)] = 0.0;
    for (int64_t t = frames - 2; t >= 0; --t)
      for (int64_t s = 0; s < S; ++s) {
        const double* next = &beta_[size_t((t + 1) * S)];
        double v = next[s] == kNegInf ? kNegInf : next[s] + lp(t + 1, s);
        if (s + 1 < S && next[s + 1] != kNegInf) v = log_add(v, next[s + 1] + lp(t + 1, s + 1));
        if (s + 2 < S && may_skip(s + 2) && next[s + 2] != kNegInf) v = log_add(v, next[s + 2] + lp(t + 1, s + 2));
        beta_[size_t(t * S + s)] = v;
      }
    posterior_.assign(size_t(V_), 0.0);
    for (int64_t t = 0; t < T_; ++t) {
      if (t >= frames) {
        for (int64_t k = 0; k < V_; ++k) store(out, DType::f32, t * V_ + k, 0.0, accumulate);
        continue;
      }
      std::fill(posterior_.begin(), posterior_.end(), 0.0);
      for (int64_t s = 0; s < S; ++s) {
        const double ab = alpha_[size_t(t * S + s)] + beta_[size_t(t * S + s)];
        if (ab != kNegInf) posterior_[size_t(state_label(s))] += std::exp(ab + loss);
      }
      for (int64_t k = 0; k < V_; ++k) {
        const double softmax = std::exp(double(x[t * V_ + k]) - lse_[size_t(t)]);
        store(out, DType::f32, t * V_ + k, g * (softmax - posterior_[size_t(k)]), accumulate);
      }
    }
  }

  bool backward_;
  ops::CtcParams params_;
  int64_t B_ = 0, T_ = 0, V_ = 0, L_ = 0;
  bool lengths_ = false;
  // Scratch kept across steps (sized by the largest example seen).
  std::vector<int64_t> target_;
  std::vector<double> lse_, alpha_, beta_, posterior_;
};

}  // namespace

std::unique_ptr<Kernel> make_ctc_loss_ref(const KernelCall& call) { return std::make_unique<CtcLossRef>(call); }

}  // namespace fusetrain::kernels::ref
