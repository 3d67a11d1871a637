// Reference reductions: ReduceSum, ReduceMean (over `axes`, optional keepdims),
// ReduceSumTo (sum over the axes along which `shape` broadcasts to x) and
// CastColumnSum (x cast, and its sums over every axis but the last).
// Every output element is a double accumulator in scratch, rounded once.
//
// Shape letters: any rank; each element of x adds into the output element its
// index maps to (stride 0 along reduced axes).
#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

// out[index.offset(i)] = divisor⁻¹ · Σ x[i] over x's n_in elements; sums: n_out doubles.
void reduce_forward(void* out, DType out_dtype, const void* x, DType x_dtype, const StridedIndex& index, int64_t n_in,
                    int64_t n_out, double divisor, bool accumulate, double* sums) {
  for (int64_t o = 0; o < n_out; ++o) sums[o] = 0.0;
  for (int64_t i = 0; i < n_in; ++i) sums[index.offset(i)] += load(x, x_dtype, i);
  for (int64_t o = 0; o < n_out; ++o) store(out, out_dtype, o, sums[o] / divisor, accumulate);
}

class ReduceRef final : public RefKernel {
 public:
  // mean: divide by the number of elements summed into each output (ReduceMean).
  ReduceRef(const KernelCall& call, const Shape& kept_shape, bool mean)
      : x_dtype_(input_dtype(call, 0)),
        out_dtype_(output_dtype(call, 0)),
        n_in_(input_shape(call, 0).numel()),
        n_out_(output_shape(call, 0).numel()),
        index_(broadcast_index(kept_shape, input_shape(call, 0))) {
    if (mean) divisor_ = static_cast<double>(input_shape(call, 0).numel()) / static_cast<double>(kept_shape.numel());
  }

  size_t scratch_bytes(int) const override { return static_cast<size_t>(n_out_) * sizeof(double); }

  void run(const KernelArgs& args, const StepContext&) override {
    reduce_forward(args.outputs[0].data(), out_dtype_, args.inputs[0].data(), x_dtype_, index_, n_in_, n_out_, divisor_,
                   accumulate_flag(args, 0), static_cast<double*>(args.scratch));
  }

 private:
  DType x_dtype_, out_dtype_;
  int64_t n_in_, n_out_;
  StridedIndex index_;
  double divisor_ = 1.0;
};

// CastColumnSum: out 0 = x stored in its dtype (store rounds as Cast does), out 1 (N) = Σ x over the leading axes.
class CastColumnSumRef final : public RefKernel {
 public:
  CastColumnSumRef(const KernelCall& call)
      : to_(output_dtype(call, 0)),
        n_in_(input_shape(call, 0).numel()),
        n_out_(output_shape(call, 1).numel()),
        index_(broadcast_index(column_shape(input_shape(call, 0)), input_shape(call, 0))) {}

  size_t scratch_bytes(int) const override { return static_cast<size_t>(n_out_) * sizeof(double); }

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    const bool add_cast = accumulate_flag(args, 0);
    for (int64_t i = 0; i < n_in_; ++i) store(args.outputs[0].data(), to_, i, load(x, DType::f32, i), add_cast);
    reduce_forward(args.outputs[1].data(), DType::f32, x, DType::f32, index_, n_in_, n_out_, 1.0,
                   accumulate_flag(args, 1), static_cast<double*>(args.scratch));
  }

 private:
  // (1, ..., 1, N): the shape the sums keep.
  static Shape column_shape(const Shape& x) {
    Shape kept = x;
    for (int64_t a = 0; a + 1 < x.rank(); ++a) kept[a] = 1;
    return kept;
  }

  DType to_;
  int64_t n_in_, n_out_;
  StridedIndex index_;
};

}  // namespace

std::unique_ptr<Kernel> make_cast_column_sum_ref(const KernelCall& call) {
  return std::make_unique<CastColumnSumRef>(call);
}

std::unique_ptr<Kernel> make_reduce_ref(const KernelCall& call) {
  // The output with keepdims=1 (reduced axes kept as extent 1) has the same
  // element order as the output either way.
  const Shape& x = input_shape(call, 0);
  Shape kept = x;
  for (int64_t axis : call.params<ops::ReduceParams>().axes) kept[normalize_axis(axis, x.rank(), "ReduceSum axes")] = 1;
  return std::make_unique<ReduceRef>(call, kept, call.op == OpKind::ReduceMean);
}

std::unique_ptr<Kernel> make_reduce_sum_to_ref(const KernelCall& call) {
  // `shape` broadcasts to x, so x's elements map onto it by broadcasting rules.
  return std::make_unique<ReduceRef>(call, output_shape(call, 0), false);
}

}  // namespace fusetrain::kernels::ref
