// Reference RoPE: each pair (x1[i], x2[i]) of the two halves of a head's first R elements rotated by cos and sin
// (B, T, R) of its position; elements R .. D pass through (partial rotary when R < D).
//
// Shape letters: B batch, T sequence, H heads, D head size, R rotated size (even), R/2 = half.
#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

class RoPERef final : public RefKernel {
 public:
  RoPERef(const KernelCall& call) : inverse_(call.params<ops::RoPEParams>().inverse) {
    const Shape& x = input_shape(call, 0);
    rows_ = x[0] * x[1];  // (b, t) pairs, each with its own cos and sin row
    H_ = x[2];
    D_ = x[3];
    R_ = input_shape(call, 1)[2];
  }

  void run(const KernelArgs& args, const StepContext&) override {
    // y may alias x: each pair is read whole before it is written.
    const float* x = args.inputs[0].data_as<float>();
    const float* cos = args.inputs[1].data_as<float>();
    const float* sin = args.inputs[2].data_as<float>();
    const bool accumulate = accumulate_flag(args, 0);
    const int64_t half = R_ / 2;
    for (int64_t r = 0; r < rows_; ++r) {
      const float* c = cos + r * R_;
      const float* s = sin + r * R_;
      for (int64_t h = 0; h < H_; ++h) {
        const int64_t base = (r * H_ + h) * D_;
        for (int64_t i = 0; i < half; ++i) {
          const double x1 = x[base + i], x2 = x[base + half + i];
          // Forward: (x1·c1 − x2·s1, x2·c2 + x1·s2). Inverse (its transpose): (x1·c1 + x2·s2, x2·c2 − x1·s1).
          const double y1 = inverse_ ? x1 * c[i] + x2 * s[half + i] : x1 * c[i] - x2 * s[i];
          const double y2 = inverse_ ? x2 * c[half + i] - x1 * s[i] : x2 * c[half + i] + x1 * s[half + i];
          store(args.outputs[0].data(), DType::f32, base + i, y1, accumulate);
          store(args.outputs[0].data(), DType::f32, base + half + i, y2, accumulate);
        }
        for (int64_t i = R_; i < D_; ++i) store(args.outputs[0].data(), DType::f32, base + i, x[base + i], accumulate);
      }
    }
  }

 private:
  bool inverse_;
  int64_t rows_ = 0, H_ = 0, D_ = 0, R_ = 0;
};

}  // namespace

std::unique_ptr<Kernel> make_rope_ref(const KernelCall& call) { return std::make_unique<RoPERef>(call); }

}  // namespace fusetrain::kernels::ref
