#include "support/models.h"

#include <cmath>
#include <string>

namespace fusetrain::testing {

using ir::ValueId;

ValueId build_tiny_transformer(ir::GraphBuilder& b, const TinyTransformer& cfg) {
  const int64_t B = cfg.batch, T = cfg.seq, C = cfg.hidden, H = cfg.heads, D = C / H;
  ValueId ids = b.input("input_ids", {B, T}, DType::i64);
  ValueId mask = b.input("attention_mask", {B, T}, DType::f32);
  ValueId labels = b.input("labels", {B, T}, DType::i64);
  ValueId x = b.add(b.embedding(b.param("wte", {cfg.vocab, C}), ids), b.param("wpe", {T, C}));
  x = b.dropout(x, cfg.dropout);
  for (int64_t l = 0; l < cfg.layers; ++l) {
    std::string p = "h" + std::to_string(l) + ".";
    ValueId h = b.layer_norm(x, b.param(p + "ln1.weight", {C}), b.param(p + "ln1.bias", {C}));
    ValueId qkv = b.linear(h, b.param(p + "attn.qkv.weight", {3 * C, C}), b.param(p + "attn.qkv.bias", {3 * C}));
    std::vector<ValueId> parts = b.split(qkv, -1, {C, C, C});
    auto heads = [&](ValueId t) { return b.transpose(b.reshape(t, {B, T, H, D}), {0, 2, 1, 3}); };
    ValueId att = b.attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), mask,
                              1.0 / std::sqrt(static_cast<double>(D)), true, cfg.dropout);
    att = b.reshape(b.transpose(att, {0, 2, 1, 3}), {B, T, C});
    att = b.linear(att, b.param(p + "attn.proj.weight", {C, C}), b.param(p + "attn.proj.bias", {C}));
    x = b.add(x, b.dropout(att, cfg.dropout));
    h = b.layer_norm(x, b.param(p + "ln2.weight", {C}), b.param(p + "ln2.bias", {C}));
    h = b.gelu(b.linear(h, b.param(p + "mlp.fc.weight", {cfg.ffn, C}), b.param(p + "mlp.fc.bias", {cfg.ffn})), "tanh");
    h = b.linear(h, b.param(p + "mlp.proj.weight", {C, cfg.ffn}), b.param(p + "mlp.proj.bias", {C}));
    x = b.add(x, b.dropout(h, cfg.dropout));
  }
  x = b.layer_norm(x, b.param("ln_f.weight", {C}), b.param("ln_f.bias", {C}));
  ValueId logits = b.linear(x, b.param("head.weight", {cfg.vocab, C}));
  return b.softmax_cross_entropy(logits, labels);
}

ValueId build_mlp(ir::GraphBuilder& b, int64_t batch, int64_t in, int64_t hidden, int64_t classes) {
  ValueId x = b.input("x", {batch, in});
  ValueId labels = b.input("labels", {batch}, DType::i64);
  ValueId h = b.linear(x, b.param("fc1.weight", {hidden, in}), b.param("fc1.bias", {hidden}));
  h = b.gelu(b.layer_norm(h, b.param("norm.weight", {hidden}), b.param("norm.bias", {hidden})));
  ValueId logits = b.linear(h, b.param("fc2.weight", {classes, hidden}), b.param("fc2.bias", {classes}));
  b.graph().value(logits).name = "logits";
  return b.softmax_cross_entropy(logits, labels);
}

}  // namespace fusetrain::testing
