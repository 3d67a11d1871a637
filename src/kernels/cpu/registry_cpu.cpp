// make_cpu_basic_kernel: the tuned CPU kernel for every op but the dense ones
// (MatMul, Linear, Attention, AttentionBackward live in matmul.cpp and
// attention.cpp). Null means "no tuned kernel for this call": the CPU device
// falls back to the reference kernel. The switch has no default, so a new op in
// ops.def is a compile error here until someone decides (-Werror=switch).
//
// Shape letters: R rows, C channels (see basic_kernels.h).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "fusetrain/core/cpu.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {

namespace cpu_basic {
namespace {

// The widest path kernels may take: FUSETRAIN_KERNELS=portable or avx2 in the environment, else (unset or empty)
// no cap. Any other value is an Error at the first kernel built (and again at each later one).
std::atomic<CpuPath>& path_cap() {
  static std::atomic<CpuPath> cap{[] {
    const char* env = std::getenv("FUSETRAIN_KERNELS");
    if (env == nullptr || *env == '\0') return CpuPath::avx512;
    if (std::strcmp(env, "portable") == 0) return CpuPath::portable;
    FT_CHECK(std::strcmp(env, "avx2") == 0, "FUSETRAIN_KERNELS should be \"portable\" or \"avx2\" (or unset), found \"",
             env, "\"");
    return CpuPath::avx2;
  }()};
  return cap;
}

bool cpu_has_avx512() {
  static const bool has = [] {
    const CpuFeatures& f = cpu_features();
    return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.fma;
  }();
  return has;
}

}  // namespace

bool use_avx512() { return cpu_has_avx512() && path_cap().load(std::memory_order_relaxed) >= CpuPath::avx512; }

bool use_avx2() {
  static const bool has = cpu_features().avx2 && cpu_features().fma;
  return has && path_cap().load(std::memory_order_relaxed) >= CpuPath::avx2;
}

void force_portable_path(bool portable) { cap_cpu_path(portable ? CpuPath::portable : CpuPath::avx512); }

void cap_cpu_path(CpuPath cap) { path_cap().store(cap, std::memory_order_relaxed); }

}  // namespace cpu_basic

const char* cpu_kernel_path() { return cpu_basic::pick_path("portable", "avx2", "avx512"); }

namespace cpu_basic {

bool broadcast_space(const Shape& out, const Shape& a, const Shape* b, StridedSpace* space) {
  const int64_t rank = out.rank();
  // Per output axis: extent and element strides of a and b (0 where broadcast).
  auto operand_strides = [&](const Shape& s, int64_t* strides) {
    int64_t lead = rank - s.rank();
    int64_t stride = 1;
    for (int64_t axis = rank - 1; axis >= 0; --axis) {
      int64_t extent = axis >= lead ? s[axis - lead] : 1;
      strides[axis] = extent == 1 ? 0 : stride;
      stride *= extent;
    }
  };
  int64_t sa[64], sb[64];
  if (rank > 64) return false;
  operand_strides(a, sa);
  if (b != nullptr)
    operand_strides(*b, sb);
  else
    std::fill(sb, sb + rank, 0);

  // Merge axis i into the run ending at axis j when, for both operands, the
  // stride of i equals stride(j) * extent(j) (contiguous) or both are 0.
  StridedSpace merged;
  int m = 0;
  for (int64_t axis = 0; axis < rank; ++axis) {
    int64_t extent = out[axis];
    if (extent == 1) continue;  // contributes nothing to any offset
    if (m > 0) {
      int last = m - 1;
      bool a_fits = sa[axis] * extent == merged.stride_a[last] || (sa[axis] == 0 && merged.stride_a[last] == 0);
      bool b_fits = sb[axis] * extent == merged.stride_b[last] || (sb[axis] == 0 && merged.stride_b[last] == 0);
      if (a_fits && b_fits) {
        merged.dims[last] *= extent;
        merged.stride_a[last] = sa[axis];
        merged.stride_b[last] = sb[axis];
        continue;
      }
    }
    if (m == kMaxRank) return false;
    merged.dims[m] = extent;
    merged.stride_a[m] = sa[axis];
    merged.stride_b[m] = sb[axis];
    ++m;
  }
  if (m == 0) {  // a scalar, or all extents 1
    merged.dims[0] = out.numel();
    merged.stride_a[0] = 0;
    merged.stride_b[0] = 0;
    m = 1;
  }
  merged.rank = m;
  *space = merged;
  return true;
}

}  // namespace cpu_basic

std::unique_ptr<Kernel> make_cpu_basic_kernel(const KernelCall& call) {
  using ops::OpKind;
  using namespace cpu_basic;
  switch (call.op) {
    case OpKind::MatMul:
    case OpKind::Linear:
    case OpKind::LinearGelu:
    case OpKind::MatMulGeluBackward:
    case OpKind::Attention:
    case OpKind::AttentionBackward:
    case OpKind::LinearCrossEntropy:
    case OpKind::LinearLogProbs:
    case OpKind::LinearLogProbsWeightGrad:
    case OpKind::QuantizedLinear:
    case OpKind::QuantizedLinearBackward:
    case OpKind::Conv:
    case OpKind::ConvBackwardData:
    case OpKind::ConvBackwardWeight:
      return nullptr;  // make_cpu_dense_kernel
    case OpKind::SigmoidCrossEntropy:
    case OpKind::SigmoidCrossEntropyBackward:
      return nullptr;  // small (B, labels) tensors: the reference is enough
    case OpKind::PreferenceLoss:
    case OpKind::PreferenceLossBackward:
      return nullptr;  // one value per sequence: the reference is enough
    case OpKind::CtcLoss:
    case OpKind::CtcLossBackward:
      return nullptr;  // (B, T, 2L + 1) lattice over a small vocabulary: the reference (see docs/architecture.md)
    case OpKind::TokenLogProbs:
    case OpKind::TokenLogProbsBackward:
      return nullptr;  // unfused only (fuse_linear_log_probs folds them into the LM head): the reference
    case OpKind::TokenStats:
      return nullptr;  // unfused only (fuse_linear_cross_entropy folds it into the LM head): the reference
    case OpKind::Fill:
      return make_fill_kernel(call);
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Mul:
    case OpKind::Div:
      return make_binary_kernel(call);
    case OpKind::Scale:
      return make_scale_kernel(call);
    case OpKind::Copy:
      return make_copy_kernel(call);
    case OpKind::Cast:
      return make_cast_kernel(call);
    case OpKind::Gelu:
    case OpKind::Tanh:
    case OpKind::Relu:
      return make_activation_kernel(call);
    case OpKind::GeluBackward:
    case OpKind::TanhBackward:
    case OpKind::ReluBackward:
      return make_activation_backward_kernel(call);
    case OpKind::Pow:
    case OpKind::Sqrt:
    case OpKind::Erf:
    case OpKind::ErfBackward:
      return nullptr;  // decomposed forms that fuse_decomposed_norms rewrites; the reference kernels run what is left
    case OpKind::RMSNorm:
      return make_rmsnorm_kernel(call);
    case OpKind::RMSNormBackward:
      return make_rmsnorm_backward_kernel(call);
    case OpKind::RoPE:
      return make_rope_kernel(call);
    case OpKind::SwiGLU:
    case OpKind::SwiGLUBackward:
      return make_swiglu_kernel(call);
    case OpKind::Softmax:
      return make_softmax_kernel(call);
    case OpKind::SoftmaxBackward:
      return make_softmax_backward_kernel(call);
    case OpKind::LayerNorm:
    case OpKind::AddLayerNorm:
      return make_layernorm_kernel(call);
    case OpKind::LayerNormBackward:
      return make_layernorm_backward_kernel(call);
    case OpKind::Pool:
    case OpKind::PoolBackward:
      return make_pool_kernel(call);
    case OpKind::Embedding:
      return make_embedding_kernel(call);
    case OpKind::EmbeddingBackward:
      return make_embedding_backward_kernel(call);
    case OpKind::Dropout:
    case OpKind::DropoutAdd:
      return make_dropout_kernel(call);
    case OpKind::Reshape:
      return make_reshape_kernel(call);
    case OpKind::Transpose:
      return make_transpose_kernel(call);
    case OpKind::Split:
      return make_split_kernel(call);
    case OpKind::Concat:
      return make_concat_kernel(call);
    case OpKind::Slice:
      return make_slice_kernel(call);
    case OpKind::SliceBackward:
      return make_slice_backward_kernel(call);
    case OpKind::ExpandTo:
      return make_expand_to_kernel(call);
    case OpKind::ReduceSum:
    case OpKind::ReduceMean:
    case OpKind::ReduceSumTo:
      return make_reduce_kernel(call);
    case OpKind::CastColumnSum:
      return make_cast_column_sum_kernel(call);
    case OpKind::SoftmaxCrossEntropy:
      return make_cross_entropy_kernel(call);
    case OpKind::SoftmaxCrossEntropyBackward:
      return make_cross_entropy_backward_kernel(call);
  }
  return nullptr;
}

}  // namespace fusetrain::kernels
