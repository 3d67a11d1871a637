// MatMul and Linear as calls into kernels/cpu/gemm, planned once per call.
//
// Legend: M, N, K matrix dims of one product; R rows of a Linear input (product of
// its leading axes); batch the product of the leading (batch) axes of a MatMul.
//
// Both kernels honour KernelArgs::accumulate themselves (beta = 1), so parameter
// gradients produced by a MatMul land in their buffers without an extra pass.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/dense_kernels.h"
#include "kernels/cpu/gemm.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {

namespace {

// a (..., M, K) x b (..., K, N) -> c (..., M, N), f32, bf16 or f16 operands, f32 result.
// trans_a: a stored (..., K, M); trans_b: b stored (..., N, K).
class MatMulKernel final : public Kernel {
 public:
  MatMulKernel(const KernelCall& call) {
    const Shape& a = call.inputs[0].shape;
    const Shape& b = call.inputs[1].shape;
    dtype_ = call.inputs[0].dtype;
    bool trans_a = call.params<ops::MatMulParams>().trans_a;
    bool trans_b = call.params<ops::MatMulParams>().trans_b;
    int64_t m = trans_a ? a[-1] : a[-2];
    int64_t k = trans_a ? a[-2] : a[-1];
    int64_t n = trans_b ? b[-2] : b[-1];
    int64_t batch_a = a.numel(0, a.rank() - 2);
    int64_t batch_b = b.numel(0, b.rank() - 2);
    shape_ = GemmShape{m, n, k, trans_a, trans_b, a[-1], b[-1], n};
    if (a.rank() > 2 && b.rank() == 2 && !trans_a) {
      // a's batch rows are contiguous (batch * M, K): one large GEMM against the shared b.
      shape_.M = batch_a * m;
      batch_ = 1;
    } else {
      batch_ = a.rank() > 2 ? batch_a : batch_b;
      stride_a_ = a.rank() > 2 ? m * k : 0;
      stride_b_ = b.rank() > 2 ? k * n : 0;
      stride_c_ = m * n;
    }
  }

  size_t scratch_bytes(int num_threads) const override {
    if (batch_ == 1) {
      if (dtype_ == DType::f16) return gemm_f16_scratch_bytes(shape_, num_threads);
      return dtype_ == DType::bf16 ? gemm_bf16_scratch_bytes(shape_, num_threads)
                                   : gemm_f32_scratch_bytes(shape_, num_threads);
    }
    if (dtype_ == DType::f16) return gemm_f16_batched_scratch_bytes(shape_, batch_, stride_a_, stride_b_, num_threads);
    return dtype_ == DType::bf16 ? gemm_bf16_batched_scratch_bytes(shape_, batch_, num_threads)
                                 : gemm_f32_batched_scratch_bytes(shape_, batch_, num_threads);
  }

  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    float beta = !args.accumulate.empty() && args.accumulate[0] ? 1.0f : 0.0f;
    const void* a = args.inputs[0].data();
    const void* b = args.inputs[1].data();
    float* c = static_cast<float*>(args.outputs[0].data());  // c: (batch, M, N)
    int threads = ctx.num_threads;
    if (batch_ == 1) {
      if (dtype_ == DType::f16)
        gemm_f16(shape_, 1.0f, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), beta, c, args.scratch,
                 threads);
      else if (dtype_ == DType::bf16)
        gemm_bf16(shape_, 1.0f, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), beta, c, args.scratch,
                  threads);
      else
        gemm_f32(shape_, 1.0f, static_cast<const float*>(a), static_cast<const float*>(b), beta, c, args.scratch,
                 threads);
      return;
    }
    if (dtype_ == DType::f16)
      gemm_f16_batched(shape_, batch_, stride_a_, stride_b_, stride_c_, 1.0f, static_cast<const uint16_t*>(a),
                       static_cast<const uint16_t*>(b), beta, c, args.scratch, threads);
    else if (dtype_ == DType::bf16)
      gemm_bf16_batched(shape_, batch_, stride_a_, stride_b_, stride_c_, 1.0f, static_cast<const uint16_t*>(a),
                        static_cast<const uint16_t*>(b), beta, c, args.scratch, threads);
    else
      gemm_f32_batched(shape_, batch_, stride_a_, stride_b_, stride_c_, 1.0f, static_cast<const float*>(a),
                       static_cast<const float*>(b), beta, c, args.scratch, threads);
  }

 private:
  DType dtype_ = DType::f32;  // of both operands
  GemmShape shape_{};
  int64_t batch_ = 1;
  int64_t stride_a_ = 0, stride_b_ = 0, stride_c_ = 0;  // elements between consecutive batch matrices
};

// y (R, N) += bias (N) on every row. Serial when threads == 1 (no OpenMP call, so the team
// size never changes between regions).
void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t n, int threads) {
  auto body = [&](int64_t r) {
    for (int64_t j = 0; j < n; ++j) y[r * n + j] += bias[j];
  };
  if (threads <= 1) {
    for (int64_t r = 0; r < rows; ++r) body(r);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) body(r);
}

// What the Linear epilogue adds to a finished strip of the product: the bias, then, for
// LinearGelu, y = gelu(z) into the second buffer (same layout as z). With a bf16 z, each row is
// rounded to bf16 into z (the Cast kernel's rounding) and, for GELU, widened back in place, and GELU is
// applied to that. A bf16 y (out_dtype) is GELU's f32 result rounded the same way. A Linear's bf16 y is its z.
struct LinearEpilogue {
  int64_t ld = 0;               // row stride of the outputs (N)
  const float* bias = nullptr;  // (N) or null
  float* y = nullptr;           // (R, N) f32 GELU output, or null
  uint16_t* y_bf16 = nullptr;   // (R, N) bf16 GELU output, or null
  uint16_t* z_bf16 = nullptr;   // (R, N) z rounded to bf16, or null (then c is z, f32)
  cpu_basic::GeluFn gelu = nullptr;
  cpu_basic::RoundBf16Fn round = nullptr;
  cpu_basic::AddRowsFn add_rows = nullptr;  // with a bias

  static void apply(const void* context, float* c, int64_t ldc, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    const LinearEpilogue& e = *static_cast<const LinearEpilogue*>(context);
    for (int64_t r = 0; r < rows; ++r) {
      float* z = c + r * ldc;
      const int64_t at = (row + r) * e.ld + col;
      if (e.bias) e.add_rows(z, e.bias + col, 0, 1, cols);
      if (e.z_bf16) {
        e.round(e.z_bf16 + at, z, cols);
        if (e.gelu) bf16_to_float(z, e.z_bf16 + at, static_cast<size_t>(cols));
      }
      if (e.y_bf16) {
        // GELU into a block of f32, then rounded: z (f32) stays intact when it is an output.
        alignas(64) float block[256];
        for (int64_t j = 0; j < cols; j += 256) {
          const int64_t n = std::min<int64_t>(256, cols - j);
          e.gelu(block, z + j, n);
          e.round(e.y_bf16 + at + j, block, n);
        }
      } else if (e.y) {
        e.gelu(e.y + at, z, cols);  // in place when c is y's buffer (bf16 z)
      }
    }
  }
};

// Linear: y (R, N) = x (R, K) · w (N, K)ᵀ + bias (N). LinearGelu: z = the same, output 1, and
// y = gelu(z), output 0. x and w f32, bf16 or f16; y and z f32 or bf16 (rounded by the epilogue, so the f32
// product never reaches memory). The bias, the GELU and the rounding are the GEMM's epilogue, applied to each strip
// of rows as it is finished, while it is in cache; only an accumulating Linear (y += ..., f32, never LinearGelu)
// adds its bias in a pass of its own.
class LinearKernel final : public Kernel {
 public:
  LinearKernel(const KernelCall& call) {
    const Shape& x = call.inputs[0].shape;
    const Shape& w = call.inputs[1].shape;
    dtype_ = call.inputs[0].dtype;
    has_bias_ = call.inputs.size() == 3;
    if (call.op == OpKind::LinearGelu) {
      gelu_ = cpu_basic::gelu_fn(call.params<ops::LinearGeluParams>().approximate == ops::GeluApproximation::Tanh);
      z_bf16_ = call.outputs[1].dtype == DType::bf16;
      y_bf16_ = call.outputs[0].dtype == DType::bf16;
    } else {
      z_bf16_ = y_bf16_ = call.outputs[0].dtype == DType::bf16;  // a Linear's y is its z
    }
    if (z_bf16_ || y_bf16_) round_ = cpu_basic::round_to_bf16_fn();
    add_rows_ = cpu_basic::add_rows_fn();
    int64_t k = x[-1];
    int64_t n = w[0];
    int64_t rows = x.numel(0, x.rank() - 1);
    shape_ = GemmShape{rows, n, k, false, true, k, k, n};
  }

  // With z and y both bf16 the f32 product has no output buffer to live in: the GEMM hands each
  // strip to the epilogue from a buffer of its own when K fits one pass (gemm_strip_max_k), else
  // the product goes to scratch.
  bool product_in_scratch() const {
    return z_bf16_ && y_bf16_ && (shape_.K == 0 || shape_.K > gemm_strip_max_k(dtype_ == DType::bf16));
  }
  size_t product_bytes() const {
    return product_in_scratch() ? (static_cast<size_t>(shape_.M * shape_.N) * sizeof(float) + 63) / 64 * 64 : 0;
  }

  size_t scratch_bytes(int num_threads) const override {
    const size_t gemm = dtype_ == DType::f16    ? gemm_f16_scratch_bytes(shape_, num_threads)
                        : dtype_ == DType::bf16 ? gemm_bf16_scratch_bytes(shape_, num_threads)
                                                : gemm_f32_scratch_bytes(shape_, num_threads);
    return product_bytes() + gemm;
  }

  bool accumulates() const override { return gelu_ == nullptr && !y_bf16_; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const bool accumulate = accumulates() && !args.accumulate.empty() && args.accumulate[0];
    // The product: an f32 y (Linear) or z (LinearGelu), else y's buffer when y is f32, else scratch when K takes more
    // than one pass, else none (each strip in the GEMM's own buffer).
    char* scratch = static_cast<char*>(args.scratch);
    float* c = nullptr;
    if (!z_bf16_ && !y_bf16_)
      c = static_cast<float*>(args.outputs[gelu_ ? 1 : 0].data());
    else if (!z_bf16_)
      c = static_cast<float*>(args.outputs[1].data());
    else if (!y_bf16_)
      c = static_cast<float*>(args.outputs[0].data());
    else if (product_in_scratch())
      c = reinterpret_cast<float*>(scratch);  // 64-byte aligned, product_bytes() long
    void* gemm_scratch = scratch + product_bytes();
    const float* bias = has_bias_ ? static_cast<const float*>(args.inputs[2].data()) : nullptr;  // bias: (N)
    LinearEpilogue fused;
    fused.ld = shape_.N;
    fused.bias = accumulate ? nullptr : bias;
    fused.add_rows = add_rows_;
    fused.round = round_;
    if (gelu_) {
      fused.gelu = gelu_;
      if (y_bf16_)
        fused.y_bf16 = static_cast<uint16_t*>(args.outputs[0].data());
      else
        fused.y = static_cast<float*>(args.outputs[0].data());
      if (z_bf16_) fused.z_bf16 = static_cast<uint16_t*>(args.outputs[1].data());
    } else if (y_bf16_) {
      fused.z_bf16 = static_cast<uint16_t*>(args.outputs[0].data());
    }
    const GemmEpilogue epilogue{&LinearEpilogue::apply, &fused};
    const GemmEpilogue* ep = fused.bias || gelu_ || fused.z_bf16 ? &epilogue : nullptr;
    const float beta = accumulate ? 1.0f : 0.0f;
    const int threads = ctx.num_threads;
    if (dtype_ == DType::f16)
      gemm_f16(shape_, 1.0f, static_cast<const uint16_t*>(args.inputs[0].data()),
               static_cast<const uint16_t*>(args.inputs[1].data()), beta, c, gemm_scratch, threads, ep);
    else if (dtype_ == DType::bf16)
      gemm_bf16(shape_, 1.0f, static_cast<const uint16_t*>(args.inputs[0].data()),
                static_cast<const uint16_t*>(args.inputs[1].data()), beta, c, gemm_scratch, threads, ep);
    else
      gemm_f32(shape_, 1.0f, static_cast<const float*>(args.inputs[0].data()),
               static_cast<const float*>(args.inputs[1].data()), beta, c, gemm_scratch, threads, ep);
    if (bias && accumulate) {
      const bool parallel = shape_.M * shape_.N >= (int64_t{1} << 16) && threads > 1;
      add_bias_rows(c, bias, shape_.M, shape_.N, parallel ? threads : 1);
    }
  }

 private:
  DType dtype_ = DType::f32;  // of x and w
  bool has_bias_ = false;
  cpu_basic::GeluFn gelu_ = nullptr;         // LinearGelu's activation; null for Linear
  bool z_bf16_ = false, y_bf16_ = false;     // LinearGelu's z and y dtypes (a Linear's y, which is its z: both)
  cpu_basic::RoundBf16Fn round_ = nullptr;  // when either is bf16
  cpu_basic::AddRowsFn add_rows_ = nullptr;
  GemmShape shape_{};
};

// What MatMulGeluBackward's epilogue does to each finished strip of dy = a·b: dy·gelu′(x) in place, as GeluBackward
// computes it, then written as dx (rounded to bf16 as Cast rounds, or already in place when the strip is dx's own
// f32 rows); gelu(x), as Gelu computes and rounds it; each row of dx added into its block's row of `partials`
// (blocks of kColumnSumRows rows: the GEMM hands one thread a block's strips in row order, GemmEpilogue::row_align),
// the column sums' first phase in ReduceSum's order. x is read once, a block at a time.
struct GeluBackwardEpilogue {
  int64_t ld = 0;                    // N: the row stride of x, dx and gelu(x)
  const float* x = nullptr;          // (R, N) f32, or
  const uint16_t* x_bf16 = nullptr;  // (R, N) bf16
  uint16_t* dx_bf16 = nullptr;       // (R, N) bf16, or null: dx is f32 and C itself
  float* partials = nullptr;         // (blocks, N) column sums of each block of rows, or null
  float* y = nullptr;                // (R, N) gelu(x) f32, or
  uint16_t* y_bf16 = nullptr;        // (R, N) gelu(x) bf16, or neither
  cpu_basic::GeluBackwardFn backward = nullptr;
  cpu_basic::GeluPairFn pair = nullptr;  // with y or y_bf16
  cpu_basic::RoundBf16Fn round = nullptr;
  cpu_basic::AddRowsFn add_rows = nullptr;  // with partials

  static constexpr int64_t kBlock = 256;

  static void apply(const void* context, float* c, int64_t ldc, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    const GeluBackwardEpilogue& e = *static_cast<const GeluBackwardEpilogue*>(context);
    alignas(64) float xb[kBlock];
    alignas(64) float yb[kBlock];
    for (int64_t r = 0; r < rows; ++r) {
      float* g = c + r * ldc;
      const int64_t at = (row + r) * e.ld + col;
      for (int64_t j = 0; j < cols; j += kBlock) {
        const int64_t n = std::min(kBlock, cols - j);
        const float* xf = e.x ? e.x + at + j : xb;
        if (!e.x) bf16_to_float(xb, e.x_bf16 + at + j, static_cast<size_t>(n));
        if (e.y)
          e.pair(g + j, e.y + at + j, g + j, xf, n);
        else if (e.y_bf16)
          e.pair(g + j, yb, g + j, xf, n);
        else
          e.backward(g + j, g + j, xf, n);
        if (e.dx_bf16) e.round(e.dx_bf16 + at + j, g + j, n);
        if (e.y_bf16) e.round(e.y_bf16 + at + j, yb, n);
      }
    }
    if (!e.partials) return;
    // The strip's rows in order into their block's partial, a run of rows of one block at a time.
    for (int64_t r = 0; r < rows;) {
      const int64_t block = (row + r) / cpu_basic::kColumnSumRows;
      const int64_t run = std::min(rows - r, (block + 1) * cpu_basic::kColumnSumRows - (row + r));
      float* part = e.partials + block * e.ld + col;
      if ((row + r) % cpu_basic::kColumnSumRows == 0) std::memset(part, 0, static_cast<size_t>(cols) * sizeof(float));
      e.add_rows(part, c + r * ldc, ldc, run, cols);
      r += run;
    }
  }
};

// MatMulGeluBackward: dy = a·b as one GEMM (a (R, K) or stored (K, R), b 2-D), and the GELU backward that reads it
// as its epilogue (GeluBackwardEpilogue), so dy never reaches memory. dx f32 is the GEMM's own output, transformed in
// place; a bf16 dx has no f32 product stored at all when K fits one pass (gemm_strip_max_k), else the product goes
// to scratch. The column sums are ReduceSum's bits (cpu_basic::kColumnSumRows), for any thread count or split.
class MatMulGeluBackwardKernel final : public Kernel {
 public:
  MatMulGeluBackwardKernel(const KernelCall& call) : p_(call.params<ops::MatMulGeluBackwardParams>()) {
    const Shape& a = call.inputs[0].shape;
    const Shape& b = call.inputs[1].shape;
    bf16_ = call.inputs[0].dtype == DType::bf16;
    x_bf16_ = call.inputs[2].dtype == DType::bf16;
    const int64_t k = p_.trans_b ? b[1] : b[0], n = p_.trans_b ? b[0] : b[1];
    const int64_t m = call.inputs[2].shape.numel() / n;
    shape_ = GemmShape{m, n, k, p_.trans_a, p_.trans_b, a[-1], b[-1], n};
    backward_ = cpu_basic::gelu_backward_fn(p_.approximate == ops::GeluApproximation::Tanh);
    if (p_.gelu_out) pair_ = cpu_basic::gelu_pair_fn(p_.approximate == ops::GeluApproximation::Tanh);
    round_ = cpu_basic::round_to_bf16_fn();
    add_rows_ = cpu_basic::add_rows_fn();
  }

  bool product_in_scratch() const {
    return p_.out_dtype == DType::bf16 && (shape_.K == 0 || shape_.K > gemm_strip_max_k(bf16_));
  }
  size_t product_bytes() const { return product_in_scratch() ? floats_bytes(shape_.M * shape_.N) : 0; }
  int64_t blocks() const { return (shape_.M + cpu_basic::kColumnSumRows - 1) / cpu_basic::kColumnSumRows; }
  size_t partial_bytes() const { return p_.column_sum ? floats_bytes(blocks() * shape_.N) : 0; }

  size_t scratch_bytes(int num_threads) const override {
    return product_bytes() + partial_bytes() +
           (bf16_ ? gemm_bf16_scratch_bytes(shape_, num_threads) : gemm_f32_scratch_bytes(shape_, num_threads));
  }

  // Only the column sums may add into a gradient: dx and gelu(x) are read by later nodes, never accumulated.
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    for (size_t i = 0; i < args.accumulate.size(); ++i)
      FT_CHECK(!args.accumulate[i] || (p_.column_sum && i == 1),
               "MatMulGeluBackward: only the column sums (output 1) may add into their buffer, not output ", i);
    char* scratch = static_cast<char*>(args.scratch);
    GeluBackwardEpilogue e;
    e.ld = shape_.N;
    if (x_bf16_)
      e.x_bf16 = static_cast<const uint16_t*>(args.inputs[2].data());
    else
      e.x = static_cast<const float*>(args.inputs[2].data());
    float* c = nullptr;  // the product's buffer: dx itself, scratch, or none (strips)
    if (p_.out_dtype == DType::f32)
      c = static_cast<float*>(args.outputs[0].data());
    else
      e.dx_bf16 = static_cast<uint16_t*>(args.outputs[0].data());
    if (product_in_scratch()) c = reinterpret_cast<float*>(scratch);
    if (p_.column_sum) e.partials = reinterpret_cast<float*>(scratch + product_bytes());
    if (p_.gelu_out) {
      e.pair = pair_;
      void* y = args.outputs[p_.column_sum ? 2 : 1].data();
      if (p_.gelu_dtype == DType::bf16)
        e.y_bf16 = static_cast<uint16_t*>(y);
      else
        e.y = static_cast<float*>(y);
    }
    e.backward = backward_;
    e.round = round_;
    e.add_rows = add_rows_;
    // Column sums need each block of rows finished by one thread, in order.
    const GemmEpilogue epilogue{&GeluBackwardEpilogue::apply, &e, p_.column_sum ? cpu_basic::kColumnSumRows : 1};
    void* gemm_scratch = scratch + product_bytes() + partial_bytes();
    const int threads = ctx.num_threads;
    if (bf16_)
      gemm_bf16(shape_, 1.0f, static_cast<const uint16_t*>(args.inputs[0].data()),
                static_cast<const uint16_t*>(args.inputs[1].data()), 0.0f, c, gemm_scratch, threads, &epilogue);
    else
      gemm_f32(shape_, 1.0f, static_cast<const float*>(args.inputs[0].data()),
               static_cast<const float*>(args.inputs[1].data()), 0.0f, c, gemm_scratch, threads, &epilogue);
    if (p_.column_sum)
      cpu_basic::sum_column_blocks(static_cast<float*>(args.outputs[1].data()), e.partials, 1, blocks(), shape_.N, 1.0f,
                                   args.accumulate.size() > 1 && args.accumulate[1], threads);
  }

 private:
  static size_t floats_bytes(int64_t n) { return (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64; }

  ops::MatMulGeluBackwardParams p_;
  bool bf16_ = false, x_bf16_ = false;
  GemmShape shape_{};
  cpu_basic::GeluBackwardFn backward_ = nullptr;
  cpu_basic::GeluPairFn pair_ = nullptr;
  cpu_basic::RoundBf16Fn round_ = nullptr;
  cpu_basic::AddRowsFn add_rows_ = nullptr;
};

}  // namespace

std::unique_ptr<Kernel> make_cpu_matmul_kernel(const KernelCall& call) {
  switch (call.op) {
    case OpKind::MatMul:
      // A bf16 result is rare (inference casts); the reference kernel covers it.
      if (call.outputs[0].dtype != DType::f32) return nullptr;
      return std::make_unique<MatMulKernel>(call);
    case OpKind::Linear:
    case OpKind::LinearGelu:
      return std::make_unique<LinearKernel>(call);
    case OpKind::MatMulGeluBackward:
      return std::make_unique<MatMulGeluBackwardKernel>(call);
    default:
      return nullptr;
  }
}

// QuantizedLinear (y = x·Wᵀ + bias) and its backward (dx = dy·W) with W a quantised weight: the GEMM
// dequantises W as it packs its panels (gemm_quant4), so no dequantised copy of the weight exists.
class QuantizedLinearKernel final : public Kernel {
 public:
  QuantizedLinearKernel(const KernelCall& call)
      : params_(call.params<ops::QuantizedParams>()),
        bf16_(call.inputs[0].dtype == DType::bf16),
        has_bias_(call.inputs.size() > params_.bias_input()) {
    const bool backward = call.op == OpKind::QuantizedLinearBackward;
    const Shape& x = call.inputs[0].shape;
    const int64_t k = x[-1], n = backward ? params_.cols : params_.rows;
    shape_ = GemmShape{x.numel() / k, n, k, false, !backward, k, 0, n};
  }

  size_t scratch_bytes(int num_threads) const override { return gemm_quant4_scratch_bytes(shape_, num_threads); }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const quant::QuantMatrix w = params_.matrix(args.inputs[1].data(), args.inputs[2].data_as<float>(),
                                                params_.bits == 4 ? args.inputs[3].data_as<float>() : nullptr);
    float* y = static_cast<float*>(args.outputs[0].data());
    if (bf16_)
      gemm_quant4_bf16(shape_, static_cast<const uint16_t*>(args.inputs[0].data()), w, y, args.scratch,
                       ctx.num_threads);
    else
      gemm_quant4_f32(shape_, args.inputs[0].data_as<float>(), w, y, args.scratch, ctx.num_threads);
    if (has_bias_) {
      const float* bias = args.inputs[params_.bias_input()].data_as<float>();
      for (int64_t r = 0; r < shape_.M; ++r)
        for (int64_t j = 0; j < shape_.N; ++j) y[r * shape_.N + j] += bias[j];
    }
    if (params_.round_output)
      for (int64_t i = 0; i < shape_.M * shape_.N; ++i) y[i] = bf16_to_float(float_to_bf16(y[i]));
  }

 private:
  ops::QuantizedParams params_;
  bool bf16_, has_bias_;
  GemmShape shape_{};
};

std::unique_ptr<Kernel> make_cpu_dense_kernel(const KernelCall& call) {
  switch (call.op) {
    case OpKind::MatMul:
    case OpKind::Linear:
    case OpKind::LinearGelu:
    case OpKind::MatMulGeluBackward:
      return make_cpu_matmul_kernel(call);
    case OpKind::Attention:
    case OpKind::AttentionBackward:
      return make_cpu_attention_kernel(call);
    case OpKind::LinearCrossEntropy:
      return make_cpu_linear_cross_entropy_kernel(call);
    case OpKind::LinearLogProbs:
    case OpKind::LinearLogProbsWeightGrad:
      return make_cpu_linear_log_probs_kernel(call);
    case OpKind::QuantizedLinear:
    case OpKind::QuantizedLinearBackward:
      return std::make_unique<QuantizedLinearKernel>(call);
    case OpKind::Conv:
    case OpKind::ConvBackwardData:
    case OpKind::ConvBackwardWeight:
      return make_cpu_conv_kernel(call);
    default:
      return nullptr;
  }
}

}  // namespace fusetrain::kernels
