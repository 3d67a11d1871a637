// The ONNX importer's fused patterns (see import_builder.h and docs/architecture.md, "ONNX import"): attention as
// exporters decompose it, with its padding, causal or per-head (ALiBi) additive mask, and a patch-embedding
// convolution as a Linear over the flattened patches.
#include <algorithm>
#include <cmath>
#include <optional>

#include "fusetrain/core/error.h"
#include "onnx/import_builder.h"

namespace fusetrain::onnx_import::detail {

// A (…, T, T) condition that keeps query t's keys s in (t − window, t] (every s <= t: window 0), the same for
// every leading index: that window, else nullopt.
std::optional<int64_t> causal_window(const HostTensor& keep) {
  const size_t r = keep.shape.size();
  if (r < 2 || keep.shape[r - 1] != keep.shape[r - 2]) return std::nullopt;
  const int64_t T = keep.shape[r - 1];
  int64_t window = 0;
  for (int64_t s = 0; s < T; ++s) window += keep.at((T - 1) * T + s) != 0;
  if (window == T) window = 0;
  for (int64_t k = 0; k < keep.numel(); ++k) {
    const int64_t t = (k / T) % T, s = k % T;
    if ((keep.at(k) != 0) != (s <= t && (window == 0 || s > t - window))) return std::nullopt;
  }
  return window;
}

// HeadKeyBias: the sum of f.terms at (b, h, t, s), each read as its 4-D shape with size-1 axes broadcast.
float summed_bias(const HostFeed& f, const std::vector<const HostTensor*>& terms, int64_t b, int64_t h, int64_t t,
                  int64_t s) {
  float x = 0;
  for (size_t k = 0; k < terms.size(); ++k) {
    const int64_t* d = f.bias_dims.data() + 4 * k;
    const int64_t at = (((d[0] == 1 ? 0 : b) * d[1] + (d[1] == 1 ? 0 : h)) * d[2] + (d[2] == 1 ? 0 : t)) * d[3] + s;
    x += terms[k]->f[size_t(at)];
  }
  return x;
}

// Writes the (B, H, S) key bias of f's summed terms (their last query row, which causal masking leaves whole)
// after checking every row is that bias (and, with causal rows, masked above the diagonal).
void fill_head_key_bias(const HostFeed& f, const std::vector<const HostTensor*>& terms, float* out) {
  const int64_t B = f.tuple_dims[0], H = f.tuple_dims[1], T = f.tuple_dims[2], S = f.tuple_dims[3];
  const bool causal = f.scalar != 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      float* key = out + (b * H + h) * S;
      for (int64_t s = 0; s < S; ++s) key[s] = summed_bias(f, terms, b, h, T - 1, s);
      for (int64_t t = 0; t + 1 < T; ++t)
        for (int64_t s = 0; s < S; ++s) {
          const float x = summed_bias(f, terms, b, h, t, s);
          const bool ok = causal && s > t ? x <= -1e30f : (x == key[s] || (x <= -1e30f && key[s] <= -1e30f));
          FT_CHECK(ok, "the graph's attention bias at (", b, ", ", h, ", ", t, ", ", s, ") is ", x,
                   ", which is neither a key bias per head", causal ? " plus a causal mask" : "",
                   "; import it with fuse_attention off");
        }
    }
}

// x transposed by `perm`, composed with the Transposes that produced x (one copy instead of a chain; a loop, as
// long as the chain the graph holds).
ValueId Builder::transposed(ValueId x, std::vector<int64_t> perm) {
  for (;;) {
    const ir::Value& v = graph_.value(x);
    if (perm == std::vector<int64_t>{0, 1, 3, 2} && v.shape.rank() == 4 && v.producer != ir::kNone &&
        graph_.node(v.producer).op == ops::OpKind::Reshape) {
      // The dynamo exporter's kᵀ: swapping its last two axes back is u.
      if (const ValueId u = unswapped(x); u != ir::kNone) return u;
    }
    if (v.producer != ir::kNone) {
      const ir::Node& t = graph_.node(v.producer);
      if (t.op == ops::OpKind::Transpose) {
        const std::vector<int64_t>& inner = t.attrs.get_ints("perm");
        std::vector<int64_t> composed(perm.size());
        for (size_t k = 0; k < perm.size(); ++k) composed[k] = inner[size_t(perm[k])];
        x = t.inputs[0];
        perm = std::move(composed);
        continue;
      }
    }
    break;
  }
  bool identity = true;
  for (size_t k = 0; k < perm.size(); ++k) identity = identity && perm[k] == int64_t(k);
  return identity ? x : b_.transpose(x, perm);
}

ValueId Builder::unswapped(ValueId x) const {
  const ir::Value& v = graph_.value(x);
  const int64_t r = v.shape.rank();
  if (v.producer == ir::kNone || r < 2) return ir::kNone;
  const ir::Node& t = graph_.node(v.producer);
  if (t.op == ops::OpKind::Transpose) {
    std::vector<int64_t> swap(static_cast<size_t>(r));
    for (int64_t k = 0; k < r; ++k) swap[size_t(k)] = k;
    std::swap(swap[size_t(r - 2)], swap[size_t(r - 1)]);
    return t.attrs.get_ints("perm") == swap ? t.inputs[0] : ir::kNone;
  }
  if (t.op != ops::OpKind::Reshape || r != 4) return ir::kNone;
  // Reshape (B, H, S, D) → (B·H, S, D), Transpose (0, 2, 1), Reshape → (B, H, D, S).
  const ir::Value& mid = graph_.value(t.inputs[0]);
  if (mid.producer == ir::kNone || graph_.node(mid.producer).op != ops::OpKind::Transpose ||
      graph_.node(mid.producer).attrs.get_ints("perm") != std::vector<int64_t>{0, 2, 1})
    return ir::kNone;
  const ir::Value& flat = graph_.value(graph_.node(mid.producer).inputs[0]);
  if (flat.producer == ir::kNone || graph_.node(flat.producer).op != ops::OpKind::Reshape) return ir::kNone;
  const ValueId u = graph_.node(flat.producer).inputs[0];
  const Shape& us = graph_.value(u).shape;
  const bool swapped = us.rank() == 4 && us[0] == v.shape[0] && us[1] == v.shape[1] && us[2] == v.shape[3] &&
                       us[3] == v.shape[2];
  return swapped ? u : ir::kNone;
}

// x (B, H, S, D) as exporters write transformers' repeat_kv, Reshape to (B, Hkv, 1, S, D), Expand to (B, Hkv, r, S,
// D) (imported as an add of zeros), Reshape to (B, Hkv·r, S, D): the (B, Hkv, S, D) value repeated, which
// grouped-query Attention reads as it is (no repeated copy, no sum of the repeats' gradients). x otherwise.
ValueId Builder::unrepeated_heads(ValueId x) const {
  auto made_by = [&](ValueId v, ops::OpKind op) -> const ir::Node* {
    const ir::NodeId p = graph_.value(v).producer;
    return p != ir::kNone && graph_.node(p).op == op ? &graph_.node(p) : nullptr;
  };
  const Shape& xs = graph_.value(x).shape;
  const ir::Node* merge = made_by(x, ops::OpKind::Reshape);
  const ir::Node* expand = merge ? made_by(merge->inputs[0], ops::OpKind::Add) : nullptr;
  if (!expand || xs.rank() != 4) return x;
  for (int side = 0; side < 2; ++side) {
    const ir::Node* zeros = made_by(expand->inputs[size_t(1 - side)], ops::OpKind::Fill);
    const ir::Node* split = made_by(expand->inputs[size_t(side)], ops::OpKind::Reshape);
    if (!zeros || zeros->attrs.get_float("value") != 0.0 || !split) continue;
    const ValueId kv = split->inputs[0];
    const Shape& ks = graph_.value(kv).shape;
    const Shape& grouped = graph_.value(expand->inputs[size_t(side)]).shape;
    const Shape& repeated = graph_.value(expand->outputs[0]).shape;
    if (ks.rank() == 4 && ks[0] == xs[0] && ks[2] == xs[2] && ks[3] == xs[3] && xs[1] % ks[1] == 0 &&
        grouped == Shape{ks[0], ks[1], 1, ks[2], ks[3]} &&
        repeated == Shape{ks[0], ks[1], xs[1] / ks[1], ks[2], ks[3]})
      return kv;
  }
  return x;
}

ValueId Builder::attention_operand(ValueId v) {
  const ir::Value& value = graph_.value(v);
  if (!spec_.bf16 || spec_.fp16 || value.dtype != DType::f32) return v;
  if (value.producer != ir::kNone) {
    const ir::Node& t = graph_.node(value.producer);
    const std::vector<int64_t> heads{0, 2, 1, 3};
    if (t.op == ops::OpKind::Transpose && t.attrs.get_ints("perm") == heads)
      return b_.transpose(b_.cast(t.inputs[0], DType::bf16), heads);
  }
  return b_.cast(v, DType::bf16);
}

// Scaled dot-product attention as exporters decompose it, recognised at its last MatMul:
//   MatMul(Softmax(Add(s·MatMul(s_q·q, s_k·kᵀ), mask)), v), the scores optionally soft-capped (c·Tanh(x / c),
//   Gemma 2) before the mask, Softmax's output optionally through
//   Where(IsNaN(p), 0, p), with q (B, H, T, D), kᵀ (B, H, D, S), v (B, H, S, D) and a mask from the batch that
//   is a key-padding mask, or causal plus one. It becomes one Attention op (the kernel the built models use),
//   reading the mask as (B, S) additive (the host checks, each batch, that it has that form). One of the added
//   terms may be computed from parameters, (B|1, H|1, T, S): the op's differentiated score bias (T5 gathers its
//   relative position bias from a trained table and folds the mask into it with a Where). The decomposed
//   ops it replaces are left unread and never run. kNone when the pattern does not hold.
ValueId Builder::attention(const NodeProto& n) {
  if (!f_.fuse_attention()) return ir::kNone;
  const int p = in_id(n, 0), v = in_id(n, 1);
  if (!is_ir(v)) return ir::kNone;
  int probs = p;
  // BLOOM's form: the heads folded into the batch, MatMul(Reshape(probs (B, H, T, S) -> (B·H, T, S)), v (B·H, S, D)).
  bool flat = false;
  if (shape_of(v).size() == 3) {
    const NodeProto* r = producer(p);
    if (!r || r->op_type() != "Reshape") return ir::kNone;
    const int inner = ids_.at(r->input(0));
    const std::vector<int64_t> ps = shape_of(inner);
    if (!is_ir(inner) || ps.size() != 4 || ps[0] * ps[1] != shape_of(v)[0]) return ir::kNone;
    probs = inner;
    flat = true;
  } else if (shape_of(v).size() != 4) {
    return ir::kNone;
  }
  if (const NodeProto* w = producer(p); w && w->op_type() == "Where") {  // SDPA's NaN guard
    const int c = ids_.at(w->input(0));
    if (kind(c) != Kind::IsNaNOf) return ir::kNone;
    probs = nan_source_[size_t(c)];
  }
  const NodeProto* softmax = producer(probs);
  if (!softmax || softmax->op_type() != "Softmax") return ir::kNone;
  const int64_t axis = attr_int(*softmax, "axis", -1);
  if (axis != -1 && axis != 3) return ir::kNone;
  int scores = ids_.at(softmax->input(0));
  // fusetrain's own export masks causal (and sliding-window) attention with Where(keep, scores, lowest float), keep
  // a constant of the build's (T, T): the band it keeps is the causality and the window.
  bool banded = false;
  int64_t window = 0;
  if (const NodeProto* w = producer(scores); w && w->op_type() == "Where") {
    const int keep = ids_.at(w->input(0)), kept = ids_.at(w->input(1)), other = ids_.at(w->input(2));
    double fill = 0;
    if (kind(keep) != Kind::Const || !is_ir(kept) || !scalar_const(other, fill) || fill > -1e30) return ir::kNone;
    // Every layer reads the same condition: its (T, T) band is read once.
    auto known = band_windows_.find(keep);
    if (known == band_windows_.end()) known = band_windows_.emplace(keep, causal_window(host_[size_t(keep)])).first;
    const std::optional<int64_t> band = known->second;
    if (!band) return ir::kNone;
    banded = true;
    window = *band;
    scores = kept;
  }
  // Additive biases from the batch between the scores and Softmax (host values: a padding or causal mask, ALiBi's
  // per-head key bias), read back across the Reshape of (B·H, T, S) scores to (B, H, T, S) in BLOOM's form.
  // One bias computed from parameters may be among them (T5's relative position buckets gathered from a trained
  // table, with the mask folded in by a Where): the kernel's differentiated score bias.
  std::vector<std::pair<int, bool>> biases;  // (host value, read in the (B·H, ...) layout)
  int score_bias = -1;
  const std::vector<int64_t> probs_shape = shape_of(probs);
  bool crossed = false;
  auto from_product = [&](int x) {
    double unused = 1.0;
    const NodeProto* m = producer(unscaled(x, unused));
    return m && m->op_type() == "MatMul";
  };
  for (int step = 0; step < 4; ++step) {
    const NodeProto* op = producer(scores);
    if (op && op->op_type() == "Add") {
      const int a = ids_.at(op->input(0)), b = ids_.at(op->input(1));
      if (is_host(b) && is_ir(a)) {
        biases.emplace_back(b, crossed);
        scores = a;
      } else if (is_host(a) && is_ir(b)) {
        biases.emplace_back(a, crossed);
        scores = b;
      } else if (is_ir(a) && is_ir(b) && score_bias < 0 && !flat) {
        const bool a_scores = from_product(a);
        if (!a_scores && !from_product(b)) return ir::kNone;
        score_bias = a_scores ? b : a;
        scores = a_scores ? a : b;
      } else {
        return ir::kNone;
      }
    } else if (flat && !crossed && op && op->op_type() == "Reshape" && shape_of(ids_.at(op->input(0))).size() == 3) {
      scores = ids_.at(op->input(0));
      crossed = true;
    } else {
      break;
    }
  }
  if (flat != crossed) return ir::kNone;
  // Gemma 2's logit soft-capping between the scores and the mask, c·Tanh(s / c): the kernel's softcap.
  double softcap = 0.0;
  {
    double outer = 1.0, inner = 1.0;
    const int t = unscaled(scores, outer);
    const NodeProto* th = producer(t);
    if (t != scores && th && th->op_type() == "Tanh" && outer > 0.0) {
      const int x = unscaled(ids_.at(th->input(0)), inner);
      if (x != ids_.at(th->input(0)) && std::abs(inner * outer - 1.0) < 1e-6) {
        softcap = outer;
        scores = x;
      }
    }
  }
  double scale = 1.0;
  scores = unscaled(scores, scale);
  const NodeProto* qk = producer(scores);
  if (!qk || qk->op_type() != "MatMul") return ir::kNone;
  const int q = unscaled(ids_.at(qk->input(0)), scale), kt = unscaled(ids_.at(qk->input(1)), scale);
  if (!is_ir(q) || !is_ir(kt)) return ir::kNone;
  std::vector<int64_t> qs = shape_of(q), ks = shape_of(kt), vs = shape_of(v);
  if (flat) {  // (B·H, T, D), (B·H, D, S), (B·H, S, D) read as (B, H, ...)
    const int64_t B = probs_shape[0], H = probs_shape[1];
    if (qs.size() != 3 || ks.size() != 3 || qs[0] != B * H || ks[0] != B * H) return ir::kNone;
    qs = {B, H, qs[1], qs[2]};
    ks = {B, H, ks[1], ks[2]};
    vs = {B, H, vs[1], vs[2]};
  }
  if (qs.size() != 4 || ks.size() != 4) return ir::kNone;
  const int64_t B = qs[0], H = qs[1], T = qs[2], D = qs[3], S = ks[3];
  if (ks != std::vector<int64_t>{B, H, D, S} || vs != std::vector<int64_t>{B, H, S, D}) return ir::kNone;
  ValueId learned = ir::kNone;
  if (score_bias >= 0) {  // (B|1, H|1, T, S), f32 in the kernel
    const std::vector<int64_t> bs = shape_of(score_bias);
    if (softcap > 0.0 || bs.size() != 4 || (bs[0] != B && bs[0] != 1) || (bs[1] != H && bs[1] != 1) || bs[2] != T ||
        bs[3] != S || !is_floating(graph_.value(ir_of(score_bias)).dtype))
      return ir::kNone;
    learned = ir_of(score_bias);
    if (graph_.value(learned).dtype != DType::f32) learned = b_.cast(learned, DType::f32);
  }
  // One bias of a padding or causal mask's shape (B|1, 1, T|1, S) is the kernel's key mask, read below; others (per
  // head: ALiBi's, T5's cross-attention mask broadcast over its heads) are a key bias per head.
  const bool one_mask = biases.size() == 1 && !biases[0].second && [&] {
    const std::vector<int64_t>& m = host_[size_t(biases[0].first)].shape;
    return m.size() == 4 && m[1] == 1;
  }();
  if (!biases.empty() && !one_mask) {
    if (banded) return ir::kNone;
    const std::optional<std::pair<ValueId, bool>> bias = head_key_bias(biases, B, H, T, S);
    if (!bias) return ir::kNone;
    const ValueId q4 = flat ? b_.reshape(ir_of(q), {B, H, T, D}) : ir_of(q);
    const ValueId k4 = transposed(flat ? b_.reshape(ir_of(kt), {B, H, D, S}) : ir_of(kt), {0, 1, 3, 2});
    const ValueId v4 = flat ? b_.reshape(ir_of(v), {B, H, S, D}) : ir_of(v);
    const ValueId y = b_.attention(attention_operand(q4), attention_operand(k4), attention_operand(v4), bias->first,
                                   scale, bias->second, 0.0, DType::f32, 0, softcap, ir::kNone, learned);
    return flat ? b_.reshape(y, {B * H, T, D}) : y;
  }
  const int mask = biases.empty() ? -1 : biases[0].first;
  // The mask: broadcastable to (B, 1, T, S) and, on the build's all-ones attention mask, zero (a padding mask) or
  // causal (lowest above the diagonal).
  ValueId key_mask = ir::kNone;
  bool causal = false;
  if (mask >= 0) {
    const HostTensor& m = host_[size_t(mask)];
    if (m.shape.size() != 4 || !m.is_float() || (m.shape[0] != B && m.shape[0] != 1) || m.shape[1] != 1 ||
        (m.shape[2] != T && m.shape[2] != 1) || m.shape[3] != S)
      return ir::kNone;
    bool zero = true, lower = T == S;
    for (int64_t b = 0; b < m.shape[0]; ++b)
      for (int64_t t = 0; t < m.shape[2]; ++t)
        for (int64_t s = 0; s < S; ++s) {
          const float x = m.f[size_t((b * m.shape[2] + t) * S + s)];
          zero = zero && x == 0.0f;
          lower = lower && (s > t ? x <= -1e30f : x == 0.0f);
        }
    if (!zero && !(lower && m.shape[2] == T)) return ir::kNone;
    causal = !zero;
    key_mask_causal_[mask] = causal;
    key_mask = feed(mask, Feed::KeyMask, true, causal ? 1.0 : 0.0);
  }
  if (banded && qs[2] != ks[3]) return ir::kNone;
  causal = causal || banded;
  ValueId k = transposed(ir_of(kt), {0, 1, 3, 2}), vv = ir_of(v);
  // Repeated key/value heads: the grouped ones, when both k and v are repeats of the same grouping.
  const ValueId grouped_k = unrepeated_heads(k), grouped_v = unrepeated_heads(vv);
  if (grouped_k != k && grouped_v != vv && graph_.value(grouped_k).shape == graph_.value(grouped_v).shape) {
    k = grouped_k;
    vv = grouped_v;
  }
  return b_.attention(attention_operand(ir_of(q)), attention_operand(k), attention_operand(vv), key_mask, scale,
                      causal, 0.0, DType::f32, window, softcap, ir::kNone, learned);
}

// The (B, H, S) key bias of attention biases summed to (B, H, T, S) (ALiBi's slope·position per head, plus a padding
// and causal mask), fed from the host each batch (fill_head_key_bias checks every row); kNone when the build's
// values do not have that form. Each bias is broadcast from its shape: (B|1, H|1, T|1, S), or (B·H|1, T|1, S) read
// before the heads were split from the batch.
std::optional<std::pair<ValueId, bool>> Builder::head_key_bias(const std::vector<std::pair<int, bool>>& biases,
                                                               int64_t B, int64_t H, int64_t T, int64_t S) {
  HostFeed f;
  f.feed = Feed::HeadKeyBias;
  f.as_float = true;
  f.tuple_dims = {B, H, T, S};
  std::string name = "onnx:head_key_bias";
  std::vector<const HostTensor*> terms;
  bool constant = true;
  for (const auto& [value, flat] : biases) {
    const HostTensor& h = host_[size_t(value)];
    if (!h.is_float()) return std::nullopt;
    std::vector<int64_t> d = h.shape;
    if (flat) {
      if (d.size() != 3 || (d[0] != B * H && d[0] != 1)) return std::nullopt;
      d = {d[0] == 1 ? 1 : B, d[0] == 1 ? 1 : H, d[1], d[2]};
    }
    while (d.size() < 4) d.insert(d.begin(), 1);
    const int64_t want[4] = {B, H, T, S};
    if (d.size() != 4 || d[3] != S) return std::nullopt;
    for (int k = 0; k < 3; ++k)
      if (d[size_t(k)] != 1 && d[size_t(k)] != want[k]) return std::nullopt;
    f.terms.push_back(value);
    f.bias_dims.insert(f.bias_dims.end(), d.begin(), d.end());
    terms.push_back(&h);
    constant = constant && kind(value) == Kind::Const;
    name += ":" + names_[size_t(value)];
  }
  f.value = f.terms[0];
  // Causal rows when the build's values mask every key after its query (T == S); else none may be masked.
  bool causal = T == S;
  for (int64_t b = 0; b < B && causal; ++b)
    for (int64_t h = 0; h < H && causal; ++h)
      for (int64_t t = 0; t < T && causal; ++t)
        for (int64_t s = t + 1; s < S && causal; ++s) causal = summed_bias(f, terms, b, h, t, s) <= -1e30f;
  f.scalar = causal ? 1.0 : 0.0;
  std::vector<float> built(size_t(B * H * S));
  try {
    fill_head_key_bias(f, terms, built.data());
  } catch (const Error&) {
    return std::nullopt;  // not a key bias per head on the build's batch: the graph's ops compute it as written
  }
  if (auto it = feeds_.find(name); it != feeds_.end()) return std::pair{it->second, causal};  // every layer's
  f.input = name;
  if (constant) {
    f.constant = true;
    f.const_f = std::move(built);
  }
  prog_.feeds.push_back(std::move(f));
  const ValueId x = b_.input(name, Shape({B, H, S}), DType::f32);
  feeds_[name] = x;
  return std::pair{x, causal};
}

// The pads of a windowed op (Conv, MaxPool, AveragePool) over x of dims `xs` with windows `kernel`: its "pads", or
// those its auto_pad stands for (VALID: none; SAME_UPPER / SAME_LOWER: an output of ceil(in / stride), the odd one
// after or before).
std::vector<int64_t> Builder::window_pads(const NodeProto& n, const std::vector<int64_t>& xs,
                                          const std::vector<int64_t>& kernel, const std::vector<int64_t>& strides,
                                          const std::vector<int64_t>& dilations) {
  const size_t spatial = xs.size() - 2;
  std::vector<int64_t> pads = attr_ints(n, "pads");
  const std::string auto_pad = attr_string(n, "auto_pad", "NOTSET");
  FT_CHECK(auto_pad == "NOTSET" || auto_pad == "VALID" || auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER",
           n.op_type(), " with auto_pad \"", auto_pad, "\"; expected NOTSET, VALID, SAME_UPPER or SAME_LOWER");
  if (auto_pad == "VALID") pads.assign(2 * spatial, 0);
  if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") {
    FT_CHECK(kernel.size() == spatial, n.op_type(), ": ", kernel.size(), " window sizes for ", spatial,
             " spatial axes");
    pads.assign(2 * spatial, 0);
    for (size_t a = 0; a < spatial; ++a) {
      const int64_t in = xs[2 + a], k = kernel[a], s = strides.size() > a ? strides[a] : 1,
                    d = dilations.size() > a ? dilations[a] : 1;
      const int64_t total = std::max<int64_t>(0, ((in + s - 1) / s - 1) * s + (k - 1) * d + 1 - in);
      pads[a] = auto_pad == "SAME_UPPER" ? total / 2 : total - total / 2;
      pads[a + spatial] = total - pads[a];
    }
  }
  return pads;
}

// MaxPool and AveragePool (1-D and 2-D) as the engine's Pool with ONNX's attributes; GlobalAveragePool as the mean
// over the spatial axes, GlobalMaxPool as one window over all of them. MaxPool's Indices output is not mapped.
ValueId Builder::pool(const NodeProto& n) {
  const std::string& op = n.op_type();
  const std::vector<int64_t> xs = shape_of(in_id(n, 0));
  FT_CHECK(xs.size() == 3 || xs.size() == 4, op, " of an input of rank ", xs.size(),
           "; fusetrain maps 1-D and 2-D pooling (rank 3 or 4)");
  const ValueId x = ir_of(in_id(n, 0));
  if (op == "GlobalAveragePool") return xs.size() == 3 ? b_.reduce_mean(x, {2}, true) : b_.reduce_mean(x, {2, 3}, true);
  if (op == "GlobalMaxPool") return b_.pool(x, true, std::vector<int64_t>(xs.begin() + 2, xs.end()));
  FT_CHECK(n.output_size() < 2 || n.output(1).empty(), "MaxPool's Indices output (fusetrain maps its values only)");
  const std::vector<int64_t> kernel = attr_ints(n, "kernel_shape"), strides = attr_ints(n, "strides"),
                             dilations = attr_ints(n, "dilations");
  FT_CHECK(kernel.size() == xs.size() - 2, op, " with ", kernel.size(), " kernel sizes over ", xs.size() - 2,
           " spatial axes");
  return b_.pool(x, op == "MaxPool", kernel, strides, window_pads(n, xs, kernel, strides, dilations), dilations,
                 attr_int(n, "ceil_mode", 0) != 0, attr_int(n, "count_include_pad", 0) != 0);
}

// A 2-D convolution whose kernel tiles the image (kernel == stride, no padding, dilation 1, one group: the patch
// embedding of ViT and its kin) is a Linear over the flattened patches:
//   x (B, C, H, W) -> patches (B·P·Q, C·p·q) · W(O, C·p·q)ᵀ + bias -> (B, O, P, Q),  P = H / p, Q = W / q.
// Any other 1-D or 2-D convolution is the engine's Conv, with ONNX's attributes (auto_pad SAME_* turned into the
// pads it stands for); under bf16 mixed precision its x and w are bf16, as autocast hands them to the convolution.
ValueId Builder::conv(const NodeProto& n) {
  const std::vector<int64_t> xs = shape_of(in_id(n, 0)), ws = shape_of(in_id(n, 1));
  FT_CHECK((xs.size() == 3 || xs.size() == 4) && ws.size() == xs.size(), "Conv of an input of rank ", xs.size(),
           " and a weight of rank ", ws.size(), "; fusetrain maps 1-D and 2-D convolutions (both of rank 3 or 4)");
  const std::vector<int64_t> strides = attr_ints(n, "strides"), dilations = attr_ints(n, "dilations");
  const std::vector<int64_t> kernel(ws.begin() + 2, ws.end());
  const std::vector<int64_t> pads = window_pads(n, xs, kernel, strides, dilations);
  const int64_t group = attr_int(n, "group", 1);
  const bool no_pads = std::all_of(pads.begin(), pads.end(), [](int64_t p) { return p == 0; });
  const bool unit_dilation = std::all_of(dilations.begin(), dilations.end(), [](int64_t d) { return d == 1; });
  if (xs.size() == 4 && group == 1 && no_pads && unit_dilation && strides == kernel && xs[2] % ws[2] == 0 &&
      xs[3] % ws[3] == 0 && ws[1] == xs[1])
    return patch_conv(n);
  ValueId x = ir_of(in_id(n, 0)), w = ir_of(in_id(n, 1));
  if (spec_.bf16 && !spec_.fp16) {  // the kernel's operands are f32 or bf16: under fp16 it keeps f32
    x = gemm_operand(x);
    w = gemm_operand(w);
  }
  const int bias = in_id(n, 2);
  return b_.conv(x, w, bias >= 0 ? ir_of(bias) : ir::kNone, strides, pads, dilations, group);
}

// The tiling convolution as a Linear over its patches (conv's first case).
ValueId Builder::patch_conv(const NodeProto& n) {
  const std::vector<int64_t> xs = shape_of(in_id(n, 0)), ws = shape_of(in_id(n, 1));
  const int64_t B = xs[0], C = xs[1], H = xs[2], W = xs[3], O = ws[0], p = ws[2], q = ws[3];
  const int64_t P = H / p, Q = W / q;
  ValueId x = b_.reshape(ir_of(in_id(n, 0)), {B, C, P, p, Q, q});
  x = b_.reshape(b_.transpose(x, {0, 2, 4, 1, 3, 5}), {B * P * Q, C * p * q});  // (B·P·Q, C·p·q)
  const ValueId w = b_.reshape(ir_of(in_id(n, 1)), {O, C * p * q});
  const int bias = in_id(n, 2);
  const ValueId y = bias >= 0 ? b_.linear(gemm_operand(x), gemm_operand(w), ir_of(bias))
                              : b_.linear(gemm_operand(x), gemm_operand(w));  // (B·P·Q, O)
  return b_.transpose(b_.reshape(y, {B, P, Q, O}), {0, 3, 1, 2});
}

}  // namespace fusetrain::onnx_import::detail
