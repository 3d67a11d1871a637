// Lowering a whole graph: the schedule, each node's kernel and the storage plan the runtime binds.
#include <omp.h>

#include <algorithm>
#include <map>

#include "fusetrain/compile/lower.h"
#include "fusetrain/core/error.h"
#include "fusetrain/memory/storage.h"

namespace fusetrain::compile {

using ir::NodeId;
using ir::ValueId;

namespace {

// Moves each node that only writes parameter gradients, and is the only node writing them, to right after the
// nodes that produce its inputs. Graph order can leave such a node (the copy of a head's gradient into its
// buffer) at the very end of backward, which would hold back data-parallel communication of its gradients until
// backward is over. Accumulations into one gradient keep their order, so the arithmetic is unchanged.
std::vector<NodeId> hoist_gradient_writers(const ir::Graph& g, std::vector<NodeId> schedule) {
  std::map<ValueId, int> writers;  // parameter -> scheduled nodes writing its gradient
  for (NodeId id : schedule)
    for (ValueId v : g.node(id).outputs)
      if (memory::is_bound_gradient(g, v)) ++writers[g.value(v).gradient_of];
  auto hoistable = [&](const ir::Node& n) {
    for (ValueId v : n.outputs)
      if (!memory::is_bound_gradient(g, v) || writers[g.value(v).gradient_of] != 1) return false;
    return !n.outputs.empty();
  };
  std::vector<NodeId> rest;
  std::vector<NodeId> moved;
  for (NodeId id : schedule) (hoistable(g.node(id)) ? moved : rest).push_back(id);
  if (moved.empty()) return schedule;
  // Each moved node goes right after the last of its inputs is produced (a moved node may read another's output).
  std::vector<bool> produced(g.values().size(), true);
  for (NodeId id : schedule)
    for (ValueId v : g.node(id).outputs) produced[static_cast<size_t>(v)] = false;
  std::vector<NodeId> out;
  std::vector<NodeId> pending = moved;
  auto emit = [&](NodeId id) {
    out.push_back(id);
    for (ValueId v : g.node(id).outputs) produced[static_cast<size_t>(v)] = true;
  };
  auto emit_ready = [&] {
    for (bool again = true; again;) {
      again = false;
      for (size_t i = 0; i < pending.size(); ++i) {
        bool ready = true;
        for (ValueId v : g.node(pending[i]).inputs) ready = ready && produced[static_cast<size_t>(v)];
        if (!ready) continue;
        emit(pending[i]);
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        again = true;
        break;
      }
    }
  };
  emit_ready();
  for (NodeId id : rest) {
    emit(id);
    emit_ready();
  }
  FT_CHECK(pending.empty(), "scheduling: ", pending.size(), " gradient nodes have inputs no node produces");
  return out;
}

}  // namespace

runtime::LoweredProgram lower_program(const ir::Graph& graph, const runtime::ParameterStore& params,
                                      const runtime::PlanOptions& options) {
  runtime::LoweredProgram program;
  program.graph = graph;
  program.graph.verify();
  const ir::Graph& g = program.graph;
  FT_CHECK(!g.outputs().empty(), "cannot compile a plan for a graph without outputs");
  program.num_threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  // The plain-loop kernels when asked for; otherwise the device whose memory holds the parameters.
  program.device = options.reference_kernels ? &kernels::reference_device() : &params.device();

  // Schedule: the nodes the outputs depend on, in graph order.
  std::vector<bool> needed(g.values().size(), false);
  for (ValueId v : g.outputs()) needed[static_cast<size_t>(v)] = true;
  std::vector<NodeId> schedule;
  for (NodeId id = static_cast<NodeId>(g.nodes().size()) - 1; id >= 0; --id) {
    const ir::Node& n = g.node(id);
    bool live = false;
    for (ValueId v : n.outputs) live = live || needed[static_cast<size_t>(v)];
    if (!live) continue;
    schedule.push_back(id);
    for (ValueId v : n.inputs) needed[static_cast<size_t>(v)] = true;
  }
  std::reverse(schedule.begin(), schedule.end());
  program.schedule = hoist_gradient_writers(g, std::move(schedule));

  // Kernels, created before planning because they tell how much scratch they need.
  std::vector<memory::ScheduledNode> scheduled;
  for (NodeId id : program.schedule) {
    const ir::Node& node = g.node(id);
    program.kernels.push_back(program.device->make_kernel(lower(g, node)));
    scheduled.push_back({&node, program.kernels.back()->scratch_bytes(program.num_threads),
                         program.kernels.back()->accumulates()});
  }
  program.storage = memory::plan_storage(g, scheduled, /*in_place=*/!options.reference_kernels);
  return program;
}

std::unique_ptr<runtime::Plan> compile_plan(const ir::Graph& graph, runtime::ParameterStore& params,
                                            const runtime::PlanOptions& options) {
  return runtime::Plan::bind(lower_program(graph, params, options), params, options.shared_arena);
}

}  // namespace fusetrain::compile
