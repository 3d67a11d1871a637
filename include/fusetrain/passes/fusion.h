// Fusion passes: graph rewrites that let one kernel do the work of several nodes.
// Each runs on the forward graph, before autodiff, so backward is derived from
// the fused ops and needs no fusion of its own.
#pragma once

#include <cstdint>

#include "fusetrain/ir/graph.h"

namespace fusetrain::passes {

/// What a fusion pass changed.
struct FusionReport {
  int64_t fused = 0;          ///< patterns rewritten
  int64_t nodes_removed = 0;  ///< nodes the rewrite made dead and dropped
};

/// Transpose folding into attention: Attention whose q, k, v come from
/// Transpose(perm 0 2 1 3) of (B, T, H, D) values and whose output only feeds a
/// Transpose back is rewritten to read and write (B, T, H, D) directly
/// (attribute seq_major), and the four transposes go. Its backward then reads and
/// writes that layout too, so the transposes of the gradients go as well.
FusionReport fold_attention_transposes(ir::Graph& graph);

/// Transpose -> Reshape -> Transpose that leaves every element where it was: Transpose(Reshape(Transpose(x))),
/// each intermediate read by nothing else, the Reshape only merging neighbouring axes, and the axes of x back in
/// their order, becomes Reshape(x): no data moves. A convolution's output written channels-first and flattened back
/// to tokens (ViT's patch embedding: (B, h, w, C) -> (B, C, h, w) -> (B, C, h·w) -> (B, h·w, C)) is one. Its
/// gradient's two transposes go with it.
FusionReport fold_transpose_pairs(ir::Graph& graph);

/// Dropout + residual add: Add(Dropout(x), residual) (either order), where the
/// dropout's output feeds nothing else, becomes DropoutAdd(x, residual): one pass
/// over memory instead of two, and no dropped copy of x is stored.
FusionReport fuse_dropout_add(ir::Graph& graph);

/// Residual add + LayerNorm: LayerNorm(Add(x, residual)) or LayerNorm(DropoutAdd(x, residual)),
/// same shapes and f32, becomes AddLayerNorm(x, residual, gamma, beta) with outputs (sum, y, mean,
/// rstd). One pass per row forms the sum and its statistics, and a second normalises it from cache,
/// instead of writing the sum and reading it back. The sum stays an output: LayerNorm's backward reads it, and
/// pre-LN models carry it on as the residual stream. Run after fuse_dropout_add.
FusionReport fuse_add_layernorm(ir::Graph& graph);

/// Bias + GELU into the matmul epilogue: Gelu(Linear(x, w, bias)), where the Linear's output
/// feeds nothing else, becomes LinearGelu(x, w, bias) with outputs (gelu(z), z): the GEMM adds
/// the bias and applies GELU to each strip of rows it finishes, while the strip is in cache,
/// instead of two more passes over memory; z is kept for GELU's backward. Gelu(Cast(Linear, bf16))
/// (bf16 mixed precision) fuses the same way with z_dtype bf16: the epilogue rounds z to bf16, keeps
/// that, and applies GELU to the rounded values.
FusionReport fuse_linear_gelu(ir::Graph& graph);

/// A gradient's cast and its column sums: Cast(x, bf16 or f16) and ReduceSum(x) over every axis but the last
/// (read directly or through Reshapes that keep the last axis), x f32, become CastColumnSum(x) with outputs (the
/// cast, the sums). Under mixed precision each Linear's output gradient is cast for its two GEMMs and summed for its
/// bias gradient: one pass over x instead of two. The sums are ReduceSum's bits. Unlike the passes above it runs
/// on the joint graph, after autodiff has written the backward it rewrites.
FusionReport fuse_cast_column_sum(ir::Graph& graph);

/// GELU's backward as the epilogue of the GEMM before it: GeluBackward(MatMul(a, b), x), the product f32 and read by
/// nothing else (directly or through Reshapes), b 2-D, becomes MatMulGeluBackward(a, b, x): each strip of the
/// product is turned into dx = dy·gelu′(x) while it is in cache, so dy is never stored and read back. When dx's one
/// reader is a CastColumnSum to bf16 (fuse_cast_column_sum: the cast for the next GEMMs and the bias gradient), the
/// epilogue writes both instead, and a GELU of the same x recomputed in backward (recompute_gelu_outputs: the
/// input of the next layer's weight gradient) comes from the same read of x. Every result is the separate ops' bits:
/// the bias gradient adds in ReduceSum's blocks of rows (kernels: kColumnSumRows). Runs on the final graph, after
/// fuse_cast_column_sum.
FusionReport fuse_matmul_gelu_backward(ir::Graph& graph);

/// Language-model head + loss: SoftmaxCrossEntropy(Linear(x, w, bias), targets) with f32 or bf16
/// operands, where the logits feed nothing else, becomes LinearCrossEntropy(x, w, targets, bias)
/// with outputs (loss, dx, dw, dbias). It works through the rows whose target counts in chunks
/// (`chunk_rows`, 0: about 32 MiB of f32 logits per chunk, at least 512 rows) and forms each chunk's gradients while
/// its logits are in cache, so the (rows, vocabulary) logits and their gradient are never stored,
/// and rows with ignore_index (the unmasked positions of masked LM) cost nothing. Because the
/// gradients are formed in the forward pass, run it only on graphs that will be differentiated.
FusionReport fuse_linear_cross_entropy(ir::Graph& graph, int64_t chunk_rows = 0);
/// The log-probabilities of an LM head: TokenLogProbs(Linear(x, w, bias), targets), f32 or bf16 operands, the logits
/// read by nothing else, becomes LinearLogProbs(x, w, targets, bias) with outputs (log p, lse, [dx], [row stats]):
/// the logits are formed a chunk of counted rows at a time and never stored whole. With `input_grad` (a graph that
/// will be differentiated) the forward also forms each row's d(log p)/dx, so backward only scales it; dw is formed
/// in backward from the chunks again (LinearLogProbsWeightGrad), as it needs each row's incoming gradient.
FusionReport fuse_linear_log_probs(ir::Graph& graph, bool input_grad, int64_t chunk_rows = 0);

/// Rows a Slice keeps, computed alone: a Slice along a row axis moves above the op that produced
/// its input (Linear, LayerNorm, Softmax on another axis, elementwise ops, Dropout, Reshape and
/// Transpose that keep the axis, Embedding, whose ids it slices (an unpadded batch's gather of token rows), and
/// Attention, whose query rows it slices while every key and value stays) as long as nothing else reads that op's rows in full. A classifier that reads the first
/// token then runs its last layer's query, output projection, MLP and norms on one row per sequence;
/// only the keys and values still see every position. Dropout keeps the masks of the full tensor
/// (stream index attributes), so losses and gradients are those of the unpruned graph.
/// `fused`: ops rebuilt on fewer rows.
FusionReport prune_sliced_rows(ir::Graph& graph);

/// Decomposed LayerNorm, as ONNX exporters and hand-written modules spell it:
/// d = x - ReduceMean(x), Sqrt(ReduceMean(Pow(d, 2) or d·d) + eps), d divided by it, times
/// gamma, plus beta (last axis, keepdims, either operand order), with every intermediate read
/// only inside the pattern, becomes one LayerNorm(x, gamma, beta, eps): one pass for the
/// statistics and one for the output instead of eight, and the fused backward.
FusionReport fuse_decomposed_layernorm(ir::Graph& graph);

/// Decomposed RMSNorm (Llama's, as ONNX exporters write it): x / Sqrt(ReduceMean(Pow(x, 2) or x·x) + eps), the
/// division written as Div or as x times Div(1, ·), times a per-channel weight (last axis, keepdims, either operand
/// order), every intermediate read only inside the pattern, becomes RMSNorm(x, weight, eps) and its fused backward.
FusionReport fuse_decomposed_rmsnorm(ir::Graph& graph);

/// Rotary embeddings written out (transformers' apply_rotary_pos_emb as ONNX graphs hold it): x·cos +
/// Concat(−x2, x1)·sin on heads x = Transpose(u) (B, H, T, D) with x1, x2 Slices of its halves, cos and sin
/// (B or 1, 1, T, D) graph inputs, in either operand order, every intermediate read only inside the pattern, becomes
/// Transpose(RoPE(u, cos, sin)): one pass instead of seven ops, and the heads transpose moves after the rotation,
/// where fold_attention_transposes (run next) folds it into the attention.
FusionReport fuse_decomposed_rope(ir::Graph& graph);

/// SwiGLU written out (Llama's MLP as ONNX graphs hold it, Sigmoid imported as (1 + Tanh(x / 2)) / 2):
/// gate halved, Tanh, plus 1, halved, times gate, times up (halving as Scale 0.5, Mul 0.5 or Div 2; each product in
/// either order), every intermediate read only inside the pattern, becomes SwiGLU(gate, up): one pass over gate
/// and up and the fused backward instead of seven element-wise ops, each of whose outputs backward kept.
FusionReport fuse_decomposed_swiglu(ir::Graph& graph);

/// Under bf16 mixed precision, a Gelu whose input is the f32 result of a bf16 projection (a Linear or MatMul with
/// bf16 operands) reads it rounded to bf16 through a Cast, as autocast's bf16 projection hands it over:
/// fuse_linear_gelu then keeps the Linear's z in bf16 for backward (half the bytes) and fold_output_casts lets the
/// GELU write bf16 where the next projection reads it so. Graphs whose builders round it already (the built
/// families) have nothing for it to do. A SwiGLU whose gate and up are both such results reads both rounded and
/// writes bf16 (its kernel rounds silu(gate) to bf16 before the product, as autocast's silu does), so backward keeps
/// half the bytes and the next projection's Cast to bf16 goes; a reader that wants f32 gets a widening Cast. An
/// Attention with bf16 q, k, v writes bf16 (out_dtype), as autocast's scaled_dot_product_attention does, carried
/// through the heads merge (Reshape, Transpose) to the output projection: backward keeps the output in bf16.
FusionReport round_activation_inputs(ir::Graph& graph);

/// Erf-based GELU written out: 0.5 · x · (1 + Erf(x / √2)) (or x · 1/√2 inside, and the three
/// factors multiplied in any order), with every intermediate read only inside the pattern,
/// becomes Gelu(x) in its erf form, which fuse_linear_gelu can then fold into a Linear. The tanh form
/// (GPT-2's gelu_new) 0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · Pow(x, 3)))) likewise becomes Gelu in its
/// tanh form.
FusionReport fuse_erf_gelu(ir::Graph& graph);

}  // namespace fusetrain::passes
