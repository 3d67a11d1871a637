// Internal header of the tuned CPU kernels for everything but the dense ops
// (kernels/cpu/registry_cpu.cpp dispatches): one factory per family, the code-path
// choice (AVX-512 or portable), and the OpenMP row-splitting helper they share.
//
// Shape letters: B batch, T sequence, C channels, H heads, D head size,
// V vocabulary, R rows (product of all leading axes).
//
// Every factory returns null for a dtype combination it does not optimise; the
// CPU device then binds the plain reference kernel (kernels/ref).
#pragma once

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>

#include "fusetrain/core/shape.h"
#include "fusetrain/kernels/device.h"
#include "fusetrain/kernels/device.h"

namespace fusetrain::kernels::cpu_basic {

// ---- code path -----------------------------------------------------------------

/// True when run() should take the AVX-512 path: the CPU has AVX-512 F/BW/VL/DQ and
/// FMA, and the portable path is not forced. Kernels read it once, at construction.
bool use_avx512();

/// True when a kernel that has an AVX2 + FMA path but no AVX-512 one for this CPU (use_avx512() false)
/// should take it: the CPU has both and the path is not capped below AVX2.
bool use_avx2();

/// Forces (true) or releases (false) the portable scalar path for kernels created
/// afterwards. Initialised from FUSETRAIN_KERNELS=portable in the environment.
void force_portable_path(bool portable);

/// The widest instruction set a kernel's path may use.
enum class CpuPath { portable, avx2, avx512 };
/// Caps the path of kernels created afterwards (avx512: no cap). FUSETRAIN_KERNELS=portable or avx2 sets it at start.
void cap_cpu_path(CpuPath cap);

/// The variant of a kernel with portable, AVX2 and AVX-512 code for the current path (read at construction).
template <typename Fn>
Fn pick_path(Fn portable, Fn avx2, Fn avx512) {
  return use_avx512() ? avx512 : use_avx2() ? avx2 : portable;
}

// ---- threading -------------------------------------------------------------------

/// Below this many elements of work a kernel runs on the calling thread.
constexpr int64_t kMinParallelWork = 16384;

/// Threads worth using for `work` elements, at most `num_threads`.
/// Either 1 (run serially, no OpenMP call at all) or the whole team: libgomp
/// allocates when consecutive parallel regions change team size, and a
/// training step must not allocate.
inline int threads_for(int64_t work, int num_threads) {
  if (work < kMinParallelWork || num_threads <= 1) return 1;
  return num_threads;
}

/// Splits [0, n) into `threads` contiguous static chunks whose boundaries are
/// multiples of `align`, and calls fn(begin, end, thread) for each, in parallel
/// when threads > 1. fn must not throw.
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn&& fn, int64_t align = 1) {
  if (n <= 0) return;
  const int64_t units = (n + align - 1) / align;
  if (threads <= 1 || units <= 1) {
    fn(int64_t{0}, n, 0);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    const int64_t begin = std::min(n, units * t / nt * align);
    const int64_t end = std::min(n, units * (t + 1) / nt * align);
    if (begin < end) fn(begin, end, static_cast<int>(t));
  }
}

/// The two phases of a kernel whose threads each sum per-column partials over their share of the rows:
/// rows(t, nt) on every thread, then, once all have finished, columns(t, nt) on every thread (which adds the
/// nt partials in thread order, so the result is deterministic for a given thread count). One thread: both on
/// the calling thread, without entering OpenMP. Neither may throw.
template <typename Rows, typename Columns>
void rows_then_columns(int threads, Rows&& rows, Columns&& columns) {
  if (threads <= 1) {
    rows(0, 1);
    columns(0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    rows(t, nt);
#pragma omp barrier
    columns(t, nt);
  }
}

/// Column sums over many rows (ReduceSum over leading axes, CastColumnSum, MatMulGeluBackward's bias gradient) add in
/// one order whatever the thread count: blocks of this many rows, each summed in row order from 0, then the blocks'
/// sums in block order from 0. 84 rows are whole strips of every GEMM tile height (4, 6, 14), so a GEMM epilogue
/// that sees a block's strips in order on one thread (GemmEpilogue::row_align) forms the same sums.
inline constexpr int64_t kColumnSumRows = 84;

/// Whether output i of this call adds into its destination.
inline bool accumulate_flag(const KernelArgs& args, size_t i) {
  return i < args.accumulate.size() && args.accumulate[i] != 0;
}

// ---- strided walks (broadcasting, permutations) -------------------------------------

/// Largest rank the strided kernels handle after merging axes; beyond it the
/// factories return null.
constexpr int kMaxRank = 8;

/// Up to two operand strides per axis over a row-major iteration space of
/// `rank` axes (axes that can be merged already merged).
struct StridedSpace {
  int rank = 0;
  std::array<int64_t, kMaxRank> dims{};
  std::array<int64_t, kMaxRank> stride_a{};
  std::array<int64_t, kMaxRank> stride_b{};
};

/// Iteration space of `out` with operand a (and b) broadcast to it by numpy
/// rules, with adjacent axes merged where both operands allow. False if the
/// merged rank exceeds kMaxRank.
bool broadcast_space(const Shape& out, const Shape& a, const Shape* b, StridedSpace* space);

/// Walks the flat output range [begin, end) of `space` (begin, end in output
/// elements) as contiguous runs along the last axis: fn(position, offset_a,
/// offset_b, length) per run, offsets in elements of a and b. The runs' own
/// strides are space.stride_a / stride_b [rank - 1].
template <typename Fn>
void for_each_run(const StridedSpace& space, int64_t begin, int64_t end, Fn&& fn) {
  const int rank = space.rank;
  const int64_t inner = space.dims[rank - 1];
  if (begin >= end || inner <= 0) return;
  std::array<int64_t, kMaxRank> index{};
  int64_t row = begin / inner, column = begin % inner;
  int64_t offset_a = 0, offset_b = 0;
  for (int axis = rank - 2; axis >= 0; --axis) {
    index[axis] = row % space.dims[axis];
    row /= space.dims[axis];
    offset_a += index[axis] * space.stride_a[axis];
    offset_b += index[axis] * space.stride_b[axis];
  }
  for (int64_t position = begin; position < end;) {
    const int64_t length = std::min(inner - column, end - position);
    fn(position, offset_a + column * space.stride_a[rank - 1], offset_b + column * space.stride_b[rank - 1], length);
    position += length;
    column = 0;
    for (int axis = rank - 2; axis >= 0; --axis) {
      offset_a += space.stride_a[axis];
      offset_b += space.stride_b[axis];
      if (++index[axis] < space.dims[axis]) break;
      offset_a -= space.stride_a[axis] * space.dims[axis];
      offset_b -= space.stride_b[axis] * space.dims[axis];
      index[axis] = 0;
    }
  }
}

// ---- family factories (registry_cpu.cpp dispatches) ------------------------------------

// elementwise.cpp: Fill Add Sub Mul Div Scale Copy Cast
std::unique_ptr<Kernel> make_fill_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_binary_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_scale_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_copy_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_cast_kernel(const KernelCall& call);
// activation.cpp: Gelu Tanh Relu and their backward ops
std::unique_ptr<Kernel> make_activation_kernel(const KernelCall& call);
/// out[i] = GELU(x[i]) for i < n, on the calling thread (out may equal x).
using GeluFn = void (*)(float* out, const float* x, int64_t n);
/// The GELU of the current code path: the erf form, or the tanh approximation when
/// `tanh_form`. Read at kernel construction, like use_avx512().
GeluFn gelu_fn(bool tanh_form);
/// out[i] = dy[i]·GELU′(x[i]) for i < n, on the calling thread (out may equal dy): GeluBackward's arithmetic.
using GeluBackwardFn = void (*)(float* out, const float* dy, const float* x, int64_t n);
GeluBackwardFn gelu_backward_fn(bool tanh_form);
/// y[i] = GELU(x[i]) and dx[i] = dy[i]·GELU′(x[i]) in one pass, the bits of gelu_fn and gelu_backward_fn (dx may
/// equal dy).
using GeluPairFn = void (*)(float* dx, float* y, const float* dy, const float* x, int64_t n);
GeluPairFn gelu_pair_fn(bool tanh_form);
using RoundBf16Fn = void (*)(uint16_t* out, const float* x, int64_t n);
/// f32 -> bf16 as the Cast kernel of the current code path rounds it (elementwise.cpp).
RoundBf16Fn round_to_bf16_fn();
std::unique_ptr<Kernel> make_activation_backward_kernel(const KernelCall& call);
// softmax.cpp
std::unique_ptr<Kernel> make_softmax_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_softmax_backward_kernel(const KernelCall& call);
// layernorm.cpp (LayerNorm, AddLayerNorm)
std::unique_ptr<Kernel> make_layernorm_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_layernorm_backward_kernel(const KernelCall& call);
// llama_ops.cpp: RMSNorm, RMSNormBackward, RoPE, SwiGLU, SwiGLUBackward
std::unique_ptr<Kernel> make_rmsnorm_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_rmsnorm_backward_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_rope_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_swiglu_kernel(const KernelCall& call);
// embedding.cpp
/// Pool and PoolBackward (f32, planes across threads).
std::unique_ptr<Kernel> make_pool_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_embedding_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_embedding_backward_kernel(const KernelCall& call);
// dropout.cpp
std::unique_ptr<Kernel> make_dropout_kernel(const KernelCall& call);
/// y[i] = dropout(x)[i], plus residual[i] when residual is not null, for i in [0, n), element i
/// drawing stream index first + i; `scale` is float(1 / (1 - p)). The Dropout kernel's own loop
/// for the current code path, so bit for bit its result.
using DropoutRangeFn = void (*)(float* y, const float* x, const float* residual, int64_t n, uint64_t first,
                                uint64_t seed, uint64_t offset, float p, float scale);
DropoutRangeFn dropout_range_fn();
// movement.cpp: Reshape Transpose Split Concat Slice SliceBackward ExpandTo
std::unique_ptr<Kernel> make_reshape_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_transpose_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_split_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_concat_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_slice_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_slice_backward_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_expand_to_kernel(const KernelCall& call);
// reduce.cpp: ReduceSum ReduceMean ReduceSumTo, CastColumnSum
/// acc[c] += x[r·row_stride + c] for each row r < rows in order, c < width (row_stride 0 adds one vector `rows`
/// times): the column sums' inner loop, vectorised for the current code path.
using AddRowsFn = void (*)(float* acc, const float* x, int64_t row_stride, int64_t rows, int64_t width);
AddRowsFn add_rows_fn();
/// Column sums' second phase (kColumnSumRows): out (outer, width) = scale · the sum of each output's `blocks` partials,
/// partials (outer, blocks, width), added in block order from 0 (into out with `accumulate`).
void sum_column_blocks(float* out, const float* partials, int64_t outer, int64_t blocks, int64_t width, float scale,
                       bool accumulate, int threads);
std::unique_ptr<Kernel> make_reduce_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_cast_column_sum_kernel(const KernelCall& call);
// loss.cpp
std::unique_ptr<Kernel> make_cross_entropy_kernel(const KernelCall& call);
std::unique_ptr<Kernel> make_cross_entropy_backward_kernel(const KernelCall& call);
/// The row pieces of SoftmaxCrossEntropy for the current code path, which LinearCrossEntropy
/// shares so that its loss and gradients match the unfused ops. lse = log Σ_v exp(x[v]);
/// softmax_grad writes d[v] = exp(x[v] - lse) * scale (d may be x).
using RowLseFn = float (*)(const float* x, int64_t V);
using RowSoftmaxGradFn = void (*)(float* d, const float* x, int64_t V, float lse, float scale);
RowLseFn row_lse_fn();
/// One row's token statistics (TokenStats): its softmax entropy lse − Σ exp(x − lse)·x, and whether x[target] is
/// its first largest value.
struct RowStats {
  float entropy;
  bool top1;
};
using RowStatsFn = RowStats (*)(const float* x, int64_t V, float lse, int64_t target);
RowStatsFn row_stats_fn();
RowSoftmaxGradFn row_softmax_grad_fn();
/// Target i of an i64 (`i64`) or i32 target tensor.
inline int64_t load_target(const void* targets, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(targets)[i] : static_cast<const int32_t*>(targets)[i];
}
/// Rows whose target is not ignore_index; throws, naming `op` and `node`, on a target outside [0, V).
int64_t count_targets(const char* op, const std::string& node, const void* targets, bool i64, int64_t N, int64_t V,
                      int64_t ignore_index);

// ---- the call's tensors, read at construction ------------------------------------------

inline const Shape& input_shape(const KernelCall& call, size_t i) { return call.inputs[i].shape; }
inline DType input_dtype(const KernelCall& call, size_t i) { return call.inputs[i].dtype; }
inline const Shape& output_shape(const KernelCall& call, size_t i) {
  return call.outputs[i].shape;
}
inline DType output_dtype(const KernelCall& call, size_t i) { return call.outputs[i].dtype; }

}  // namespace fusetrain::kernels::cpu_basic
