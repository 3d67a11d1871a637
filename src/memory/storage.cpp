#include "fusetrain/memory/storage.h"

#include <algorithm>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"

namespace fusetrain::memory {

using ir::ValueId;

bool is_bound_gradient(const ir::Graph& graph, ValueId value) {
  return graph.value(value).gradient_of != ir::kNone && graph.is_output(value);
}

StoragePlan plan_storage(const ir::Graph& g, const std::vector<ScheduledNode>& schedule, bool in_place_allowed) {
  const size_t num_values = g.values().size();
  const int num_steps = static_cast<int>(schedule.size());
  StoragePlan plan;

  // Last use of every value, in schedule positions.
  std::vector<int> last_use(num_values, -1);
  for (int i = 0; i < num_steps; ++i)
    for (ValueId v : schedule[static_cast<size_t>(i)].node->inputs) last_use[static_cast<size_t>(v)] = i;

  // A buffer shared by a value, its aliases and its in-place successors.
  struct Storage {
    size_t bytes = 0;
    int first = 0;
    int last = 0;
    bool pinned = false;  // a graph output: lives to the end
    std::string name;
  };
  std::vector<Storage> storages;
  plan.buffer_of.assign(num_values, -1);
  plan.scratch_of.assign(schedule.size(), -1);
  plan.temporaries_of.resize(schedule.size());
  auto extend = [&](int s, ValueId v, int position) {
    Storage& st = storages[static_cast<size_t>(s)];
    st.last = std::max({st.last, position, last_use[static_cast<size_t>(v)]});
    st.pinned = st.pinned || g.is_output(v);
  };
  auto add_storage = [&](size_t bytes, int position, std::string name) {
    storages.push_back({bytes, position, position, false, std::move(name)});
    return static_cast<int>(storages.size() - 1);
  };
  for (int i = 0; i < num_steps; ++i) {
    const ScheduledNode& step = schedule[static_cast<size_t>(i)];
    const ir::Node& n = *step.node;
    const ir::OpInfo& info = ir::op_info(n.op);
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      ValueId v = n.outputs[k];
      const ir::Value& val = g.value(v);
      if (is_bound_gradient(g, v)) {
        plan.temporaries_of[static_cast<size_t>(i)].push_back(
            step.accumulates ? -1 : add_storage(val.shape.numel() * sizeof(float), i, "accumulate:" + val.name));
        continue;
      }
      size_t bytes = static_cast<size_t>(val.shape.numel()) * dtype_size(val.dtype);
      const size_t source = info.has(ir::kInPlaceInput1) ? 1 : 0;  // the input output 0 may overwrite
      if (k == 0 && n.inputs.size() > source) {
        ValueId in = n.inputs[source];
        int s = plan.buffer_of[static_cast<size_t>(in)];
        const ir::Value& in_val = g.value(in);
        size_t in_bytes = static_cast<size_t>(in_val.shape.numel()) * dtype_size(in_val.dtype);
        bool alias = info.has(ir::kAlias) && s >= 0;
        bool in_place = in_place_allowed && (info.has(ir::kInPlace) || info.has(ir::kInPlaceInput1)) && s >= 0 &&
                        in_bytes == bytes && in_val.dtype == val.dtype && !storages[static_cast<size_t>(s)].pinned &&
                        storages[static_cast<size_t>(s)].last <= i;
        // An input read again at another slot of the same node would be clobbered mid-kernel unless elementwise.
        for (size_t j = 0; in_place && j < n.inputs.size(); ++j)
          if (j != source && plan.buffer_of[static_cast<size_t>(n.inputs[j])] == s && !info.has(ir::kElementwise))
            in_place = false;
        if (alias || in_place) {
          plan.buffer_of[static_cast<size_t>(v)] = s;
          extend(s, v, i);
          if (in_place && !alias) ++plan.num_in_place;
          if (!alias) plan.naive_bytes += align_up(bytes);
          continue;
        }
      }
      plan.buffer_of[static_cast<size_t>(v)] = add_storage(bytes, i, val.name);
      extend(plan.buffer_of[static_cast<size_t>(v)], v, i);
      plan.naive_bytes += align_up(bytes);
    }
    if (step.scratch_bytes > 0) {
      plan.scratch_of[static_cast<size_t>(i)] = add_storage(step.scratch_bytes, i, "scratch:" + n.name);
      plan.naive_bytes += align_up(step.scratch_bytes);
    }
  }
  for (Storage& s : storages)
    if (s.pinned) s.last = num_steps;

  for (const Storage& s : storages) plan.buffers.push_back({s.bytes, s.first, s.last, s.name});
  plan.arena = plan_arena(plan.buffers);
  check_arena(plan.buffers, plan.arena);
  return plan;
}

}  // namespace fusetrain::memory
