// Tuned data movement for any dtype (bytes are moved, never converted):
// Reshape, Transpose, Split, Concat, Slice, SliceBackward, ExpandTo.
//
// Shape legend: O outer (product of the axes before `axis`), A the extent of
// `axis`, I inner (product of the axes after it), E bytes per element.
//   Slice/Split/Concat/SliceBackward move rows: a (O, A_part * I * E) byte block
//   at column start * I * E of a (O, A * I * E) block.
//   Transpose merges input axes that stay adjacent, then either copies runs
//   (the last input axis stays last, e.g. (B, T, H, D) -> (B, H, T, D)) or
//   transposes 16x16 tiles between the last output axis and the output axis
//   that holds the last input axis (e.g. (..., M, N) -> (..., N, M)).
//   ExpandTo walks the merged broadcast space: a run is a memcpy or a fill.
#include <immintrin.h>

#include <cstring>
#include <utility>

#include "kernels/cpu/basic_kernels.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// rows x row_bytes: dst row r at dst + r * dst_stride gets src row r (src null: zeros).
void move_rows(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t rows, int64_t row_bytes,
               int num_threads) {
  const int64_t total = rows * row_bytes;
  if (total <= 0) return;
  parallel_for(
      total, threads_for(total / 4, num_threads),
      [&](int64_t begin, int64_t end, int) {
        int64_t r = begin / row_bytes, column = begin % row_bytes;
        for (int64_t at = begin; at < end; ++r, column = 0) {
          const int64_t length = std::min(row_bytes - column, end - at);
          if (src != nullptr)
            std::memcpy(dst + r * dst_stride + column, src + r * src_stride + column, length);
          else
            std::memset(dst + r * dst_stride + column, 0, length);
          at += length;
        }
      },
      64);
}

// ---- Reshape -------------------------------------------------------------------------------

class ReshapeKernel final : public Kernel {
 public:
  explicit ReshapeKernel(int64_t bytes) : bytes_(bytes) {}
  void run(const KernelArgs& args, const StepContext& ctx) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    if (out == x) return;  // the usual case: an alias
    move_rows(static_cast<char*>(out), 0, static_cast<const char*>(x), 0, 1, bytes_, ctx.num_threads);
  }

 private:
  int64_t bytes_;
};

// ---- Slice, Split, Concat, SliceBackward -------------------------------------------------------

// One piece along `axis`: rows of piece_bytes at byte column column_bytes of full rows.
struct Piece {
  int64_t column_bytes, piece_bytes;
};

struct AxisLayout {
  int64_t outer = 1;        // O
  int64_t full_bytes = 0;   // A * I * E
  int64_t inner_bytes = 0;  // I * E
};

AxisLayout axis_layout(const Shape& full, int64_t axis, size_t element_size) {
  AxisLayout layout;
  layout.outer = full.numel(0, axis);
  layout.inner_bytes = full.numel(axis + 1, full.rank()) * static_cast<int64_t>(element_size);
  layout.full_bytes = full[axis] * layout.inner_bytes;
  return layout;
}

// Slice, Split (pieces -> outputs) and Concat (inputs -> pieces).
class PiecesKernel final : public Kernel {
 public:
  PiecesKernel(AxisLayout layout, std::vector<Piece> pieces, bool gather)
      : layout_(layout), pieces_(std::move(pieces)), gather_(gather) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& piece = pieces_[i];
      if (gather_) {  // Concat: input i -> columns of output 0
        char* out = static_cast<char*>(args.outputs[0].data()) + piece.column_bytes;
        move_rows(out, layout_.full_bytes, static_cast<const char*>(args.inputs[i].data()), piece.piece_bytes,
                  layout_.outer, piece.piece_bytes, ctx.num_threads);
      } else {  // Slice / Split: columns of input 0 -> output i
        const char* x = static_cast<const char*>(args.inputs[0].data()) + piece.column_bytes;
        move_rows(static_cast<char*>(args.outputs[i].data()), piece.piece_bytes, x, layout_.full_bytes, layout_.outer,
                  piece.piece_bytes, ctx.num_threads);
      }
    }
  }

 private:
  AxisLayout layout_;
  std::vector<Piece> pieces_;
  bool gather_;
};

// out = zeros of the full shape with dy at [start, end) along axis.
class SliceBackwardKernel final : public Kernel {
 public:
  SliceBackwardKernel(AxisLayout layout, Piece piece) : layout_(layout), piece_(piece) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    char* out = static_cast<char*>(args.outputs[0].data());
    const char* dy = static_cast<const char*>(args.inputs[0].data());
    const int64_t after = piece_.column_bytes + piece_.piece_bytes;
    move_rows(out, layout_.full_bytes, nullptr, 0, layout_.outer, piece_.column_bytes, ctx.num_threads);
    move_rows(out + piece_.column_bytes, layout_.full_bytes, dy, piece_.piece_bytes, layout_.outer, piece_.piece_bytes,
              ctx.num_threads);
    move_rows(out + after, layout_.full_bytes, nullptr, 0, layout_.outer, layout_.full_bytes - after, ctx.num_threads);
  }

 private:
  AxisLayout layout_;
  Piece piece_;
};

// ---- Transpose ----------------------------------------------------------------------------------

constexpr int64_t kTile = 16;

// dst row k (8 floats at dst + k·dst_stride) = column k of the 8 rows src + r·src_stride: an 8x8 f32 transpose in
// AVX registers (unpack pairs, shuffle quads, swap 128-bit halves). On the f32 tiles of (B, C, H·W) <-> (B, H·W, C)
// it is ~3x the scalar tile loop (ConvNeXt's channel permutes, bench/RESULTS.md "Convolution kernels").
__attribute__((target("avx2"))) void transpose8x8_avx2(const float* src, int64_t src_stride, float* dst,
                                                        int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + k * src_stride);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}

template <typename T>
class TransposeKernel final : public Kernel {
 public:
  // space: output dims with the input stride of each output axis in stride_a.
  explicit TransposeKernel(const StridedSpace& space) : space_(space) {
    const int r = space_.rank;
    out_stride_[r - 1] = 1;
    for (int i = r - 2; i >= 0; --i) out_stride_[i] = out_stride_[i + 1] * space_.dims[i + 1];
    numel_ = out_stride_[0] * space_.dims[0];
    tiled_ = space_.stride_a[r - 1] != 1;
    if (tiled_) {
      for (int i = 0; i < r; ++i)
        if (space_.stride_a[i] == 1) q_ = i;
      // Outer axes: all but q and the last, as a space of their own.
      outer_.rank = 0;
      for (int i = 0; i < r - 1; ++i) {
        if (i == q_) continue;
        outer_.dims[outer_.rank] = space_.dims[i];
        outer_.stride_a[outer_.rank] = space_.stride_a[i];
        outer_.stride_b[outer_.rank] = out_stride_[i];
        ++outer_.rank;
      }
      outer_count_ = 1;
      for (int i = 0; i < outer_.rank; ++i) outer_count_ *= outer_.dims[i];
      if (outer_.rank == 0) {
        outer_.rank = 1;
        outer_.dims[0] = 1;
      }
      strips_ = (space_.dims[q_] + kTile - 1) / kTile;
    }
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const T* x = static_cast<const T*>(args.inputs[0].data());
    T* out = static_cast<T*>(args.outputs[0].data());
    const int threads = threads_for(numel_ * static_cast<int64_t>(sizeof(T)) / 4, ctx.num_threads);
    if (!tiled_) {
      parallel_for(
          numel_, threads,
          [&](int64_t begin, int64_t end, int) {
            for_each_run(space_, begin, end, [&](int64_t pos, int64_t off_x, int64_t, int64_t len) {
              std::memcpy(out + pos, x + off_x, static_cast<size_t>(len) * sizeof(T));
            });
          },
          16);
      return;
    }
    // Jobs: (outer index, strip of kTile rows along axis q).
    parallel_for(outer_count_ * strips_, threads, [&](int64_t begin, int64_t end, int) {
      for (int64_t job = begin; job < end; ++job) transpose_strip(out, x, job / strips_, job % strips_);
    });
  }

 private:
  void transpose_strip(T* out, const T* x, int64_t outer_index, int64_t strip) const {
    int64_t off_x = 0, off_out = 0;
    for (int i = outer_.rank - 1; i >= 0; --i) {
      const int64_t idx = outer_index % outer_.dims[i];
      outer_index /= outer_.dims[i];
      off_x += idx * outer_.stride_a[i];
      off_out += idx * outer_.stride_b[i];
    }
    const int r = space_.rank;
    const int64_t n_q = space_.dims[q_], n_last = space_.dims[r - 1];
    const int64_t out_stride_q = out_stride_[q_], x_stride_last = space_.stride_a[r - 1];
    const int64_t q0 = strip * kTile, q1 = std::min(n_q, q0 + kTile);
    // out[iq * out_stride_q + il] = x[iq + il * x_stride_last]
    for (int64_t l0 = 0; l0 < n_last; l0 += kTile) {
      const int64_t l1 = std::min(n_last, l0 + kTile);
      if constexpr (sizeof(T) == 4) {
        if (blocks8_ && q1 - q0 == kTile && l1 - l0 == kTile) {  // four 8x8 blocks in registers
          for (int64_t bq = 0; bq < kTile; bq += 8)
            for (int64_t bl = 0; bl < kTile; bl += 8)
              transpose8x8_avx2(reinterpret_cast<const float*>(x + off_x + q0 + bq + (l0 + bl) * x_stride_last),
                                x_stride_last, reinterpret_cast<float*>(out + off_out + (q0 + bq) * out_stride_q + l0 + bl),
                                out_stride_q);
          continue;
        }
      }
      for (int64_t iq = q0; iq < q1; ++iq) {
        T* o = out + off_out + iq * out_stride_q;
        const T* s = x + off_x + iq;
        for (int64_t il = l0; il < l1; ++il) o[il] = s[il * x_stride_last];
      }
    }
  }

  StridedSpace space_;
  std::array<int64_t, kMaxRank> out_stride_{};
  int64_t numel_ = 0;
  bool tiled_ = false;
  int q_ = 0;
  StridedSpace outer_;  // stride_a: input strides, stride_b: output strides
  int64_t outer_count_ = 1, strips_ = 1;
  bool blocks8_ = use_avx512() || use_avx2();  // 4-byte elements' whole tiles by transpose8x8_avx2
};

// Output-ordered dims and input strides of a permutation with extent-1 axes
// dropped and adjacent runs merged. False if the result exceeds kMaxRank.
bool transpose_space(const Shape& in, const std::vector<int64_t>& perm, StridedSpace* space) {
  const int64_t rank = in.rank();
  std::vector<int64_t> in_stride(static_cast<size_t>(rank), 1);
  for (int64_t a = rank - 2; a >= 0; --a) in_stride[a] = in_stride[a + 1] * in[a + 1];
  StridedSpace s;
  s.rank = 0;
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t axis = perm[static_cast<size_t>(i)];
    const int64_t extent = in[axis];
    if (extent == 1) continue;
    if (s.rank > 0 && s.stride_a[s.rank - 1] == in_stride[axis] * extent) {  // continues the previous run
      s.dims[s.rank - 1] *= extent;
      s.stride_a[s.rank - 1] = in_stride[axis];
      continue;
    }
    if (s.rank == kMaxRank) return false;
    s.dims[s.rank] = extent;
    s.stride_a[s.rank] = in_stride[axis];
    ++s.rank;
  }
  if (s.rank == 0) {
    s.rank = 1;
    s.dims[0] = in.numel();
    s.stride_a[0] = 1;
  }
  *space = s;
  return true;
}

// ---- ExpandTo -----------------------------------------------------------------------------------

template <typename T>
class ExpandKernel final : public Kernel {
 public:
  ExpandKernel(const StridedSpace& space, int64_t numel) : space_(space), numel_(numel) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const T* x = static_cast<const T*>(args.inputs[0].data());
    T* out = static_cast<T*>(args.outputs[0].data());
    const int64_t inner_stride = space_.stride_a[space_.rank - 1];
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          for_each_run(space_, begin, end, [&](int64_t pos, int64_t off_x, int64_t, int64_t len) {
            if (inner_stride != 0)
              std::memcpy(out + pos, x + off_x, static_cast<size_t>(len) * sizeof(T));
            else
              std::fill(out + pos, out + pos + len, x[off_x]);
          });
        },
        16);
  }

 private:
  StridedSpace space_;
  int64_t numel_;
};

template <template <typename> class K, typename... Args>
std::unique_ptr<Kernel> by_element_size(size_t size, Args&&... args) {
  switch (size) {
    case 1:
      return std::make_unique<K<uint8_t>>(std::forward<Args>(args)...);
    case 2:
      return std::make_unique<K<uint16_t>>(std::forward<Args>(args)...);
    case 4:
      return std::make_unique<K<uint32_t>>(std::forward<Args>(args)...);
    case 8:
      return std::make_unique<K<uint64_t>>(std::forward<Args>(args)...);
    default:
      return nullptr;
  }
}

// Axis, start and end of a Split, Concat, Slice or SliceBackward (start and end 0 where absent).
struct AxisRange {
  int64_t axis = 0, start = 0, end = 0;
};

AxisRange axis_range(const KernelCall& call, int64_t rank) {
  AxisRange r = std::visit(
      [&](const auto& p) -> AxisRange {
        if constexpr (requires { p.start; })
          return {p.axis, p.start, p.end};
        else if constexpr (requires { p.axis; })
          return {p.axis, 0, 0};
        else
          throw Error(str(call.label(), ": has no axis parameter"));
      },
      call.op_params);
  if (r.axis < 0) r.axis += rank;
  return r;
}

int64_t node_axis(const KernelCall& call, int64_t rank) { return axis_range(call, rank).axis; }

}  // namespace

std::unique_ptr<Kernel> make_reshape_kernel(const KernelCall& call) {
  const size_t size = dtype_size(input_dtype(call, 0));
  return std::make_unique<ReshapeKernel>(input_shape(call, 0).numel() * static_cast<int64_t>(size));
}

std::unique_ptr<Kernel> make_transpose_kernel(const KernelCall& call) {
  StridedSpace space;
  if (!transpose_space(input_shape(call, 0), call.params<ops::TransposeParams>().perm, &space)) return nullptr;
  return by_element_size<TransposeKernel>(dtype_size(input_dtype(call, 0)), space);
}

std::unique_ptr<Kernel> make_split_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  const int64_t axis = node_axis(call, x.rank());
  AxisLayout layout = axis_layout(x, axis, dtype_size(input_dtype(call, 0)));
  std::vector<Piece> pieces;
  int64_t start = 0;
  for (int64_t size : call.params<ops::SplitParams>().sizes) {
    pieces.push_back({start * layout.inner_bytes, size * layout.inner_bytes});
    start += size;
  }
  return std::make_unique<PiecesKernel>(layout, std::move(pieces), false);
}

std::unique_ptr<Kernel> make_concat_kernel(const KernelCall& call) {
  const Shape& out = output_shape(call, 0);
  const int64_t axis = node_axis(call, out.rank());
  AxisLayout layout = axis_layout(out, axis, dtype_size(output_dtype(call, 0)));
  std::vector<Piece> pieces;
  int64_t start = 0;
  for (size_t i = 0; i < call.inputs.size(); ++i) {
    int64_t size = input_shape(call, i)[axis];
    pieces.push_back({start * layout.inner_bytes, size * layout.inner_bytes});
    start += size;
  }
  return std::make_unique<PiecesKernel>(layout, std::move(pieces), true);
}

// The layout of `full` around a Slice's axis, and the bytes of each outer row the slice covers.
std::pair<AxisLayout, Piece> sliced_piece(const KernelCall& call, const Shape& full, DType dtype) {
  const AxisRange range = axis_range(call, full.rank());
  AxisLayout layout = axis_layout(full, range.axis, dtype_size(dtype));
  return {layout, Piece{range.start * layout.inner_bytes, (range.end - range.start) * layout.inner_bytes}};
}

std::unique_ptr<Kernel> make_slice_kernel(const KernelCall& call) {
  auto [layout, piece] = sliced_piece(call, input_shape(call, 0), input_dtype(call, 0));
  return std::make_unique<PiecesKernel>(layout, std::vector<Piece>{piece}, false);
}

std::unique_ptr<Kernel> make_slice_backward_kernel(const KernelCall& call) {
  auto [layout, piece] = sliced_piece(call, output_shape(call, 0), output_dtype(call, 0));
  return std::make_unique<SliceBackwardKernel>(layout, piece);
}

std::unique_ptr<Kernel> make_expand_to_kernel(const KernelCall& call) {
  StridedSpace space;
  const Shape& out = output_shape(call, 0);
  if (!broadcast_space(out, input_shape(call, 0), nullptr, &space)) return nullptr;
  return by_element_size<ExpandKernel>(dtype_size(output_dtype(call, 0)), space, out.numel());
}

}  // namespace fusetrain::kernels::cpu_basic
