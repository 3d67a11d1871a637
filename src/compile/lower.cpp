#include "fusetrain/compile/lower.h"

#include "fusetrain/ir/params.h"

namespace fusetrain::compile {

kernels::KernelCall lower(const ir::Graph& graph, const ir::Node& node) {
  kernels::KernelCall call;
  call.op = node.op;
  call.op_params = ir::decode_params(node.op, node.attrs, node.name);
  call.inputs.reserve(node.inputs.size());
  for (ir::ValueId v : node.inputs) call.inputs.push_back({graph.value(v).shape, graph.value(v).dtype});
  call.outputs.reserve(node.outputs.size());
  for (ir::ValueId v : node.outputs) call.outputs.push_back({graph.value(v).shape, graph.value(v).dtype});
  call.name = node.name;
  return call;
}

}  // namespace fusetrain::compile
