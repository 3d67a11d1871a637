// Computing only the rows a Slice keeps (see fusion.h).
//
// A Slice along a row axis (any axis but a row-wise op's last) is moved above its producer:
// the producer is rebuilt on sliced inputs, and the Slice moves on to those inputs, until it
// reaches a value that something else reads in full. A value whose readers are all the same
// Slice counts as read by that Slice alone, so a residual stream read by two branches is
// pruned once both branches have been.
#include <algorithm>
#include <optional>

#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {

// Rows [start, end) of `axis`.
struct RowRange {
  int64_t axis = 0, start = 0, end = 0;
  bool operator==(const RowRange&) const = default;
};

RowRange range_of(const ir::Graph& g, const ir::Node& slice) {
  const int64_t rank = g.value(slice.inputs[0]).shape.rank();
  int64_t axis = slice.attrs.get_int("axis");
  if (axis < 0) axis += rank;
  return {axis, slice.attrs.get_int("start"), slice.attrs.get_int("end")};
}

// The producer rebuilt on sliced inputs: per input, the range to slice it to (none: read whole).
struct Rewrite {
  std::vector<std::optional<RowRange>> inputs;
  ir::Attrs attrs;
};

// Where rows `r` of input `x` of an elementwise op with output shape `out` come from, numpy
// broadcasting: none if x is broadcast along that axis (or lacks it), else the same rows.
std::optional<RowRange> broadcast_rows(const Shape& x, const Shape& out, const RowRange& r) {
  const int64_t lead = out.rank() - x.rank();
  if (r.axis < lead || x[r.axis - lead] == 1) return std::nullopt;
  return RowRange{r.axis - lead, r.start, r.end};
}

// Dropout masks stay those of the unsliced tensor: the kept elements draw their own stream indices.
bool keep_dropout_stream(ir::Attrs& attrs, const Shape& full, const RowRange& r) {
  if (attrs.get_int("index_block", 0) != 0) return false;  // already a part of a larger tensor
  const int64_t inner = full.numel(r.axis + 1, full.rank());
  attrs.set("index_block", (r.end - r.start) * inner);
  attrs.set("index_stride", full[r.axis] * inner);
  attrs.set("index_start", r.start * inner);
  return true;
}

// How to compute rows `r` of output `out_index` of `node` from sliced inputs; none if this pass
// does not know the op, or the rows depend on more than the same rows of the inputs.
std::optional<Rewrite> plan_rewrite(const ir::Graph& g, const ir::Node& node, size_t out_index, const RowRange& r) {
  const Shape& out = g.value(node.outputs[out_index]).shape;
  Rewrite w{std::vector<std::optional<RowRange>>(node.inputs.size()), node.attrs};
  const bool last_axis = r.axis == out.rank() - 1;
  if (node.op == OpKind::Dropout || node.op == OpKind::DropoutAdd) {
    if (!keep_dropout_stream(w.attrs, out, r)) return std::nullopt;
    for (size_t i = 0; i < node.inputs.size(); ++i) w.inputs[i] = r;  // inputs of the output's shape
    return w;
  }
  if (ir::op_info(node.op).flags & ir::kElementwise) {
    for (size_t i = 0; i < node.inputs.size(); ++i)
      w.inputs[i] = broadcast_rows(g.value(node.inputs[i]).shape, out, r);
    return w;
  }
  switch (node.op) {
    case OpKind::Linear:     // rows of x; weight and bias whole
    case OpKind::LayerNorm:  // normalises the last axis; statistics unread here (checked by the caller)
    case OpKind::Softmax:
      if (last_axis) return std::nullopt;
      w.inputs[0] = r;
      return w;
    case OpKind::Embedding:  // out = ids.shape + (C,): rows of the ids; the table whole
      if (r.axis >= g.value(node.inputs[1]).shape.rank()) return std::nullopt;
      w.inputs[1] = r;
      return w;
    case OpKind::Transpose:
      w.inputs[0] = RowRange{node.attrs.get_ints("perm")[static_cast<size_t>(r.axis)], r.start, r.end};
      return w;
    case OpKind::Reshape: {
      // Output axis a is input axis a' when the extents before them hold as many elements and
      // a and a' have the same extent: then rows of one are the same elements as rows of the other.
      const Shape& in = g.value(node.inputs[0]).shape;
      const int64_t before = out.numel(0, r.axis);
      for (int64_t a = 0; a < in.rank(); ++a)
        if (in.numel(0, a) == before && in[a] == out[r.axis]) {
          w.inputs[0] = RowRange{a, r.start, r.end};
          std::vector<int64_t> shape = out.dims();
          shape[static_cast<size_t>(r.axis)] = r.end - r.start;
          w.attrs.set("shape", shape);
          return w;
        }
      return std::nullopt;
    }
    case OpKind::Attention: {
      // Query rows: q is sliced, every key and value stays; dropout keeps the full query's stream.
      const bool seq_major = node.attrs.get_int("seq_major", 0) != 0;
      if (out_index != 0 || r.axis != (seq_major ? 1 : 2) || node.attrs.get_int("causal", 0) != 0 ||
          node.attrs.has("rng_rows") || node.attrs.get_int("score_bias", 0) != 0)  // the bias has rows of its own
        return std::nullopt;
      w.inputs[0] = r;
      if (node.attrs.get_float("dropout_p", 0.0) > 0.0) {
        w.attrs.set("rng_rows", out[r.axis]);
        w.attrs.set("rng_row_start", r.start);
      }
      return w;
    }
    default:
      return std::nullopt;
  }
}

// One Slice moved above its producer; false if none can be.
bool push_one(ir::Graph& g, FusionReport& report) {
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (const ir::Node& slice : g.nodes()) {
    if (slice.op != OpKind::Slice) continue;
    const ValueId y = slice.inputs[0];
    const ir::Value& value = g.value(y);
    if (value.producer == kNone || g.is_output(y)) continue;
    const RowRange r = range_of(g, slice);
    if (r.end - r.start == value.shape[r.axis]) continue;  // keeps every row
    // Every reader is this same Slice, and none of their outputs leaves the graph.
    const std::vector<NodeId>& readers = consumers[static_cast<size_t>(y)];
    const bool only_this_slice = std::all_of(readers.begin(), readers.end(), [&](NodeId id) {
      const ir::Node& n = g.node(id);
      return n.op == OpKind::Slice && range_of(g, n) == r && !g.is_output(n.outputs[0]);
    });
    if (!only_this_slice) continue;
    const ir::Node& producer = g.node(value.producer);
    bool others_unread = true;
    for (ValueId o : producer.outputs)
      if (o != y) others_unread = others_unread && consumers[static_cast<size_t>(o)].empty() && !g.is_output(o);
    if (!others_unread) continue;
    const size_t out_index = static_cast<size_t>(value.output_index);
    std::optional<Rewrite> w = plan_rewrite(g, producer, out_index, r);
    if (!w) continue;

    // Rebuild the producer on sliced inputs, placed where the first reader was.
    const NodeId first_reader = *std::min_element(readers.begin(), readers.end());
    std::vector<ValueId> inputs = producer.inputs;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (w->inputs[i])
        inputs[i] = g.insert_before(
            first_reader, OpKind::Slice, {inputs[i]},
            {{"axis", w->inputs[i]->axis}, {"start", w->inputs[i]->start}, {"end", w->inputs[i]->end}})[0];
    const ValueId rows = g.insert_before(first_reader, producer.op, inputs, w->attrs, producer.name)[out_index];
    g.remove_node(producer.id);
    for (NodeId reader : readers) {
      g.remove_node(reader);
      g.replace_all_uses(g.node(reader).outputs[0], rows);
    }
    g.commit();
    report.fused += 1;
    return true;
  }
  return false;
}

// Identical Slices of one value: the first one's output serves every reader of the others.
void merge_duplicate_slices(ir::Graph& g) {
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (const ir::Node& a : g.nodes()) {
    if (a.op != OpKind::Slice || g.is_removed(a.id)) continue;
    for (NodeId id : consumers[static_cast<size_t>(a.inputs[0])]) {
      const ir::Node& b = g.node(id);
      if (id <= a.id || b.op != OpKind::Slice || g.is_removed(id) || !(range_of(g, a) == range_of(g, b)) ||
          g.is_output(b.outputs[0]))
        continue;
      g.replace_all_uses(b.outputs[0], a.outputs[0]);
      g.remove_node(id);
    }
  }
  g.commit();
}

}  // namespace

FusionReport prune_sliced_rows(ir::Graph& g) {
  FusionReport report;
  for (;;) {
    merge_duplicate_slices(g);
    if (!push_one(g, report)) break;
  }
  return report;
}

}  // namespace fusetrain::passes
