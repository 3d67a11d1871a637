// Decomposed LayerNorm, RMSNorm, GELU, SwiGLU and rotary embeddings, as exporters write them, back into the fused
// ops (see fusion.h).
#include <cmath>
#include <map>
#include <numbers>
#include <optional>

#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {


// Pattern matching over one graph: who reads what, and which nodes a rewrite has consumed.
class Matcher {
 public:
  explicit Matcher(ir::Graph& g) : g(g), consumers_(g.consumers()) {}

  ir::Graph& g;
  // Values one rewrite made, by the value they derive from, with the node they run before: a later rewrite whose
  // nodes run after that one reads them instead of making them again.
  std::map<ValueId, std::pair<NodeId, ValueId>> made;

  // The live node producing v when its op is `op` and v is an intermediate (read by exactly
  // one node, not a graph output); null otherwise.
  const ir::Node* inner(ValueId v, OpKind op) const {
    const ir::Node* n = producer(v, op);
    return n && single_reader(v) ? n : nullptr;
  }

  const ir::Node* producer(ValueId v, OpKind op) const {
    const ir::Value& value = g.value(v);
    if (value.producer == kNone || g.is_removed(value.producer)) return nullptr;
    const ir::Node& n = g.node(value.producer);
    return n.op == op ? &n : nullptr;
  }

  // The one node reading v when v is not a graph output.
  const ir::Node* only_reader(ValueId v) const {
    if (!single_reader(v)) return nullptr;
    const ir::Node& n = g.node(consumers_[static_cast<size_t>(v)][0]);
    return g.is_removed(n.id) ? nullptr : &n;
  }

  const std::vector<NodeId>& readers(ValueId v) const { return consumers_[static_cast<size_t>(v)]; }

  bool single_reader(ValueId v) const {
    const std::vector<NodeId>& readers = consumers_[static_cast<size_t>(v)];
    if (g.is_output(v) || readers.empty()) return false;
    for (NodeId r : readers)
      if (r != readers[0]) return false;  // one node, possibly reading v twice
    return true;
  }

  // The value of a one-element Fill (a scalar constant), if v is one.
  std::optional<double> constant(ValueId v) const {
    if (v == kNone) return std::nullopt;
    const ir::Node* fill = producer(v, OpKind::Fill);
    if (!fill || g.value(v).shape.numel() != 1) return std::nullopt;
    return fill->attrs.get_float("value");
  }

  bool constant_near(ValueId v, double expected) const {
    std::optional<double> c = constant(v);
    return c && std::abs(*c - expected) <= 1e-6 * std::max(1.0, std::abs(expected));
  }

  // For a binary node with `known` as one operand: the other operand (kNone if neither is known).
  static ValueId other_operand(const ir::Node& n, ValueId known) {
    if (n.inputs[0] == known) return n.inputs[1];
    if (n.inputs[1] == known) return n.inputs[0];
    return kNone;
  }

  // ReduceMean over the last axis only, keeping it.
  bool mean_over_last_axis(const ir::Node& n) const {
    const int64_t rank = g.value(n.inputs[0]).shape.rank();
    const std::vector<int64_t>& axes = n.attrs.get_ints("axes");
    return n.attrs.get_int("keepdims", 0) == 1 && axes.size() == 1 && (axes[0] == -1 || axes[0] == rank - 1);
  }

  // Removes `nodes`, and the constants (Fills) that only they read.
  void kill(std::initializer_list<const ir::Node*> nodes) {
    for (const ir::Node* n : nodes) g.remove_node(n->id);
    for (const ir::Node* n : nodes)
      for (ValueId in : n->inputs) {
        const ir::Node* fill = producer(in, OpKind::Fill);
        if (!fill || g.is_output(in)) continue;
        bool unread = true;
        for (NodeId r : readers(in)) unread = unread && g.is_removed(r);
        if (unread) g.remove_node(fill->id);
      }
  }

 private:
  std::vector<std::vector<NodeId>> consumers_;
};

// Under `sqrt_node`: Sqrt(ReduceMean(Pow(d, 2) or d·d over the last axis) + eps), every intermediate read only
// there. Null when the nodes do not have that form.
struct MeanSquare {
  const ir::Node *eps_add, *mean, *square;
  double eps;
  ValueId d;  // the value squared
};
std::optional<MeanSquare> mean_square_under(const Matcher& m, const ir::Node& sqrt_node) {
  const ir::Node* eps_add = m.inner(sqrt_node.inputs[0], OpKind::Add);
  if (!eps_add) return std::nullopt;
  double eps = 0.0;
  ValueId variance = kNone;
  for (int side = 0; side < 2 && variance == kNone; ++side) {
    std::optional<double> c = m.constant(eps_add->inputs[static_cast<size_t>(side)]);
    if (c && *c > 0.0) {
      eps = *c;
      variance = eps_add->inputs[static_cast<size_t>(1 - side)];
    }
  }
  const ir::Node* mean = variance == kNone ? nullptr : m.inner(variance, OpKind::ReduceMean);
  if (!mean || !m.mean_over_last_axis(*mean)) return std::nullopt;
  const ValueId squared = mean->inputs[0];
  const ir::Node* square = m.inner(squared, OpKind::Pow);
  if (square && square->attrs.get_float("exponent") != 2.0) return std::nullopt;
  if (!square) {
    square = m.inner(squared, OpKind::Mul);
    if (!square || square->inputs[0] != square->inputs[1]) return std::nullopt;
  }
  return MeanSquare{eps_add, mean, square, eps, square->inputs[0]};
}

// Sqrt(ReduceMean((x - ReduceMean(x))^2) + eps) at `sqrt_node`, divided into the centred x, then
// scaled by gamma and shifted by beta: rewritten into LayerNorm at the final Add. True if it was.
bool rewrite_layernorm(Matcher& m, const ir::Node& sqrt_node) {
  ir::Graph& g = m.g;
  const std::optional<MeanSquare> ms = mean_square_under(m, sqrt_node);
  if (!ms) return false;
  const ir::Node *eps_add = ms->eps_add, *var_mean = ms->mean, *square = ms->square;
  const double eps = ms->eps;
  const ValueId centred = ms->d;
  const ir::Node* sub = m.producer(centred, OpKind::Sub);
  if (!sub || g.is_output(centred)) return false;
  const ValueId x = sub->inputs[0];
  const ir::Node* mean = m.inner(sub->inputs[1], OpKind::ReduceMean);
  if (!mean || mean->inputs[0] != x || !m.mean_over_last_axis(*mean)) return false;
  const ir::Value& xv = g.value(x);
  if (xv.dtype != DType::f32 || xv.shape.rank() < 1 || g.value(centred).shape != xv.shape) return false;
  // Normalised = centred / sqrt(...): the only other reader of `centred`.
  const ir::Node* div = m.only_reader(sqrt_node.outputs[0]);
  if (!div || div->op != OpKind::Div || div->inputs[0] != centred || div->inputs[1] != sqrt_node.outputs[0])
    return false;
  for (NodeId r : m.readers(centred))
    if (r != square->id && r != div->id) return false;
  const Shape channels{xv.shape[-1]};
  auto per_channel = [&](ValueId v) {
    return v != kNone && g.value(v).shape == channels && g.value(v).dtype == DType::f32;
  };
  const ir::Node* scale = m.only_reader(div->outputs[0]);
  const ValueId gamma = scale && scale->op == OpKind::Mul ? Matcher::other_operand(*scale, div->outputs[0]) : kNone;
  if (!per_channel(gamma)) return false;
  const ir::Node* shift = m.only_reader(scale->outputs[0]);
  const ValueId beta = shift && shift->op == OpKind::Add ? Matcher::other_operand(*shift, scale->outputs[0]) : kNone;
  if (!per_channel(beta) || g.value(shift->outputs[0]).shape != xv.shape) return false;

  const NodeId at = shift->id;
  m.kill({mean, sub, square, var_mean, eps_add, &sqrt_node, div, scale});
  g.set_op(at, OpKind::LayerNorm, {x, gamma, beta}, ir::Attrs{{"eps", eps}});  // adds mean and rstd
  return true;
}

// x / Sqrt(ReduceMean(x²) + eps) at `sqrt_node` (as Div(x, s), or x times Div(1, s) in either order), then times a
// per-channel weight on either side: rewritten into RMSNorm at that last Mul. True if it was.
bool rewrite_rmsnorm(Matcher& m, const ir::Node& sqrt_node) {
  ir::Graph& g = m.g;
  const std::optional<MeanSquare> ms = mean_square_under(m, sqrt_node);
  if (!ms) return false;
  const ValueId x = ms->d, s = sqrt_node.outputs[0];
  const ir::Value& xv = g.value(x);
  if (xv.dtype != DType::f32 || xv.shape.rank() < 1) return false;
  const ir::Node* after = m.only_reader(s);
  if (!after || after->op != OpKind::Div || after->inputs[1] != s) return false;
  const ir::Node* reciprocal = nullptr;
  const ir::Node* norm = after;
  if (after->inputs[0] != x) {
    if (!m.constant_near(after->inputs[0], 1.0)) return false;
    reciprocal = after;
    norm = m.only_reader(reciprocal->outputs[0]);
    if (!norm || norm->op != OpKind::Mul || Matcher::other_operand(*norm, reciprocal->outputs[0]) != x) return false;
  }
  if (!(g.value(norm->outputs[0]).shape == xv.shape)) return false;
  const ir::Node* scale = m.only_reader(norm->outputs[0]);
  const ValueId weight = scale && scale->op == OpKind::Mul ? Matcher::other_operand(*scale, norm->outputs[0]) : kNone;
  if (weight == kNone || !(g.value(weight).shape == Shape{xv.shape[-1]}) || g.value(weight).dtype != DType::f32 ||
      !(g.value(scale->outputs[0]).shape == xv.shape))
    return false;
  const NodeId at = scale->id;
  m.kill({ms->square, ms->mean, ms->eps_add, &sqrt_node, norm});
  if (reciprocal) m.kill({reciprocal});
  g.set_op(at, OpKind::RMSNorm, {x, weight}, ir::Attrs{{"eps", ms->eps}});  // adds rstd
  return true;
}

// The shared tail of both GELU forms: `inside` = erf(x / √2) or tanh(...) at `core`, then 1 + inside, then
// multiplied by x and 0.5 in any order (x · 0.5 first, or either factor last). Rewrites the last Mul into Gelu
// with `approximate`, removing `core`, `earlier` (the nodes before it) and the tail. True if it matched.
bool rewrite_gelu_tail(Matcher& m, ValueId x, const ir::Node& core, std::initializer_list<const ir::Node*> earlier,
                       const char* approximate) {
  ir::Graph& g = m.g;
  const ir::Node* plus_one = m.only_reader(core.outputs[0]);
  if (!plus_one || plus_one->op != OpKind::Add ||
      !m.constant_near(Matcher::other_operand(*plus_one, core.outputs[0]), 1.0))
    return false;
  const ValueId cdf2 = plus_one->outputs[0];  // 1 + erf(x / √2)
  const ir::Node* first = m.only_reader(cdf2);
  if (!first || first->op != OpKind::Mul) return false;
  const ValueId other = Matcher::other_operand(*first, cdf2);
  const ir::Node* root = nullptr;
  const ir::Node* half_mul = nullptr;  // Mul(x, 0.5) feeding `first`, in the first form
  if (const ir::Node* h = m.inner(other, OpKind::Mul); h && m.constant_near(Matcher::other_operand(*h, x), 0.5)) {
    root = first;  // (x · 0.5) · (1 + erf)
    half_mul = h;
  } else if (other == x || m.constant_near(other, 0.5)) {
    const ir::Node* second = m.only_reader(first->outputs[0]);
    const ValueId last =
        second && second->op == OpKind::Mul ? Matcher::other_operand(*second, first->outputs[0]) : kNone;
    if (last != kNone && (other == x ? m.constant_near(last, 0.5) : last == x)) root = second;
  }
  if (!root || g.value(root->outputs[0]).shape != g.value(x).shape) return false;

  const NodeId at = root->id;
  for (const ir::Node* n : earlier) m.kill({n});
  m.kill({&core, plus_one});
  if (root != first) m.kill({first});
  if (half_mul) m.kill({half_mul});
  g.set_op(at, OpKind::Gelu, {x}, ir::Attrs{{"approximate", std::string(approximate)}});
  return true;
}

// 0.5 · x · (1 + erf(x / √2)) around `erf_node`, in any order of its three factors: rewritten
// into Gelu (erf form) at the last Mul. True if it was.
bool rewrite_erf_gelu(Matcher& m, const ir::Node& erf_node) {
  ir::Graph& g = m.g;
  const ValueId scaled = erf_node.inputs[0];
  ValueId x = kNone;
  const ir::Node* scaling = m.inner(scaled, OpKind::Div);
  if (scaling && m.constant_near(scaling->inputs[1], std::sqrt(2.0))) {
    x = scaling->inputs[0];
  } else {
    scaling = m.inner(scaled, OpKind::Mul);
    for (int side = 0; scaling && side < 2 && x == kNone; ++side)
      if (m.constant_near(scaling->inputs[static_cast<size_t>(side)], std::sqrt(0.5)))
        x = scaling->inputs[static_cast<size_t>(1 - side)];
  }
  if (x == kNone || g.value(x).dtype != DType::f32) return false;
  return rewrite_gelu_tail(m, x, erf_node, {scaling}, "none");
}

// 0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³))) around `tanh_node` (GPT-2's gelu_new, as exporters write
// it: x³ as Pow(x, 3)), in any order of the factors and terms: rewritten into Gelu (tanh form). True if it was.
bool rewrite_tanh_gelu(Matcher& m, const ir::Node& tanh_node) {
  ir::Graph& g = m.g;
  const ir::Node* outer = m.inner(tanh_node.inputs[0], OpKind::Mul);  // √(2/π) · inner
  if (!outer) return false;
  ValueId inner = kNone;
  for (int side = 0; side < 2 && inner == kNone; ++side)
    if (m.constant_near(outer->inputs[static_cast<size_t>(side)], std::sqrt(2.0 / std::numbers::pi)))
      inner = outer->inputs[static_cast<size_t>(1 - side)];
  const ir::Node* sum = inner == kNone ? nullptr : m.inner(inner, OpKind::Add);  // x + 0.044715 · x³
  if (!sum) return false;
  for (int side = 0; side < 2; ++side) {
    const ValueId x = sum->inputs[static_cast<size_t>(side)];
    const ir::Node* cubic = m.inner(sum->inputs[static_cast<size_t>(1 - side)], OpKind::Mul);
    if (!cubic || g.value(x).dtype != DType::f32) continue;
    ValueId cube = kNone;
    if (m.constant_near(cubic->inputs[0], 0.044715))
      cube = cubic->inputs[1];
    else if (m.constant_near(cubic->inputs[1], 0.044715))
      cube = cubic->inputs[0];
    const ir::Node* pow = cube == kNone ? nullptr : m.inner(cube, OpKind::Pow);
    if (!pow || pow->inputs[0] != x || pow->attrs.get_float("exponent") != 3.0) continue;
    return rewrite_gelu_tail(m, x, tanh_node, {outer, sum, cubic, pow}, "tanh");
  }
  return false;
}

// The value `n` halves (Scale by 0.5, Mul by the constant 0.5 on either side, or Div by the constant 2), else kNone.
ValueId halved(const Matcher& m, const ir::Node& n) {
  if (n.op == OpKind::Scale) return n.attrs.get_float("alpha") == 0.5 ? n.inputs[0] : kNone;
  if (n.op == OpKind::Div) return m.constant_near(n.inputs[1], 2.0) ? n.inputs[0] : kNone;
  if (n.op != OpKind::Mul) return kNone;
  for (int side = 0; side < 2; ++side)
    if (m.constant_near(n.inputs[static_cast<size_t>(side)], 0.5)) return n.inputs[static_cast<size_t>(1 - side)];
  return kNone;
}

// silu(gate) · up with σ(gate) written as (1 + tanh(gate / 2)) / 2 around `tanh_node` (ONNX's Sigmoid as the
// importer lowers it): gate halved, Tanh, plus 1, halved, times gate, times up (each product in either order),
// every intermediate read only inside the pattern: rewritten into SwiGLU(gate, up) at the last Mul. True if it was.
bool rewrite_swiglu(Matcher& m, const ir::Node& tanh_node) {
  ir::Graph& g = m.g;
  const ir::Node* halving = nullptr;
  ValueId gate = kNone;
  for (OpKind op : {OpKind::Scale, OpKind::Mul, OpKind::Div}) {
    const ir::Node* n = m.inner(tanh_node.inputs[0], op);
    if (n && (gate = halved(m, *n)) != kNone) {
      halving = n;
      break;
    }
  }
  if (!halving) return false;
  const ir::Node* plus_one = m.only_reader(tanh_node.outputs[0]);
  if (!plus_one || plus_one->op != OpKind::Add ||
      !m.constant_near(Matcher::other_operand(*plus_one, tanh_node.outputs[0]), 1.0))
    return false;
  const ir::Node* sigmoid = m.only_reader(plus_one->outputs[0]);
  if (!sigmoid || halved(m, *sigmoid) != plus_one->outputs[0]) return false;
  const ir::Node* silu = m.only_reader(sigmoid->outputs[0]);
  if (!silu || silu->op != OpKind::Mul || Matcher::other_operand(*silu, sigmoid->outputs[0]) != gate) return false;
  const ir::Node* product = m.only_reader(silu->outputs[0]);
  const ValueId up =
      product && product->op == OpKind::Mul ? Matcher::other_operand(*product, silu->outputs[0]) : kNone;
  const ir::Value& gv = g.value(gate);
  if (up == kNone || up == silu->outputs[0] || gv.dtype != DType::f32 || g.value(up).dtype != DType::f32 ||
      g.value(up).shape != gv.shape || g.value(product->outputs[0]).shape != gv.shape)
    return false;
  const NodeId at = product->id;
  m.kill({halving, &tanh_node, plus_one, sigmoid, silu});
  g.set_op(at, OpKind::SwiGLU, {gate, up}, ir::Attrs{});
  return true;
}

// transformers' apply_rotary_pos_emb as ONNX graphs hold it, around `concat` (its rotate_half):
//   x·cos + Concat(−x2, x1)·sin, x1 and x2 the halves of x's last axis (two Slices or one Split), −x2 a Scale by
//   −1, cos and sin f32 graph inputs (no gradient), each product and the sum in either order, every intermediate
//   read only inside the pattern, in one of two layouts:
//   - heads-major: x = Transpose(u, {0, 2, 1, 3}) (B, H, T, D), cos and sin (B or 1, 1, T, D) (the exporters'
//     graphs): rewritten into Transpose(RoPE(u, cos, sin)), so the rotation runs before the heads transpose and
//     fold_attention_transposes can fold that into the attention;
//   - sequence-major: x (B, T, H, D), cos and sin (B or 1, T, 1, D) (fusetrain's own export): RoPE(x, cos, sin).
// Partial rotary (Phi, GPT-NeoX, StableLM): x is Slice(xf, 0:R) of the head vectors xf (D wide) and the rotation's
// result is joined with the rest, Concat(rotated, Slice(xf, R:D)): one RoPE over xf with R-wide tables, which
// passes elements R .. D through, at the Concat.
// The rewrite sits at the Add (the Concat when partial); cos and sin become (B or 1, T, R) and, for 1, are expanded
// to B rows.
bool rewrite_rope(Matcher& m, const ir::Node& concat) {
  ir::Graph& g = m.g;
  if (concat.inputs.size() != 2) return false;
  const ir::Node* negate = m.inner(concat.inputs[0], OpKind::Scale);
  if (!negate || negate->attrs.get_float("alpha") != -1.0) return false;
  const ValueId x1 = concat.inputs[1], x2 = negate->inputs[0];
  auto on_last_axis = [](const ir::Node& n) { return n.attrs.get_int("axis") == 3 || n.attrs.get_int("axis") == -1; };
  ValueId x = kNone;
  std::vector<const ir::Node*> halves;  // the Slices or the Split
  const ir::Node* first = m.inner(x1, OpKind::Slice);
  const ir::Node* second = m.inner(x2, OpKind::Slice);
  if (first && second && first->inputs[0] == second->inputs[0]) {
    x = first->inputs[0];
    halves = {first, second};
  } else if (const ir::Node* split = m.producer(x1, OpKind::Split);
             split && split->outputs.size() == 2 && split->outputs[0] == x1 && split->outputs[1] == x2 &&
             m.single_reader(x1) && m.single_reader(x2) && on_last_axis(*split)) {
    x = split->inputs[0];
    halves = {split};
  }
  if (x == kNone) return false;
  const ir::Value& xv = g.value(x);
  if (xv.dtype != DType::f32 || xv.shape.rank() != 4 || xv.shape[3] % 2 != 0 || !on_last_axis(concat)) return false;
  const int64_t R = xv.shape[3];  // the rotated width: the head size, or its first R elements (partial rotary)
  for (const ValueId half : {x1, x2})
    if (g.value(half).shape[3] != R / 2) return false;
  if (halves.size() == 2 && (halves[0]->attrs.get_int("start") != 0 || halves[1]->attrs.get_int("start") != R / 2 ||
                             !on_last_axis(*halves[0]) || !on_last_axis(*halves[1])))
    return false;
  const ir::Node* times_sin = m.only_reader(concat.outputs[0]);
  const ValueId sin =
      times_sin && times_sin->op == OpKind::Mul ? Matcher::other_operand(*times_sin, concat.outputs[0]) : kNone;
  if (sin == kNone) return false;
  const ir::Node* sum = m.only_reader(times_sin->outputs[0]);
  const ValueId cos_term =
      sum && sum->op == OpKind::Add ? Matcher::other_operand(*sum, times_sin->outputs[0]) : kNone;
  const ir::Node* times_cos = cos_term == kNone ? nullptr : m.inner(cos_term, OpKind::Mul);
  const ValueId cos = times_cos ? Matcher::other_operand(*times_cos, x) : kNone;
  if (cos == kNone || g.value(sum->outputs[0]).shape != xv.shape) return false;

  // Partial rotary: x = Slice(xf, 0:R), read only by the pattern, and the sum joined with Slice(xf, R:D).
  ValueId xf = x;
  const ir::Node *part = m.producer(x, OpKind::Slice), *rest = nullptr, *joined = nullptr;
  if (part && on_last_axis(*part) && part->attrs.get_int("start") == 0 && !g.is_output(x)) {
    const ir::Node* j = m.only_reader(sum->outputs[0]);
    if (j && j->op == OpKind::Concat && j->inputs.size() == 2 && j->inputs[0] == sum->outputs[0] && on_last_axis(*j))
      rest = m.inner(j->inputs[1], OpKind::Slice);
    const ir::Value& whole = g.value(part->inputs[0]);
    bool read_by_pattern_only = true;
    for (NodeId r : m.readers(x))
      read_by_pattern_only = read_by_pattern_only && (r == times_cos->id || r == halves[0]->id ||
                                                      (halves.size() == 2 && r == halves[1]->id));
    if (rest && rest->inputs[0] == part->inputs[0] && on_last_axis(*rest) && rest->attrs.get_int("start") == R &&
        whole.shape.rank() == 4 && g.value(rest->outputs[0]).shape[3] == whole.shape[3] - R &&
        read_by_pattern_only) {
      xf = part->inputs[0];
      joined = j;
    }
  }
  const ir::Node* heads = m.producer(xf, OpKind::Transpose);
  const bool heads_major = heads && heads->attrs.get_ints("perm") == std::vector<int64_t>{0, 2, 1, 3};
  const int64_t B = xv.shape[0], T = heads_major ? xv.shape[2] : xv.shape[1];
  // A table the rotation reads: an f32 graph input of (B or 1, 1, T, R) heads-major, (B or 1, T, 1, R) otherwise.
  auto table = [&](ValueId v) {
    const ir::Value& t = g.value(v);
    if (t.kind != ir::ValueKind::Input || t.dtype != DType::f32 || t.shape.rank() != 4) return false;
    const int64_t r = t.shape[0];
    return (r == B || r == 1) && t.shape == (heads_major ? Shape{r, 1, T, R} : Shape{r, T, 1, R});
  };
  if (!table(sin) || !table(cos) || g.value(cos).shape != g.value(sin).shape) return false;
  const NodeId at = joined ? joined->id : sum->id;
  // The table as (B, T, R), made once for the rotations that read it.
  auto rows = [&](ValueId t) {
    if (auto it = m.made.find(t); it != m.made.end() && it->second.first <= at) return it->second.second;
    const int64_t rows = g.value(t).shape[0];
    ValueId out = g.insert_before(at, OpKind::Reshape, {t}, ir::Attrs{{"shape", std::vector<int64_t>{rows, T, R}}})[0];
    if (rows != B)
      out = g.insert_before(at, OpKind::ExpandTo, {out}, ir::Attrs{{"shape", std::vector<int64_t>{B, T, R}}})[0];
    m.made[t] = {at, out};
    return out;
  };
  const ValueId cos_rows = rows(cos), sin_rows = rows(sin);
  m.kill({negate, &concat, times_sin, times_cos});
  for (const ir::Node* h : halves) m.kill({h});
  if (joined) m.kill({part, rest, sum});
  if (!heads_major) {
    g.set_op(at, OpKind::RoPE, {xf, cos_rows, sin_rows}, ir::Attrs{});
    return true;
  }
  const ValueId rotated = g.insert_before(at, OpKind::RoPE, {heads->inputs[0], cos_rows, sin_rows})[0];
  // xf's readers: the halves (or the partial rotary's slices) and the cos product, and possibly others (then its
  // Transpose stays).
  bool x_read_elsewhere = g.is_output(xf);
  for (NodeId r : m.readers(xf))
    x_read_elsewhere = x_read_elsewhere || !g.is_removed(r);
  if (!x_read_elsewhere) m.kill({heads});
  g.set_op(at, OpKind::Transpose, {rotated}, ir::Attrs{{"perm", std::vector<int64_t>{0, 2, 1, 3}}});
  return true;
}

template <typename Rewrite>
FusionReport rewrite_all(ir::Graph& g, OpKind anchor, Rewrite rewrite) {
  FusionReport report;
  Matcher m(g);
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id)
    if (g.node(id).op == anchor && !g.is_removed(id) && rewrite(m, g.node(id))) report.fused += 1;
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace

FusionReport fuse_decomposed_layernorm(ir::Graph& g) { return rewrite_all(g, OpKind::Sqrt, rewrite_layernorm); }

FusionReport fuse_decomposed_rmsnorm(ir::Graph& g) { return rewrite_all(g, OpKind::Sqrt, rewrite_rmsnorm); }

FusionReport fuse_decomposed_rope(ir::Graph& g) { return rewrite_all(g, OpKind::Concat, rewrite_rope); }

FusionReport fuse_decomposed_swiglu(ir::Graph& g) { return rewrite_all(g, OpKind::Tanh, rewrite_swiglu); }

FusionReport fuse_erf_gelu(ir::Graph& g) {
  FusionReport erf = rewrite_all(g, OpKind::Erf, rewrite_erf_gelu);
  FusionReport tanh = rewrite_all(g, OpKind::Tanh, rewrite_tanh_gelu);
  return {erf.fused + tanh.fused, erf.nodes_removed + tanh.nodes_removed};
}

}  // namespace fusetrain::passes
