// The pass pipeline, in the order it runs. Each row names a pass, its stage, when it applies and how
// its report reads; adding a pass is adding a row here (and its test under tests/passes).
#include <algorithm>

#include "fusetrain/compile/compiler.h"
#include "fusetrain/core/error.h"
#include "fusetrain/passes/fusion.h"
#include "fusetrain/passes/recompute.h"

namespace fusetrain::compile {
namespace {

size_t mib(size_t bytes) { return bytes / (size_t{1} << 20); }

bool with_fusions(const CompileOptions& o) { return o.fusions; }
// fp16 must scale d(logits) before rounding it, which the fused loss cannot: not fused then.
bool fusing_loss(const CompileOptions& o) { return o.fusions && o.backward && !o.loss_scale_input; }
bool recomputing(const CompileOptions& o) { return o.recompute && o.backward; }

// "<count><what>", or "" when the pass changed nothing.
std::string report(int64_t count, const std::string& what) { return count == 0 ? "" : str(count, what); }

std::string fold_attention_transposes(ir::Graph& g, PassState&) {
  passes::FusionReport f = passes::fold_attention_transposes(g);
  return report(f.fused, str(" attentions read and write (B, T, H, D), ", f.nodes_removed,
                             " transposes removed (and their gradients' transposes)"));
}

std::string fold_transpose_pairs(ir::Graph& g, PassState&) {
  return report(passes::fold_transpose_pairs(g).fused, " transpose pairs that move nothing became reshapes");
}

std::string fuse_decomposed_layernorm(ir::Graph& g, PassState&) {
  return report(passes::fuse_decomposed_layernorm(g).fused, " written-out LayerNorms");
}

std::string fuse_decomposed_rmsnorm(ir::Graph& g, PassState&) {
  return report(passes::fuse_decomposed_rmsnorm(g).fused, " written-out RMSNorms");
}

std::string fuse_decomposed_rope(ir::Graph& g, PassState&) {
  return report(passes::fuse_decomposed_rope(g).fused, " written-out rotary embeddings");
}

std::string fuse_decomposed_swiglu(ir::Graph& g, PassState&) {
  return report(passes::fuse_decomposed_swiglu(g).fused, " written-out SwiGLUs (silu(gate) · up)");
}

std::string round_activation_inputs(ir::Graph& g, PassState&) {
  return report(passes::round_activation_inputs(g).fused,
                 " GELUs and SwiGLUs read bf16 projections' results rounded to bf16 (kept in bf16 for backward)");
}

std::string fuse_erf_gelu(ir::Graph& g, PassState&) {
  return report(passes::fuse_erf_gelu(g).fused, " written-out GELUs (erf or tanh form)");
}

std::string prune_sliced_rows(ir::Graph& g, PassState& state) {
  passes::FusionReport f = passes::prune_sliced_rows(g);
  if (f.fused == 0) return "";
  // The last layer's full output may be gone: checkpointing then keeps the boundaries still computed.
  std::erase_if(state.roles.layer_boundaries, [&](ir::ValueId v) {
    return g.value(v).kind == ir::ValueKind::Activation && g.value(v).producer == ir::kNone;
  });
  return str(f.fused, " ops compute only the rows a later Slice keeps");
}

std::string fuse_dropout_add(ir::Graph& g, PassState&) {
  return report(passes::fuse_dropout_add(g).fused, " dropout + residual adds in one pass");
}

std::string fuse_add_layernorm(ir::Graph& g, PassState&) {
  return report(passes::fuse_add_layernorm(g).fused, " residual adds formed and normalised in one pass");
}

std::string fuse_linear_gelu(ir::Graph& g, PassState&) {
  return report(passes::fuse_linear_gelu(g).fused, " bias + GELU applied by the Linear's GEMM epilogue");
}

std::string fuse_linear_cross_entropy(ir::Graph& g, PassState&) {
  return report(passes::fuse_linear_cross_entropy(g).fused,
                " output projections + losses in row chunks; logits never stored");
}

std::string fuse_linear_log_probs(ir::Graph& g, PassState& state) {
  return report(passes::fuse_linear_log_probs(g, state.options.backward).fused,
                " output projections + log-probabilities in row chunks; logits never stored");
}

std::string merge_duplicate_casts(ir::Graph& g, PassState&) {
  passes::MergeCastsReport r = passes::merge_duplicate_casts(g);
  return report(r.casts, str(" repeated casts (", mib(r.bytes_saved), " MiB) merged into the first"));
}

std::string recompute(ir::Graph& g, PassState& state) {
  passes::RecomputeReport r = passes::recompute_segments(g, state.roles.layer_boundaries);
  return str(r.segments, " layers, ", r.nodes_cloned, " forward nodes cloned into backward, ", r.values_freed,
             " saved activations freed after forward");
}

std::string recompute_gelu_outputs(ir::Graph& g, PassState&) {
  passes::GeluRecomputeReport r = passes::recompute_gelu_outputs(g);
  return report(r.gelus,
                str(" GELU outputs (", mib(r.bytes_freed), " MiB) computed again in backward from the input it keeps"));
}

std::string relu_backward_from_output(ir::Graph& g, PassState&) {
  passes::ReluBackwardReport r = passes::relu_backward_from_output(g);
  return report(r.relus, str(" ReLU backwards read the output backward keeps, not the input (", mib(r.bytes_freed),
                             " MiB no longer kept)"));
}

std::string recast_weights_for_backward(ir::Graph& g, PassState&) {
  passes::RecastReport r = passes::recast_weights_for_backward(g);
  return report(r.casts, str(" weight copies in another dtype (", mib(r.bytes_freed),
                             " MiB) cast again in backward instead of kept"));
}

std::string fold_output_casts(ir::Graph& g, PassState&) {
  passes::OutputCastsReport r = passes::fold_output_casts(g);
  return report(r.casts, str(" GELUs and bf16 projections write bf16 themselves (", mib(r.bytes_saved),
                             " MiB of f32 results not written)"));
}

std::string fuse_cast_column_sum(ir::Graph& g, PassState&) {
  return report(passes::fuse_cast_column_sum(g).fused, " gradient casts and bias-gradient sums read their input once");
}

std::string fuse_matmul_gelu_backward(ir::Graph& g, PassState&) {
  return report(passes::fuse_matmul_gelu_backward(g).fused,
                " GELU backwards applied by the GEMM that forms their incoming gradient");
}

}  // namespace

const std::vector<Pass>& pipeline() {
  static const std::vector<Pass> kPipeline = {
      // Before the transposes fold: it moves a heads transpose from before the rotation to after it.
      {"fuse_decomposed_rope", Stage::Forward, with_fusions, fuse_decomposed_rope},
      {"fold_attention_transposes", Stage::Forward, with_fusions, fold_attention_transposes},
      {"fold_transpose_pairs", Stage::Forward, with_fusions, fold_transpose_pairs},
      // Decomposed LayerNorm, RMSNorm, GELU and SwiGLU first, so the passes after them see the fused ops.
      {"fuse_decomposed_layernorm", Stage::Forward, with_fusions, fuse_decomposed_layernorm},
      {"fuse_decomposed_rmsnorm", Stage::Forward, with_fusions, fuse_decomposed_rmsnorm},
      {"fuse_erf_gelu", Stage::Forward, with_fusions, fuse_erf_gelu},
      {"fuse_decomposed_swiglu", Stage::Forward, with_fusions, fuse_decomposed_swiglu},
      {"round_activation_inputs", Stage::Forward, with_fusions, round_activation_inputs},
      {"prune_sliced_rows", Stage::Forward, with_fusions, prune_sliced_rows},
      {"fuse_dropout_add", Stage::Forward, with_fusions, fuse_dropout_add},
      {"fuse_add_layernorm", Stage::Forward, with_fusions, fuse_add_layernorm},
      {"fuse_linear_gelu", Stage::Forward, with_fusions, fuse_linear_gelu},
      // Forms the head's gradients in forward: training programs only.
      {"fuse_linear_cross_entropy", Stage::Forward, fusing_loss, fuse_linear_cross_entropy},
      {"fuse_linear_log_probs", Stage::Forward, with_fusions, fuse_linear_log_probs},
      {"merge_duplicate_casts", Stage::Joint, with_fusions, merge_duplicate_casts},
      {"recompute", Stage::Joint, recomputing, recompute},
      {"recompute_gelu_outputs", Stage::Joint, with_fusions, recompute_gelu_outputs},
      {"relu_backward_from_output", Stage::Joint, with_fusions, relu_backward_from_output},
      {"recast_weights_for_backward", Stage::Joint, with_fusions, recast_weights_for_backward},
      // After the passes that clone GELUs into backward, so recomputed GELUs fold too.
      {"fold_output_casts", Stage::Final, with_fusions, fold_output_casts},
      {"fuse_cast_column_sum", Stage::Final, with_fusions, fuse_cast_column_sum},
      // After fuse_cast_column_sum, whose CastColumnSum of dx it takes into the GEMM's epilogue.
      {"fuse_matmul_gelu_backward", Stage::Final, with_fusions, fuse_matmul_gelu_backward},
  };
  return kPipeline;
}

}  // namespace fusetrain::compile
