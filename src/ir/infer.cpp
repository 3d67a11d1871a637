// Shape and dtype inference for every op. The switch has no default, so a new
// op in ops.def fails to compile until it is handled here (-Werror=switch).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "fusetrain/core/error.h"
#include "fusetrain/ir/graph.h"
#include "fusetrain/ir/params.h"

namespace fusetrain::ir {
namespace {

// (R...) -> (R..., 3): a per-row statistics output (entropy, top-1 hit, mean logit).
Shape with_stats_axis(const Shape& rows) {
  std::vector<int64_t> dims = rows.dims();
  dims.push_back(3);
  return Shape(dims);
}

using namespace ops;  // the parameter structs

struct Checker {
  const Graph& g;
  OpKind op;
  const std::vector<ValueId>& in;
  const std::string& node_name;

  std::string where() const {
    std::string s = str(op_name(op), node_name.empty() ? "" : str(" \"", node_name, "\""), " (inputs:");
    for (ValueId v : in) s += str(" ", dtype_name(g.value(v).dtype), g.value(v).shape.to_string());
    return s + ")";
  }
  const Shape& shape(size_t i) const { return g.value(in[i]).shape; }
  DType dtype(size_t i) const { return g.value(in[i]).dtype; }
  template <typename... Args>
  void require(bool cond, Args&&... args) const {
    if (!cond) throw Error(str(where(), ": ", std::forward<Args>(args)...));
  }
  void require_float(size_t i, const char* what) const {
    require(is_floating(dtype(i)), what, " must be floating point, found ", dtype_name(dtype(i)));
  }
  void require_f32(size_t i, const char* what) const {
    require(dtype(i) == DType::f32, what, " must be f32, found ", dtype_name(dtype(i)));
  }
  void require_index(size_t i, const char* what) const {
    require(dtype(i) == DType::i64 || dtype(i) == DType::i32, what, " must be i64 or i32, found ",
            dtype_name(dtype(i)));
  }
  void require_same_dtype(size_t a, size_t b) const {
    require(dtype(a) == dtype(b), "input ", a, " is ", dtype_name(dtype(a)), " but input ", b, " is ",
            dtype_name(dtype(b)));
  }
  void require_same_shape(size_t a, size_t b) const {
    require(shape(a) == shape(b), "input ", a, " has shape ", shape(a).to_string(), " but input ", b, " has ",
            shape(b).to_string());
  }
  int64_t axis(int64_t axis, int64_t rank) const {
    require(axis >= -rank && axis < rank, "axis ", axis, " is out of range for rank ", rank);
    return axis < 0 ? axis + rank : axis;
  }
};

// Shape of a matmul of a (..., M, K) and b (..., K, N) with transposes.
Shape matmul_shape(const Checker& c, bool trans_a, bool trans_b) {
  const Shape& a = c.shape(0);
  const Shape& b = c.shape(1);
  c.require(a.rank() >= 2 && b.rank() >= 2, "both operands need rank >= 2");
  int64_t m = trans_a ? a[-1] : a[-2];
  int64_t ka = trans_a ? a[-2] : a[-1];
  int64_t kb = trans_b ? b[-1] : b[-2];
  int64_t n = trans_b ? b[-2] : b[-1];
  c.require(ka == kb, "inner dimensions differ: ", ka, " vs ", kb, " (trans_a=", trans_a, ", trans_b=", trans_b, ")");
  std::vector<int64_t> batch;
  if (a.rank() > 2 && b.rank() > 2) {
    c.require(a.rank() == b.rank() && std::equal(a.dims().begin(), a.dims().end() - 2, b.dims().begin()),
              "batch dimensions differ: ", a.to_string(), " vs ", b.to_string());
    batch.assign(a.dims().begin(), a.dims().end() - 2);
  } else if (a.rank() > 2) {
    batch.assign(a.dims().begin(), a.dims().end() - 2);
  } else if (b.rank() > 2) {
    batch.assign(b.dims().begin(), b.dims().end() - 2);
  }
  batch.push_back(m);
  batch.push_back(n);
  return Shape(batch);
}

std::vector<int64_t> reduce_axes(const Checker& c, std::vector<int64_t> axes, int64_t rank) {
  for (int64_t& a : axes) a = c.axis(a, rank);
  std::sort(axes.begin(), axes.end());
  c.require(std::adjacent_find(axes.begin(), axes.end()) == axes.end(), "axes repeat an axis");
  return axes;
}

Shape reduced_shape(const Shape& x, const std::vector<int64_t>& axes, bool keepdims) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < x.rank(); ++i) {
    bool reduced = std::find(axes.begin(), axes.end(), i) != axes.end();
    if (!reduced)
      out.push_back(x[i]);
    else if (keepdims)
      out.push_back(1);
  }
  return Shape(out);
}

// True if `small` broadcasts to `big` (numpy rules, small may have lower rank).
// The stream index map of a node applying dropout (kernels/rng.h): absent, or runs of
// index_block elements index_stride apart from index_start, inside one stride.
void check_stream_index_map(const Checker& c, const DropoutParams& p) {
  const int64_t block = p.index_block, stride = p.index_stride, start = p.index_start;
  if (block == 0 && stride == 0 && start == 0) return;
  c.require(block > 0 && start >= 0 && start + block <= stride, "index_block ", block, ", index_stride ", stride,
            " and index_start ", start, " do not describe runs inside one stride");
}

bool broadcasts_to(const Shape& small, const Shape& big) {
  if (small.rank() > big.rank()) return false;
  int64_t offset = big.rank() - small.rank();
  for (int64_t i = 0; i < small.rank(); ++i)
    if (small[i] != 1 && small[i] != big[i + offset]) return false;
  return true;
}

std::vector<TypedShape> infer(const Checker& c, const OpParams& params) {
  const size_t n_in = c.in.size();
  switch (c.op) {
    case OpKind::Fill: {
      const auto& p = std::get<FillParams>(params);
      return {{Shape(p.shape), p.dtype}};
    }
    case OpKind::MatMul: {
      c.require_float(0, "a");
      c.require_same_dtype(0, 1);
      const auto& p = std::get<MatMulParams>(params);
      return {{matmul_shape(c, p.trans_a, p.trans_b), p.out_dtype}};
    }
    case OpKind::Linear:
    case OpKind::LinearGelu: {
      const Shape& x = c.shape(0);
      const Shape& w = c.shape(1);
      c.require_float(0, "x");
      c.require_same_dtype(0, 1);
      c.require(x.rank() >= 1 && w.rank() == 2, "expected x (..., K) and weight (N, K)");
      c.require(x[-1] == w[1], "x has ", x[-1], " features but weight ", w.to_string(), " expects ", w[1]);
      if (n_in == 3) {
        c.require_f32(2, "bias");
        c.require(c.shape(2) == Shape{w[0]}, "bias shape ", c.shape(2).to_string(), " should be (", w[0], ")");
      }
      std::vector<int64_t> out = x.dims();
      out.back() = w[0];
      if (c.op == OpKind::Linear) return {{Shape(out), std::get<LinearParams>(params).out_dtype}};
      // gelu(z) in out_dtype (rounded from f32), z in z_dtype
      const auto& p = std::get<LinearGeluParams>(params);
      return {{Shape(out), p.out_dtype}, {Shape(out), p.z_dtype}};
    }
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Mul:
    case OpKind::Div: {
      c.require_float(0, "a");
      c.require_same_dtype(0, 1);
      Shape out;
      try {
        out = broadcast_shapes(c.shape(0), c.shape(1));
      } catch (const Error& e) {
        c.require(false, e.what());
      }
      return {{out, c.dtype(0)}};
    }
    case OpKind::Scale:
      c.require_float(0, "x");
      return {{c.shape(0), c.dtype(0)}};
    case OpKind::Gelu:
    case OpKind::GeluBackward: {
      // Gelu: x f32 or bf16 (computed in f32). GeluBackward: dy f32, x as the forward's.
      const size_t x_index = n_in == 2 ? 1 : 0;
      c.require(c.dtype(x_index) == DType::f32 || c.dtype(x_index) == DType::bf16, "x must be f32 or bf16, found ",
                dtype_name(c.dtype(x_index)));
      if (n_in == 2) {
        c.require_f32(0, "dy");
        c.require_same_shape(0, 1);
      }
      // Gelu's result may be rounded to bf16 (out_dtype, written by fold_output_casts); dx is f32.
      return {{c.shape(0), n_in == 2 ? DType::f32 : std::get<GeluParams>(params).out_dtype}};
    }
    case OpKind::MatMulGeluBackward: {
      // a, b: one GEMM (b 2-D, a not transposed when it has batch axes) whose product, read row-major, is dy of x's
      // shape: dx in out_dtype, [its column sums (N) f32], [gelu(x) in gelu_dtype].
      const auto& p = std::get<MatMulGeluBackwardParams>(params);
      c.require(c.dtype(0) == DType::f32 || c.dtype(0) == DType::bf16, "a must be f32 or bf16, found ",
                dtype_name(c.dtype(0)));
      c.require_same_dtype(0, 1);
      c.require(c.shape(1).rank() == 2 && (c.shape(0).rank() == 2 || !p.trans_a),
                "expected one product: b 2-D and a not transposed when it has batch axes, found a ",
                c.shape(0).to_string(), " and b ", c.shape(1).to_string());
      const Shape product = matmul_shape(c, p.trans_a, p.trans_b);
      const Shape& x = c.shape(2);
      c.require(c.dtype(2) == DType::f32 || c.dtype(2) == DType::bf16, "x must be f32 or bf16, found ",
                dtype_name(c.dtype(2)));
      c.require(x.rank() >= 1 && x.numel() == product.numel() && x[-1] == product[-1], "the product ",
                product.to_string(), " does not fill x ", x.to_string(), " row for row");
      std::vector<TypedShape> out = {{x, p.out_dtype}};
      if (p.column_sum) out.push_back({Shape{x[-1]}, DType::f32});
      if (p.gelu_out) out.push_back({x, p.gelu_dtype});
      return out;
    }
    case OpKind::Pow:
    case OpKind::Tanh:
    case OpKind::Relu:
    case OpKind::Sqrt:
    case OpKind::Erf:
    case OpKind::Softmax:
    case OpKind::Copy:
      c.require_float(0, "x");
      if (c.op == OpKind::Softmax) c.require(c.shape(0).rank() >= 1, "softmax needs rank >= 1");
      return {{c.shape(0), c.dtype(0)}};
    case OpKind::ReluBackward:  // x as the forward's: f32, or bf16 (a ReLU of a bf16 projection's result)
      c.require_f32(0, "dy");
      c.require(c.dtype(1) == DType::f32 || c.dtype(1) == DType::bf16, "x must be f32 or bf16, found ",
                dtype_name(c.dtype(1)));
      c.require_same_shape(0, 1);
      return {{c.shape(0), DType::f32}};
    case OpKind::TanhBackward:
    case OpKind::ErfBackward:
    case OpKind::SoftmaxBackward:
      c.require_f32(0, "dy");
      c.require_same_dtype(0, 1);
      c.require_same_shape(0, 1);
      return {{c.shape(0), DType::f32}};
    case OpKind::LayerNorm: {
      const Shape& x = c.shape(0);
      c.require_f32(0, "x");
      c.require_f32(1, "gamma");
      c.require_f32(2, "beta");
      c.require(x.rank() >= 1, "x needs rank >= 1");
      c.require(c.shape(1) == Shape{x[-1]} && c.shape(2) == Shape{x[-1]}, "gamma and beta should be (", x[-1], ")");
      c.require(std::get<LayerNormParams>(params).eps > 0, "eps must be positive");
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      return {{x, DType::f32}, {rows, DType::f32}, {rows, DType::f32}};
    }
    case OpKind::RMSNorm: {
      // x, weight -> y, rstd
      const Shape& x = c.shape(0);
      c.require_f32(0, "x");
      c.require_f32(1, "weight");
      c.require(x.rank() >= 1, "x needs rank >= 1");
      c.require(c.shape(1) == Shape{x[-1]}, "weight should be (", x[-1], ")");
      c.require(std::get<LayerNormParams>(params).eps > 0, "eps must be positive");
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      return {{x, DType::f32}, {rows, DType::f32}};
    }
    case OpKind::Conv:
    case OpKind::ConvBackwardData:
    case OpKind::ConvBackwardWeight: {
      // Conv: x (B, C, [H,] W), w (O, C/group, [KH,] KW), [bias (O) f32] -> y (B, O, [OH,] OW) f32. x and w f32 or
      // bf16, alike. ConvBackwardData: dy (y's shape), w -> dx of "shape" (x's); ConvBackwardWeight: dy, x -> dw of
      // "shape" (w's); dy in x's and w's dtype, the gradient f32.
      const auto& p = std::get<ConvParams>(params);
      c.require_float(0, c.op == OpKind::Conv ? "x" : "dy");
      c.require_same_dtype(0, 1);
      c.require(c.dtype(0) == DType::f32 || c.dtype(0) == DType::bf16, "operands must be f32 or bf16, found ",
                dtype_name(c.dtype(0)));
      const std::vector<int64_t>& x = c.op == OpKind::ConvBackwardWeight ? c.shape(1).dims()
                                      : c.op == OpKind::Conv             ? c.shape(0).dims()
                                                                         : p.shape;
      const std::vector<int64_t>& w = c.op == OpKind::ConvBackwardWeight ? p.shape : c.shape(1).dims();
      ConvGeometry geo;
      try {
        geo = ConvGeometry::of(p, x, w);
      } catch (const Error& e) {
        c.require(false, e.what());
      }
      if (c.op == OpKind::Conv) {
        if (n_in == 3) {
          c.require_f32(2, "bias");
          c.require(c.shape(2) == Shape({geo.O}), "bias should be (", geo.O, "), found ", c.shape(2).to_string());
        }
        return {{Shape(geo.output_dims()), DType::f32}};
      }
      c.require(c.shape(0) == Shape(geo.output_dims()), "dy should be ", Shape(geo.output_dims()).to_string(),
                ", the convolution's output");
      return {{Shape(p.shape), DType::f32}};
    }
    case OpKind::Pool:
    case OpKind::PoolBackward: {
      // Pool: x (B, C, [H,] W) f32 -> y (B, C, [OH,] OW) f32; PoolBackward: dy (y's shape), x -> dx (x's).
      const bool backward = c.op == OpKind::PoolBackward;
      c.require_f32(backward ? 1 : 0, "x");
      PoolGeometry geo;
      try {
        geo = PoolGeometry::of(std::get<PoolParams>(params), c.shape(backward ? 1 : 0).dims());
      } catch (const Error& e) {
        c.require(false, e.what());
      }
      if (!backward) return {{Shape(geo.output_dims()), DType::f32}};
      c.require_f32(0, "dy");
      c.require(c.shape(0) == Shape(geo.output_dims()), "dy should be ", Shape(geo.output_dims()).to_string(),
                ", the pooling's output");
      return {{c.shape(1), DType::f32}};
    }
    case OpKind::RoPE: {
      // x (B, T, H, D), cos and sin (B, T, R) -> y like x: the first R of each head's D rotate (R even, R <= D;
      // R < D is partial rotary), the others pass through.
      const Shape& x = c.shape(0);
      for (size_t i = 0; i < 3; ++i) c.require_f32(i, "x, cos and sin");
      c.require(x.rank() == 4, "x should be (B, T, H, D), found ", x.to_string());
      const Shape& table = c.shape(1);
      c.require(table.rank() == 3 && table[0] == x[0] && table[1] == x[1] && table[2] > 0 && table[2] <= x[3] &&
                    table[2] % 2 == 0 && c.shape(2) == table,
                "cos and sin should be (", x[0], ", ", x[1], ", R) with R even and at most the head size ", x[3],
                ", found ", table.to_string(), " and ", c.shape(2).to_string());
      return {{x, DType::f32}};
    }
    case OpKind::SwiGLU:
      // gate, up -> silu(gate)·up, in their dtype
      c.require(c.dtype(0) == DType::f32 || c.dtype(0) == DType::bf16, "gate must be f32 or bf16, found ",
                dtype_name(c.dtype(0)));
      c.require_same_dtype(0, 1);
      c.require_same_shape(0, 1);
      return {{c.shape(0), c.dtype(0)}};
    case OpKind::SwiGLUBackward:
      // dy (f32), gate, up (f32 or bf16, one dtype) -> dgate, dup (f32)
      c.require_f32(0, "dy");
      c.require(c.dtype(1) == DType::f32 || c.dtype(1) == DType::bf16, "gate must be f32 or bf16, found ",
                dtype_name(c.dtype(1)));
      c.require_same_dtype(1, 2);
      c.require_same_shape(0, 1);
      c.require_same_shape(0, 2);
      return {{c.shape(0), DType::f32}, {c.shape(0), DType::f32}};
    case OpKind::RMSNormBackward: {
      // dy, x, weight, rstd -> dx, dweight
      const Shape& x = c.shape(1);
      for (size_t i = 0; i < 4; ++i) c.require_f32(i, "every input");
      c.require_same_shape(0, 1);
      c.require(c.shape(2) == Shape{x[-1]}, "weight should be (", x[-1], ")");
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      c.require(c.shape(3) == rows, "rstd should be ", rows.to_string());
      return {{x, DType::f32}, {c.shape(2), DType::f32}};
    }
    case OpKind::AddLayerNorm: {
      // x, residual, gamma, beta -> sum = dropout(x) + residual, then y, mean, rstd of LayerNorm(sum)
      const Shape& x = c.shape(0);
      c.require_f32(0, "x");
      c.require_f32(1, "residual");
      c.require_f32(2, "gamma");
      c.require_f32(3, "beta");
      c.require(x.rank() >= 1, "x needs rank >= 1");
      c.require(c.shape(1) == x, "x ", x.to_string(), " and residual ", c.shape(1).to_string(), " differ");
      c.require(c.shape(2) == Shape{x[-1]} && c.shape(3) == Shape{x[-1]}, "gamma and beta should be (", x[-1], ")");
      const auto& add_layernorm = std::get<AddLayerNormParams>(params);
      c.require(add_layernorm.eps > 0, "eps must be positive");
      const double p = add_layernorm.dropout.p;
      c.require(p >= 0.0 && p < 1.0, "p must be in [0, 1), found ", p);
      check_stream_index_map(c, add_layernorm.dropout);
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      return {{x, DType::f32}, {x, DType::f32}, {rows, DType::f32}, {rows, DType::f32}};
    }
    case OpKind::LayerNormBackward: {
      // dy, x, gamma, mean, rstd -> dx, dgamma, dbeta
      const Shape& x = c.shape(1);
      for (size_t i = 0; i < 5; ++i) c.require_f32(i, "every input");
      c.require_same_shape(0, 1);
      c.require(c.shape(2) == Shape{x[-1]}, "gamma should be (", x[-1], ")");
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      c.require(c.shape(3) == rows && c.shape(4) == rows, "mean and rstd should be ", rows.to_string());
      return {{x, DType::f32}, {c.shape(2), DType::f32}, {c.shape(2), DType::f32}};
    }
    case OpKind::Embedding: {
      c.require_float(0, "weight");
      c.require_index(1, "ids");
      c.require(c.shape(0).rank() == 2, "weight should be (V, C), found ", c.shape(0).to_string());
      std::vector<int64_t> out = c.shape(1).dims();
      out.push_back(c.shape(0)[1]);
      return {{Shape(out), c.dtype(0)}};
    }
    case OpKind::EmbeddingBackward: {
      c.require_f32(0, "dy");
      c.require_index(1, "ids");
      int64_t vocab = std::get<EmbeddingBackwardParams>(params).num_embeddings;
      c.require(vocab > 0, "num_embeddings must be positive");
      const Shape& dy = c.shape(0);
      c.require(dy.rank() == c.shape(1).rank() + 1 &&
                    std::equal(c.shape(1).dims().begin(), c.shape(1).dims().end(), dy.dims().begin()),
                "dy should be ids.shape + (C,)");
      return {{Shape{vocab, dy[-1]}, DType::f32}};
    }
    case OpKind::Dropout: {
      const auto& dropout = std::get<DropoutParams>(params);
      c.require(dropout.p >= 0.0 && dropout.p < 1.0, "p must be in [0, 1), found ", dropout.p);
      check_stream_index_map(c, dropout);
      c.require_float(0, "x");
      return {{c.shape(0), c.dtype(0)}};
    }
    case OpKind::DropoutAdd: {  // dropout(x) + residual, one pass
      const auto& dropout = std::get<DropoutParams>(params);
      c.require(dropout.p >= 0.0 && dropout.p < 1.0, "p must be in [0, 1), found ", dropout.p);
      check_stream_index_map(c, dropout);
      c.require_f32(0, "x");
      c.require_f32(1, "residual");
      c.require(c.shape(0) == c.shape(1), "x ", c.shape(0).to_string(), " and residual ", c.shape(1).to_string(),
                " differ");
      return {{c.shape(0), DType::f32}};
    }
    case OpKind::Reshape: {
      std::vector<int64_t> out = std::get<ShapeParams>(params).shape;
      int64_t known = 1;
      int infer_at = -1;
      for (size_t i = 0; i < out.size(); ++i) {
        if (out[i] == -1) {
          c.require(infer_at < 0, "at most one extent may be -1");
          infer_at = static_cast<int>(i);
        } else {
          c.require(out[i] >= 0, "negative extent ", out[i]);
          known *= out[i];
        }
      }
      int64_t total = c.shape(0).numel();
      if (infer_at >= 0) {
        c.require(known > 0 && total % known == 0, "cannot infer -1: ", total, " elements into ",
                  Shape(out).to_string());
        out[static_cast<size_t>(infer_at)] = total / known;
      }
      c.require(Shape(out).numel() == total, "cannot reshape ", total, " elements to ", Shape(out).to_string());
      return {{Shape(out), c.dtype(0)}};
    }
    case OpKind::Transpose: {
      const std::vector<int64_t>& perm = std::get<TransposeParams>(params).perm;
      const Shape& x = c.shape(0);
      c.require(static_cast<int64_t>(perm.size()) == x.rank(), "perm has ", perm.size(), " entries for rank ",
                x.rank());
      std::vector<int64_t> seen(perm.size(), 0), out;
      for (int64_t p : perm) {
        c.require(p >= 0 && p < x.rank() && !seen[static_cast<size_t>(p)], "perm is not a permutation");
        seen[static_cast<size_t>(p)] = 1;
        out.push_back(x[p]);
      }
      return {{Shape(out), c.dtype(0)}};
    }
    case OpKind::Split: {
      const Shape& x = c.shape(0);
      const auto& split = std::get<SplitParams>(params);
      int64_t axis = c.axis(split.axis, x.rank());
      const std::vector<int64_t>& sizes = split.sizes;
      c.require(!sizes.empty(), "sizes is empty");
      int64_t total = 0;
      std::vector<TypedShape> out;
      for (int64_t s : sizes) {
        c.require(s >= 0, "negative split size ", s);
        total += s;
        Shape piece = x;
        piece[axis] = s;
        out.push_back({piece, c.dtype(0)});
      }
      c.require(total == x[axis], "sizes add up to ", total, " but axis ", axis, " has ", x[axis]);
      return out;
    }
    case OpKind::Concat: {
      const Shape& first = c.shape(0);
      int64_t axis = c.axis(std::get<ConcatParams>(params).axis, first.rank());
      Shape out = first;
      out[axis] = 0;
      for (size_t i = 0; i < n_in; ++i) {
        c.require_same_dtype(0, i);
        const Shape& s = c.shape(i);
        c.require(s.rank() == first.rank(), "input ", i, " has rank ", s.rank(), ", expected ", first.rank());
        for (int64_t d = 0; d < s.rank(); ++d)
          c.require(d == axis || s[d] == first[d], "input ", i, " differs from input 0 on axis ", d);
        out[axis] += s[axis];
      }
      return {{out, c.dtype(0)}};
    }
    case OpKind::Slice:
    case OpKind::SliceBackward: {
      const bool forward = c.op == OpKind::Slice;
      const SliceParams* slice = std::get_if<SliceParams>(&params);
      const SliceBackwardParams* backward = std::get_if<SliceBackwardParams>(&params);
      Shape full = forward ? c.shape(0) : Shape(backward->shape);
      int64_t axis = c.axis(forward ? slice->axis : backward->axis, full.rank());
      int64_t start = forward ? slice->start : backward->start, end = forward ? slice->end : backward->end;
      c.require(0 <= start && start <= end && end <= full[axis], "slice [", start, ", ", end, ") is outside axis ",
                axis, " of extent ", full[axis]);
      Shape part = full;
      part[axis] = end - start;
      if (c.op == OpKind::Slice) return {{part, c.dtype(0)}};
      c.require(c.shape(0) == part, "dy should be ", part.to_string());
      return {{full, c.dtype(0)}};
    }
    case OpKind::ReduceSum:
    case OpKind::ReduceMean: {
      c.require_float(0, "x");
      const auto& reduce = std::get<ReduceParams>(params);
      std::vector<int64_t> axes = reduce_axes(c, reduce.axes, c.shape(0).rank());
      return {{reduced_shape(c.shape(0), axes, reduce.keepdims), c.dtype(0)}};
    }
    case OpKind::ExpandTo: {
      Shape target(std::get<ShapeParams>(params).shape);
      c.require(broadcasts_to(c.shape(0), target), "cannot broadcast ", c.shape(0).to_string(), " to ",
                target.to_string());
      return {{target, c.dtype(0)}};
    }
    case OpKind::ReduceSumTo: {
      Shape target(std::get<ShapeParams>(params).shape);
      c.require(broadcasts_to(target, c.shape(0)), "cannot sum ", c.shape(0).to_string(), " down to ",
                target.to_string());
      return {{target, c.dtype(0)}};
    }
    case OpKind::Cast:
      return {{c.shape(0), std::get<CastParams>(params).dtype}};
    case OpKind::CastColumnSum: {
      // x (..., N) f32 -> Cast(x) and the column sums (N) f32
      c.require_f32(0, "x");
      c.require(c.shape(0).rank() >= 1, "x must have at least one axis, found a scalar");
      const DType to = std::get<CastParams>(params).dtype;
      c.require(to == DType::bf16 || to == DType::f16, "dtype must be bf16 or f16, found ", dtype_name(to));
      return {{c.shape(0), to}, {Shape{c.shape(0)[-1]}, DType::f32}};
    }
    case OpKind::SoftmaxCrossEntropy:
    case OpKind::TokenStats: {
      // logits (..., V) f32, targets (...) -> loss () and lse (...); TokenStats: (3) Σ entropy, top-1 hits, counted
      // rows (targets != ignore_index)
      const Shape& logits = c.shape(0);
      c.require_f32(0, "logits");
      c.require_index(1, "targets");
      c.require(logits.rank() >= 2, "logits should be (..., V)");
      Shape rows(std::vector<int64_t>(logits.dims().begin(), logits.dims().end() - 1));
      c.require(c.shape(1) == rows, "targets should be ", rows.to_string(), ", found ", c.shape(1).to_string());
      if (c.op == OpKind::TokenStats) return {{Shape{3}, DType::f32}};
      return {{Shape{}, DType::f32}, {rows, DType::f32}};
    }
    case OpKind::SoftmaxCrossEntropyBackward: {
      // dloss, logits, targets, lse -> dlogits
      c.require_f32(0, "dloss");
      c.require(c.shape(0).numel() == 1, "dloss should be a scalar");
      c.require_f32(1, "logits");
      c.require_index(2, "targets");
      Shape rows(std::vector<int64_t>(c.shape(1).dims().begin(), c.shape(1).dims().end() - 1));
      c.require(c.shape(2) == rows && c.shape(3) == rows, "targets and lse should be ", rows.to_string());
      return {{c.shape(1), DType::f32}};
    }
    case OpKind::LinearCrossEntropy: {
      // x (R..., K), w (V, K), targets (R...), [bias (V)] -> loss (), dx (R..., K), dw (V, K), dbias (V);
      // without weight_grad only loss and dx
      const Shape& x = c.shape(0);
      const Shape& w = c.shape(1);
      c.require(c.dtype(0) == DType::f32 || c.dtype(0) == DType::bf16, "x should be f32 or bf16, found ",
                dtype_name(c.dtype(0)));
      c.require_same_dtype(0, 1);
      c.require(x.rank() >= 2 && w.rank() == 2, "expected x (..., K) and weight (V, K)");
      c.require(x[-1] == w[1], "x has ", x[-1], " features but weight ", w.to_string(), " expects ", w[1]);
      c.require_index(2, "targets");
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      c.require(c.shape(2) == rows, "targets should be ", rows.to_string(), ", found ", c.shape(2).to_string());
      if (n_in == 4) {
        c.require_f32(3, "bias");
        c.require(c.shape(3) == Shape{w[0]}, "bias shape ", c.shape(3).to_string(), " should be (", w[0], ")");
      }
      c.require(std::get<LinearCrossEntropyParams>(params).chunk_rows >= 0,
                "chunk_rows must be 0 (automatic) or positive");
      const auto& lce = std::get<LinearCrossEntropyParams>(params);
      std::vector<TypedShape> outs{{Shape{}, DType::f32}, {x, DType::f32}};
      if (lce.weight_grad) outs.insert(outs.end(), {{w, DType::f32}, {Shape{w[0]}, DType::f32}});
      if (lce.token_stats) outs.push_back({Shape{3}, DType::f32});  // as TokenStats
      return outs;
    }
    case OpKind::TokenLogProbs: {
      // logits (R..., V) f32, targets (R...) -> log p (R...) [, row stats (R..., 3)]
      c.require_f32(0, "logits");
      c.require_index(1, "targets");
      const Shape& logits = c.shape(0);
      c.require(logits.rank() >= 2, "logits should be (..., V)");
      Shape rows(std::vector<int64_t>(logits.dims().begin(), logits.dims().end() - 1));
      c.require(c.shape(1) == rows, "targets should be ", rows.to_string(), ", found ", c.shape(1).to_string());
      std::vector<TypedShape> outs{{rows, DType::f32}};
      if (std::get<LogProbsParams>(params).row_stats) outs.push_back({with_stats_axis(rows), DType::f32});
      return outs;
    }
    case OpKind::TokenLogProbsBackward: {
      // dlogp (R...), logits (R..., V), targets (R...) -> dlogits
      c.require_f32(0, "dlogp");
      c.require_f32(1, "logits");
      c.require_index(2, "targets");
      Shape rows(std::vector<int64_t>(c.shape(1).dims().begin(), c.shape(1).dims().end() - 1));
      c.require(c.shape(0) == rows && c.shape(2) == rows, "dlogp and targets should be ", rows.to_string());
      return {{c.shape(1), DType::f32}};
    }
    case OpKind::LinearLogProbs:
    case OpKind::LinearLogProbsWeightGrad: {
      // LinearLogProbs: x (R..., K), w (V, K), targets (R...), [bias (V)] -> log p (R...), lse (R...),
      //   [dx (R..., K) with input_grad], [row stats (R..., 3)]
      // LinearLogProbsWeightGrad: dlogp (R...), x, w, targets, lse (R...), [bias] -> dw (V, K) [, dbias (V)]
      const bool grad = c.op == OpKind::LinearLogProbsWeightGrad;
      const int at = grad ? 1 : 0;
      const Shape& x = c.shape(at);
      const Shape& w = c.shape(at + 1);
      c.require(c.dtype(at) == DType::f32 || c.dtype(at) == DType::bf16, "x should be f32 or bf16, found ",
                dtype_name(c.dtype(at)));
      c.require_same_dtype(at, at + 1);
      c.require(x.rank() >= 2 && w.rank() == 2, "expected x (..., K) and weight (V, K)");
      c.require(x[-1] == w[1], "x has ", x[-1], " features but weight ", w.to_string(), " expects ", w[1]);
      c.require_index(at + 2, "targets");
      Shape rows(std::vector<int64_t>(x.dims().begin(), x.dims().end() - 1));
      c.require(c.shape(at + 2) == rows, "targets should be ", rows.to_string(), ", found ",
                c.shape(at + 2).to_string());
      const auto& lp = std::get<LogProbsParams>(params);
      c.require(lp.chunk_rows >= 0, "chunk_rows must be 0 (automatic) or positive");
      if (grad) {
        c.require_f32(0, "dlogp");
        c.require(n_in == 5 || n_in == 6, "expected dlogp, x, w, targets, lse and an optional bias");
        c.require_f32(4, "lse");
        c.require(c.shape(0) == rows && c.shape(4) == rows, "dlogp and lse should be ", rows.to_string());
      }
      const size_t bias_at = grad ? 5 : 3;  // the weight gradient's bias follows lse
      if (n_in == bias_at + 1) {
        c.require_f32(bias_at, "bias");
        c.require(c.shape(bias_at) == Shape{w[0]}, "bias shape ", c.shape(bias_at).to_string(), " should be (", w[0],
                  ")");
      }
      if (grad) {
        std::vector<TypedShape> outs{{w, DType::f32}};
        if (n_in == 6) outs.push_back({Shape{w[0]}, DType::f32});
        return outs;
      }
      std::vector<TypedShape> outs{{rows, DType::f32}, {rows, DType::f32}};
      if (lp.input_grad) outs.push_back({x, DType::f32});
      if (lp.row_stats) outs.push_back({with_stats_axis(rows), DType::f32});
      return outs;
    }
    case OpKind::QuantizedLinear:
    case OpKind::QuantizedLinearBackward: {
      // QuantizedLinear: x (..., K) f32 or bf16, then the weight: 4-bit, packed codes (N·K/2) u8, absmax
      //   (ceil(N·K / blocksize)) f32, code (16) f32; 8-bit, int8 codes (N·K) u8, absmax (N) f32; then [bias (N) f32]
      //   -> y (..., N) f32 = x · dequant(weight)ᵀ + bias
      // QuantizedLinearBackward: dy (..., N) f32, the weight's inputs -> dx (..., K) f32 = dy · dequant(weight)
      const auto& q = std::get<QuantizedParams>(params);
      const bool backward = c.op == OpKind::QuantizedLinearBackward;
      const Shape& x = c.shape(0);
      c.require(c.dtype(0) == DType::f32 || c.dtype(0) == DType::bf16, backward ? "dy" : "x",
                " should be f32 or bf16, found ", dtype_name(c.dtype(0)));
      const int64_t in = backward ? q.rows : q.cols, out = backward ? q.cols : q.rows;
      c.require(x.rank() >= 1 && x[-1] == in, backward ? "dy" : "x", " should be (..., ", in, "), found ", x.to_string());
      const size_t bias_at = q.bias_input();
      c.require(n_in == bias_at || (!backward && n_in == bias_at + 1), "a ", q.bits, "-bit weight takes ",
                bias_at - 1, " inputs", backward ? "" : " and an optional bias", " after ", backward ? "dy" : "x",
                "; found ", n_in, " inputs in all");
      const int64_t bytes = q.bits == 4 ? q.rows * q.cols / 2 : q.rows * q.cols;
      c.require(c.dtype(1) == DType::u8 && c.shape(1).numel() == bytes, "the weight should be ", bytes, " u8 (",
                q.bits == 4 ? "two 4-bit codes a byte" : "one int8 code an element", "), found ",
                dtype_name(c.dtype(1)), " ", c.shape(1).to_string());
      const int64_t scales = q.bits == 4 ? (q.rows * q.cols + q.blocksize - 1) / q.blocksize : q.rows;
      c.require_f32(2, "absmax");
      c.require(c.shape(2).numel() == scales, "absmax should hold ", scales, " values (one per ",
                q.bits == 4 ? str("block of ", q.blocksize) : std::string("row"), "), found ", c.shape(2).to_string());
      if (q.bits == 4) {
        c.require_f32(3, "code");
        c.require(c.shape(3).numel() == 16, "code should hold the 16 values of the format, found ",
                  c.shape(3).to_string());
      }
      if (n_in == bias_at + 1) {
        c.require_f32(bias_at, "bias");
        c.require(c.shape(bias_at) == Shape{q.rows}, "bias shape ", c.shape(bias_at).to_string(), " should be (",
                  q.rows, ")");
      }
      std::vector<int64_t> dims = x.dims();
      dims.back() = out;
      return {{Shape(dims), DType::f32}};
    }
    case OpKind::PreferenceLoss:
    case OpKind::PreferenceLossBackward: {
      // logps (2P), ref_logps (2P), lengths (2P), all f32: P chosen then P rejected -> loss (); backward: dlogps
      const int at = c.op == OpKind::PreferenceLossBackward ? 1 : 0;
      if (at == 1) {
        c.require_f32(0, "dloss");
        c.require(c.shape(0).numel() == 1, "dloss should be a scalar");
      }
      for (int i = at; i < at + 3; ++i) c.require_f32(i, i == at ? "logps" : i == at + 1 ? "ref_logps" : "lengths");
      const Shape& s = c.shape(at);
      c.require(s.rank() == 1 && s[0] % 2 == 0 && s[0] > 0,
                "logps should be (2P): P chosen then P rejected sequences, found ", s.to_string());
      c.require(c.shape(at + 1) == s && c.shape(at + 2) == s, "ref_logps and lengths should be ", s.to_string());
      if (at == 1) return {{s, DType::f32}};
      return {{Shape{}, DType::f32}};
    }
    case OpKind::CtcLoss:
    case OpKind::CtcLossBackward: {
      // logits (B, T, V) f32, labels (B, L) i64, [input lengths (B) i64] -> loss (B); backward: dloss (B) first
      const int at = c.op == OpKind::CtcLossBackward ? 1 : 0;
      c.require_f32(at, "logits");
      const Shape& s = c.shape(at);
      c.require(s.rank() == 3 && s[0] > 0 && s[1] > 0 && s[2] > 0, "logits should be (batch, frames, classes), found ",
                s.to_string());
      c.require(c.dtype(at + 1) == DType::i64 && c.shape(at + 1).rank() == 2 && c.shape(at + 1)[0] == s[0],
                "labels should be i64 (", s[0], ", L), found ", c.shape(at + 1).to_string());
      if (n_in == size_t(at) + 3)
        c.require(c.dtype(at + 2) == DType::i64 && c.shape(at + 2) == Shape{s[0]}, "input lengths should be i64 (",
                  s[0], "), found ", c.shape(at + 2).to_string());
      const int64_t blank = std::get<CtcParams>(params).blank;
      c.require(blank < s[2], "blank ", blank, " is not one of the ", s[2], " classes");
      if (at == 1) {
        c.require_f32(0, "dloss");
        c.require(c.shape(0) == Shape{s[0]}, "dloss should be (", s[0], "), found ", c.shape(0).to_string());
        return {{s, DType::f32}};
      }
      return {{Shape{s[0]}, DType::f32}};
    }
    case OpKind::SigmoidCrossEntropy:
      c.require_f32(0, "logits");
      c.require_f32(1, "targets");
      c.require_same_shape(0, 1);
      return {{Shape{}, DType::f32}};
    case OpKind::SigmoidCrossEntropyBackward:
      // dloss, logits, targets -> dlogits
      c.require_f32(0, "dloss");
      c.require(c.shape(0).numel() == 1, "dloss should be a scalar");
      c.require_f32(1, "logits");
      c.require_f32(2, "targets");
      c.require(c.shape(1) == c.shape(2), "logits ", c.shape(1).to_string(), " and targets ", c.shape(2).to_string(),
                " differ");
      return {{c.shape(1), DType::f32}};
    case OpKind::Attention:
    case OpKind::AttentionBackward: {
      // Attention: q, k, v, [bias], [mask], [key_begin]; AttentionBackward: dout, q, k, v, out, lse, [bias], [mask],
      // [key_begin] (bias present when score_bias is set)
      const bool backward = c.op == OpKind::AttentionBackward;
      size_t q_at = backward ? 1 : 0;
      const auto& attention = std::get<AttentionParams>(params);
      const size_t first_extra = attention.first_extra(backward);
      c.require(n_in >= first_extra, "expected ", first_extra, " inputs before the optional mask",
                attention.score_bias ? " (score_bias: the bias follows the tensors)" : "", ", found ", n_in);
      const AttentionExtras extras =
          AttentionExtras::locate(n_in, first_extra, n_in > first_extra && c.dtype(first_extra) == DType::i64);
      const Shape& q = c.shape(q_at);
      const Shape& k = c.shape(q_at + 1);
      const Shape& v = c.shape(q_at + 2);
      // q, k, v: f32, or bf16 (mixed precision); the output: f32 unless out_dtype is "bf16". The rest f32.
      c.require(c.dtype(q_at) == DType::f32 || c.dtype(q_at) == DType::bf16, "q should be f32 or bf16, found ",
                dtype_name(c.dtype(q_at)));
      c.require_same_dtype(q_at, q_at + 1);
      c.require_same_dtype(q_at, q_at + 2);
      const DType out_dtype = attention.out_dtype;
      for (size_t i = 0; i < n_in; ++i)
        if ((i < q_at || i > q_at + 2) && !(c.op == OpKind::AttentionBackward && i == 4) &&
            static_cast<int>(i) != extras.key_begin)
          c.require_f32(i, "every input but q, k, v and key_begin");
      if (c.op == OpKind::AttentionBackward)
        c.require(c.dtype(4) == out_dtype, "out should be ", dtype_name(out_dtype), " (out_dtype), found ",
                  dtype_name(c.dtype(4)));
      const bool seq_major = attention.seq_major;  // (B, T, H, D) instead of (B, H, T, D)
      c.require(q.rank() == 4 && k.rank() == 4 && v.rank() == 4,
                seq_major ? "q, k, v should be (B, T, H, D)" : "q, k, v should be (B, H, T, D)");
      c.require(k == v, "k ", k.to_string(), " and v ", v.to_string(), " differ");
      const int64_t heads = seq_major ? q[2] : q[1], T = seq_major ? q[1] : q[2], S = seq_major ? k[1] : k[2];
      const int64_t kv_heads = seq_major ? k[2] : k[1];  // grouped-query attention: fewer key/value heads
      c.require(q[0] == k[0] && kv_heads > 0 && heads % kv_heads == 0 && q[3] == k[3], "q ", q.to_string(),
                " does not match k ", k.to_string(), " (the query heads must be a multiple of the key/value heads)");
      const double p = attention.dropout_p;
      c.require(p >= 0.0 && p < 1.0, "dropout_p must be in [0, 1)");
      if (attention.causal) c.require(T <= S, "causal attention needs T <= S");
      c.require(attention.window >= 0, "window should be >= 0 (0: no sliding window), found ", attention.window);
      c.require(attention.window == 0 || attention.causal, "a sliding window (window ", attention.window,
                ") needs causal attention");
      c.require(std::isfinite(attention.softcap) && attention.softcap >= 0.0,
                "softcap should be a finite number >= 0 (0: no soft-capping), found ", attention.softcap);
      const int64_t rng_rows = attention.stream_rows(T), rng_row_start = attention.rng_row_start;
      c.require(rng_row_start >= 0 && rng_row_start + T <= rng_rows, "dropout rows [", rng_row_start, ", ",
                rng_row_start + T, ") are outside rng_rows ", rng_rows);
      if (extras.mask >= 0) {
        const size_t mask_at = static_cast<size_t>(extras.mask);
        c.require(c.shape(mask_at) == Shape{q[0], S} || c.shape(mask_at) == Shape{q[0], heads, S},
                  "mask should be (B, S) = (", q[0], ", ", S, ") or (B, H, S) = (", q[0], ", ", heads, ", ", S,
                  "), found ", c.shape(mask_at).to_string());
      }
      if (attention.score_bias) {
        const Shape& bias = c.shape(attention.bias_input(backward));
        c.require(bias.rank() == 4 && (bias[0] == q[0] || bias[0] == 1) && (bias[1] == heads || bias[1] == 1) &&
                      bias[2] == T && bias[3] == S,
                  "the score bias should be (B|1, H|1, T, S) = (", q[0], "|1, ", heads, "|1, ", T, ", ", S,
                  "), found ", bias.to_string());
        c.require(attention.softcap == 0.0, "a score bias with softcap is not supported (which comes first is "
                  "ambiguous)");
      }
      if (extras.key_begin >= 0) {
        const size_t at = static_cast<size_t>(extras.key_begin);
        c.require(c.dtype(at) == DType::i64, "key_begin should be i64, found ", dtype_name(c.dtype(at)));
        c.require(c.shape(at) == Shape{q[0], T}, "key_begin should be (B, T) = (", q[0], ", ", T, "), found ",
                  c.shape(at).to_string());
        c.require(attention.causal, "key_begin (packed sequences) needs causal attention");
      }
      Shape lse{q[0], heads, T};
      if (c.op == OpKind::Attention) return {{q, out_dtype}, {lse, DType::f32}};
      c.require(c.shape(0) == q && c.shape(4) == q, "dout and out should be ", q.to_string());
      c.require(c.shape(5) == lse, "lse should be ", lse.to_string());
      if (attention.score_bias)  // and dS, the score bias's gradient
        return {{q, DType::f32}, {k, DType::f32}, {v, DType::f32}, {Shape{q[0], heads, T, S}, DType::f32}};
      return {{q, DType::f32}, {k, DType::f32}, {v, DType::f32}};
    }
  }
  throw Error(str(c.where(), ": no shape inference"));
}

}  // namespace

std::vector<TypedShape> infer_outputs(const Graph& g, OpKind op, const std::vector<ValueId>& inputs, const Attrs& attrs,
                                      const std::string& node_name) {
  const OpInfo& info = op_info(op);
  Checker c{g, op, inputs, node_name};
  int n = static_cast<int>(inputs.size());
  c.require(n >= info.min_inputs && (info.max_inputs < 0 || n <= info.max_inputs), "takes ", info.min_inputs,
            info.max_inputs == info.min_inputs
                ? ""
                : str(" to ", info.max_inputs < 0 ? "any" : std::to_string(info.max_inputs)),
            " inputs, found ", n);
  const OpParams params = decode_params(op, attrs, node_name);
  try {
    return infer(c, params);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind(op_name(op), 0) == 0) throw;
    throw Error(str(c.where(), ": ", msg));
  }
}

}  // namespace fusetrain::ir
