// Small model graphs shared by tests and examples.
#pragma once

#include "fusetrain/ir/builder.h"

namespace fusetrain::testing {

/// Sizes of the small transformer used by memory and allocation tests.
struct TinyTransformer {
  int64_t batch = 2, seq = 16, vocab = 50, hidden = 32, heads = 4, layers = 2, ffn = 64;
  double dropout = 0.1;
};

/// Token ids "input_ids" (B, T) i64, key mask "attention_mask" (B, T) f32 additive,
/// labels "labels" (B, T) i64 -> mean token cross-entropy. Pre-LN blocks with
/// attention and a GELU MLP. Returns the loss.
ir::ValueId build_tiny_transformer(ir::GraphBuilder& b, const TinyTransformer& cfg);

/// x (B, in) f32, labels (B) i64 -> Linear, LayerNorm, GELU, Linear, cross-entropy.
/// Returns the loss; the logits value is named "logits".
ir::ValueId build_mlp(ir::GraphBuilder& b, int64_t batch, int64_t in, int64_t hidden, int64_t classes);

}  // namespace fusetrain::testing
