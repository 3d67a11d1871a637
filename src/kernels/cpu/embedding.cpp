// Tuned Embedding (row gather, any floating weight dtype) and EmbeddingBackward
// (deterministic scatter-add, f32).
//
// Shape legend: V vocabulary, C channels, N ids (product of the id shape).
//   forward:  weight (V, C), ids (N) i64/i32 -> out (N, C): out[i] = weight[ids[i]]
//   backward: dy (N, C), ids (N) -> dweight (V, C): dweight[ids[i]] += dy[i]
// Ids are checked before anything is written; an id outside [0, V) throws
// naming the id, its position and V. The backward splits C across threads:
// every thread walks all ids in order over its own columns, so each element
// of dweight sums its rows in the same order whatever the thread count.
#include <cstring>

#include "fusetrain/core/error.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

inline int64_t load_id(const void* ids, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
}

// Throws if some id is outside [0, V).
void check_ids(const char* op, const std::string& node, const void* ids, bool i64, int64_t N, int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    int64_t id = load_id(ids, i64, i);
    if (id < 0 || id >= V)
      throw Error(str(op, node.empty() ? "" : str(" \"", node, "\""), ": id ", id, " at position ", i,
                      " is outside the vocabulary [0, ", V, ")"));
  }
}

// out (N, C) = weight (V, C) rows at ids (N).
class EmbeddingKernel final : public Kernel {
 public:
  EmbeddingKernel(int64_t N, int64_t V, int64_t C, size_t element_size, bool ids_i64, std::string name)
      : N_(N), V_(V), row_bytes_(static_cast<size_t>(C) * element_size), ids_i64_(ids_i64), name_(std::move(name)) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const char* weight = static_cast<const char*>(args.inputs[0].data());
    const void* ids = args.inputs[1].data();
    char* out = static_cast<char*>(args.outputs[0].data());
    check_ids("Embedding", name_, ids, ids_i64_, N_, V_);
    const int64_t work = N_ * static_cast<int64_t>(row_bytes_) / 4;
    parallel_for(N_, threads_for(work, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i)
        std::memcpy(out + i * row_bytes_, weight + load_id(ids, ids_i64_, i) * row_bytes_, row_bytes_);
    });
  }

 private:
  int64_t N_, V_;
  size_t row_bytes_;
  bool ids_i64_;
  std::string name_;
};

// dst[c] += src[c] for c in [0, n)
void add_row_portable(float* dst, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] += src[c];
}

FT_AVX512 void add_row_avx512(float* dst, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    _mm512_mask_storeu_ps(dst + c, m,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst + c), _mm512_maskz_loadu_ps(m, src + c)));
  }
}

FT_AVX2 void add_row_avx2(float* dst, const float* src, int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(dst + c, _mm256_add_ps(_mm256_loadu_ps(dst + c), _mm256_loadu_ps(src + c)));
  for (; c < n; ++c) dst[c] += src[c];
}

// dweight (V, C) (+)= scatter of dy (N, C) rows at ids (N).
class EmbeddingBackwardKernel final : public Kernel {
 public:
  EmbeddingBackwardKernel(int64_t N, int64_t V, int64_t C, bool ids_i64, int64_t padding_idx, std::string name)
      : N_(N),
        padding_idx_(padding_idx),
        V_(V),
        C_(C),
        ids_i64_(ids_i64),
        name_(std::move(name)),
        add_row_(pick_path(add_row_portable, add_row_avx2, add_row_avx512)) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* dy = static_cast<const float*>(args.inputs[0].data());
    const void* ids = args.inputs[1].data();
    float* dweight = static_cast<float*>(args.outputs[0].data());
    check_ids("EmbeddingBackward", name_, ids, ids_i64_, N_, V_);
    const int64_t C = C_;
    if (!accumulate_flag(args, 0)) {
      parallel_for(
          V_ * C, threads_for(V_ * C, ctx.num_threads),
          [&](int64_t begin, int64_t end, int) {
            std::memset(dweight + begin, 0, static_cast<size_t>(end - begin) * sizeof(float));
          },
          16);
    }
    // Columns split in multiples of 16 floats; every thread reads all ids.
    parallel_for(
        C, threads_for(N_ * C, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          for (int64_t i = 0; i < N_; ++i) {
            const int64_t id = load_id(ids, ids_i64_, i);
            if (id != padding_idx_) add_row_(dweight + id * C + begin, dy + i * C + begin, end - begin);
          }
        },
        16);
  }

 private:
  int64_t N_, padding_idx_, V_, C_;
  bool ids_i64_;
  std::string name_;
  void (*add_row_)(float*, const float*, int64_t);
};

bool ids_dtype(DType t, bool* i64) {
  if (t != DType::i64 && t != DType::i32) return false;
  *i64 = t == DType::i64;
  return true;
}

}  // namespace

std::unique_ptr<Kernel> make_embedding_kernel(const KernelCall& call) {
  const Shape& weight = input_shape(call, 0);
  bool i64;
  if (!ids_dtype(input_dtype(call, 1), &i64) || weight.rank() != 2) return nullptr;
  return std::make_unique<EmbeddingKernel>(input_shape(call, 1).numel(), weight[0], weight[1],
                                           dtype_size(input_dtype(call, 0)), i64, call.name);
}

std::unique_ptr<Kernel> make_embedding_backward_kernel(const KernelCall& call) {
  const Shape& dweight = output_shape(call, 0);
  bool i64;
  if (!ids_dtype(input_dtype(call, 1), &i64) || input_dtype(call, 0) != DType::f32) return nullptr;
  return std::make_unique<EmbeddingBackwardKernel>(input_shape(call, 1).numel(), dweight[0], dweight[1], i64,
                                                   call.params<ops::EmbeddingBackwardParams>().padding_idx, call.name);
}

}  // namespace fusetrain::kernels::cpu_basic
