// Reference data-movement kernels: Reshape, Transpose, Split, Concat, Slice,
// SliceBackward, ExpandTo, Embedding and EmbeddingBackward. Elements move bit
// for bit (any dtype) unless accumulate asks for an addition.
//
// Shape letters: V vocabulary, C channels, N number of ids; ops along one axis
// view a tensor as (outer, X, inner) with X the extent of that axis.
#include <cstring>

#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

// A contiguous tensor seen as (outer, extent, inner) around one axis.
struct AxisView {
  int64_t outer = 1, extent = 1, inner = 1;
};

AxisView view_around(const Shape& shape, int64_t axis) {
  axis = normalize_axis(axis, shape.rank(), "axis");
  return {shape.numel(0, axis), shape[axis], shape.numel(axis + 1, shape.rank())};
}

// dst (outer, dst.extent, inner) at [dst_start, dst_start + count) along the axis
//   = src (outer, src.extent, inner) at [src_start, src_start + count)
void copy_along_axis(void* dst, const AxisView& dst_view, int64_t dst_start, const void* src, const AxisView& src_view,
                     int64_t src_start, int64_t count, DType dtype, bool accumulate) {
  for (int64_t o = 0; o < dst_view.outer; ++o)
    for (int64_t a = 0; a < count; ++a)
      for (int64_t i = 0; i < dst_view.inner; ++i) {
        int64_t d = (o * dst_view.extent + dst_start + a) * dst_view.inner + i;
        int64_t s = (o * src_view.extent + src_start + a) * src_view.inner + i;
        copy_element(dst, d, src, s, dtype, accumulate);
      }
}

// out = x under a new shape. The runtime normally aliases the two (kAlias);
// then the data is already in place and nothing moves.
class ReshapeRef final : public RefKernel {
 public:
  ReshapeRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()), dtype_(output_dtype(call, 0)) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    if (out == x) return;
    if (!accumulate_flag(args, 0)) {
      std::memmove(out, x, static_cast<size_t>(numel_) * dtype_size(dtype_));
      return;
    }
    for (int64_t i = 0; i < numel_; ++i) copy_element(out, i, x, i, dtype_, true);
  }

 private:
  int64_t numel_;
  DType dtype_;
};

// out axis i = x axis perm[i]; out[o] = x[index.offset(o)].
class TransposeRef final : public RefKernel {
 public:
  TransposeRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()), dtype_(output_dtype(call, 0)) {
    const std::vector<int64_t>& perm = call.params<ops::TransposeParams>().perm;
    std::vector<int64_t> x_strides = contiguous_strides(input_shape(call, 0));
    index_.dims = output_shape(call, 0).dims();
    for (int64_t p : perm) index_.strides.push_back(x_strides[static_cast<size_t>(p)]);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t o = 0; o < numel_; ++o) copy_element(out, o, x, index_.offset(o), dtype_, acc);
  }

 private:
  int64_t numel_;
  DType dtype_;
  StridedIndex index_;
};

// x (outer, X, inner) -> out_k (outer, sizes[k], inner), piece k starting at Σ_{j<k} sizes[j].
class SplitRef final : public RefKernel {
 public:
  SplitRef(const KernelCall& call) : dtype_(input_dtype(call, 0)), sizes_(call.params<ops::SplitParams>().sizes) {
    x_view_ = view_around(input_shape(call, 0), call.params<ops::SplitParams>().axis);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    int64_t start = 0;
    for (size_t k = 0; k < sizes_.size(); ++k) {
      AxisView piece{x_view_.outer, sizes_[k], x_view_.inner};
      copy_along_axis(args.outputs[k].data(), piece, 0, args.inputs[0].data(), x_view_, start, sizes_[k], dtype_,
                      accumulate_flag(args, k));
      start += sizes_[k];
    }
  }

 private:
  DType dtype_;
  std::vector<int64_t> sizes_;
  AxisView x_view_;
};

// x_k (outer, X_k, inner) -> out (outer, Σ X_k, inner).
class ConcatRef final : public RefKernel {
 public:
  ConcatRef(const KernelCall& call) : dtype_(output_dtype(call, 0)) {
    const int64_t axis = call.params<ops::ConcatParams>().axis;
    out_view_ = view_around(output_shape(call, 0), axis);
    for (size_t k = 0; k < call.inputs.size(); ++k) input_views_.push_back(view_around(input_shape(call, k), axis));
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const bool acc = accumulate_flag(args, 0);
    int64_t start = 0;
    for (size_t k = 0; k < input_views_.size(); ++k) {
      copy_along_axis(args.outputs[0].data(), out_view_, start, args.inputs[k].data(), input_views_[k], 0,
                      input_views_[k].extent, dtype_, acc);
      start += input_views_[k].extent;
    }
  }

 private:
  DType dtype_;
  AxisView out_view_;
  std::vector<AxisView> input_views_;
};

// Slice:         out (outer, end − start, inner) = x (outer, X, inner)[:, start:end, :]
// SliceBackward: out (outer, X, inner) = zeros with dy written at [start, end)
class SliceRef final : public RefKernel {
 public:
  SliceRef(const KernelCall& call)
      : backward_(call.op == OpKind::SliceBackward),
        dtype_(output_dtype(call, 0)),
        start_(backward_ ? call.params<ops::SliceBackwardParams>().start : call.params<ops::SliceParams>().start),
        end_(backward_ ? call.params<ops::SliceBackwardParams>().end : call.params<ops::SliceParams>().end) {
    const Shape& full = backward_ ? output_shape(call, 0) : input_shape(call, 0);
    full_view_ = view_around(full, backward_ ? call.params<ops::SliceBackwardParams>().axis
                                             : call.params<ops::SliceParams>().axis);
    part_view_ = {full_view_.outer, end_ - start_, full_view_.inner};
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const bool acc = accumulate_flag(args, 0);
    void* out = args.outputs[0].data();
    const void* x = args.inputs[0].data();
    if (!backward_) {
      copy_along_axis(out, part_view_, 0, x, full_view_, start_, end_ - start_, dtype_, acc);
      return;
    }
    if (!acc) {  // zeros outside [start, end); accumulating adds nothing there
      for (int64_t o = 0; o < full_view_.outer; ++o)
        for (int64_t a = 0; a < full_view_.extent; ++a)
          if (a < start_ || a >= end_)
            for (int64_t i = 0; i < full_view_.inner; ++i)
              store(out, dtype_, (o * full_view_.extent + a) * full_view_.inner + i, 0.0, false);
    }
    copy_along_axis(out, full_view_, start_, x, part_view_, 0, end_ - start_, dtype_, acc);
  }

 private:
  bool backward_;
  DType dtype_;
  int64_t start_, end_;
  AxisView full_view_, part_view_;
};

// out (shape) = x broadcast to `shape` (numpy rules).
class ExpandToRef final : public RefKernel {
 public:
  ExpandToRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()),
        dtype_(output_dtype(call, 0)),
        index_(broadcast_index(input_shape(call, 0), output_shape(call, 0))) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t o = 0; o < numel_; ++o) copy_element(out, o, x, index_.offset(o), dtype_, acc);
  }

 private:
  int64_t numel_;
  DType dtype_;
  StridedIndex index_;
};

// Reads id `position` of `ids` and checks it lies in [0, V); the message names
// the node (label), the id, its position and V.
int64_t checked_id(const void* ids, DType ids_dtype, int64_t position, int64_t V, const std::string& label) {
  const int64_t id = load_index(ids, ids_dtype, position);
  if (id < 0 || id >= V)
    throw Error(str(label, ": id ", id, " at position ", position, " is outside the vocabulary [0, ", V, ")"));
  return id;
}

// out (N, C) = weight (V, C)[ids (N)]
class EmbeddingRef final : public RefKernel {
 public:
  EmbeddingRef(const KernelCall& call)
      : label_(node_label(call)),
        weight_dtype_(input_dtype(call, 0)),
        ids_dtype_(input_dtype(call, 1)),
        V_(input_shape(call, 0)[0]),
        C_(input_shape(call, 0)[1]),
        N_(input_shape(call, 1).numel()) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* weight = args.inputs[0].data();
    const void* ids = args.inputs[1].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < N_; ++i) {
      const int64_t id = checked_id(ids, ids_dtype_, i, V_, label_);
      for (int64_t c = 0; c < C_; ++c) copy_element(out, i * C_ + c, weight, id * C_ + c, weight_dtype_, acc);
    }
  }

 private:
  std::string label_;
  DType weight_dtype_, ids_dtype_;
  int64_t V_, C_, N_;
};

// dweight (V, C) = Σ over positions i with ids[i] = v of dy (N, C)[i]; rows no id
// names are zero. Each row's sum is taken in double over the positions in order
// (scratch: C doubles), then rounded once.
class EmbeddingBackwardRef final : public RefKernel {
 public:
  EmbeddingBackwardRef(const KernelCall& call)
      : label_(node_label(call)),
        ids_dtype_(input_dtype(call, 1)),
        V_(call.params<ops::EmbeddingBackwardParams>().num_embeddings),
        padding_idx_(call.params<ops::EmbeddingBackwardParams>().padding_idx),
        C_(input_shape(call, 0)[-1]),
        N_(input_shape(call, 1).numel()) {}

  size_t scratch_bytes(int) const override { return static_cast<size_t>(C_) * sizeof(double); }

  void run(const KernelArgs& args, const StepContext&) override {
    const float* dy = args.inputs[0].data_as<float>();
    const void* ids = args.inputs[1].data();
    float* dweight = args.outputs[0].data_as<float>();
    double* row_sum = static_cast<double*>(args.scratch);
    for (int64_t i = 0; i < N_; ++i) checked_id(ids, ids_dtype_, i, V_, label_);
    if (!accumulate_flag(args, 0))
      for (int64_t e = 0; e < V_ * C_; ++e) dweight[e] = 0.0f;
    for (int64_t i = 0; i < N_; ++i) {
      const int64_t id = load_index(ids, ids_dtype_, i);
      bool seen_before = false;
      for (int64_t j = 0; j < i && !seen_before; ++j) seen_before = load_index(ids, ids_dtype_, j) == id;
      if (seen_before || id == padding_idx_) continue;  // summed at its first position / never updated
      for (int64_t c = 0; c < C_; ++c) row_sum[c] = 0.0;
      for (int64_t j = i; j < N_; ++j)
        if (load_index(ids, ids_dtype_, j) == id)
          for (int64_t c = 0; c < C_; ++c) row_sum[c] += dy[j * C_ + c];
      for (int64_t c = 0; c < C_; ++c) store(dweight, DType::f32, id * C_ + c, row_sum[c], true);
    }
  }

 private:
  std::string label_;
  DType ids_dtype_;
  int64_t V_, padding_idx_, C_, N_;
};

}  // namespace

std::unique_ptr<Kernel> make_reshape_ref(const KernelCall& call) {
  return std::make_unique<ReshapeRef>(call);
}

std::unique_ptr<Kernel> make_transpose_ref(const KernelCall& call) {
  return std::make_unique<TransposeRef>(call);
}

std::unique_ptr<Kernel> make_split_ref(const KernelCall& call) {
  return std::make_unique<SplitRef>(call);
}

std::unique_ptr<Kernel> make_concat_ref(const KernelCall& call) {
  return std::make_unique<ConcatRef>(call);
}

std::unique_ptr<Kernel> make_slice_ref(const KernelCall& call) {
  return std::make_unique<SliceRef>(call);
}

std::unique_ptr<Kernel> make_slice_backward_ref(const KernelCall& call) {
  return std::make_unique<SliceRef>(call);
}

std::unique_ptr<Kernel> make_expand_to_ref(const KernelCall& call) {
  return std::make_unique<ExpandToRef>(call);
}

std::unique_ptr<Kernel> make_embedding_ref(const KernelCall& call) {
  return std::make_unique<EmbeddingRef>(call);
}

std::unique_ptr<Kernel> make_embedding_backward_ref(const KernelCall& call) {
  return std::make_unique<EmbeddingBackwardRef>(call);
}

}  // namespace fusetrain::kernels::ref
