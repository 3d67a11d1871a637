// compile(): runs the pipeline's stages around autodiff and hands the result to the runtime.
#include "fusetrain/compile/compiler.h"

#include "fusetrain/autodiff/backward.h"
#include "fusetrain/compile/lower.h"
#include "fusetrain/core/error.h"

namespace fusetrain::compile {

std::map<std::string, int> op_counts(const ir::Graph& graph) {
  std::map<std::string, int> counts;
  for (const ir::Node& n : graph.nodes()) ++counts[ir::op_name(n.op)];
  return counts;
}

namespace {

void run_stage(Stage stage, ir::Graph& graph, PassState& state, PassLog& log) {
  for (const Pass& pass : pipeline()) {
    if (pass.stage != stage || !pass.applies(state.options)) continue;
    std::string what = pass.run(graph, state);
    graph.commit();  // a pass leaves no edit pending for the next one
    if (!what.empty()) log.applied.push_back(str(pass.name, ": ", what));
  }
}

}  // namespace

Program compile(ir::Graph graph, GraphRoles roles, runtime::ParameterStore& params, const CompileOptions& options) {
  FT_CHECK(!options.backward || roles.loss != ir::kNone, "a training program needs a loss: the graph has none");
  FT_CHECK(graph.phase() == ir::Phase::Forward, "compile: the graph given must be a forward graph");
  // A training program returns only the loss: unpinned, the vocabulary-sized logits of a language-model head can be
  // overwritten by their own gradient.
  for (ir::ValueId v : roles.metrics) graph.mark_output(v);
  if (options.backward) {
    graph.mark_output(roles.loss);
  } else {
    for (ir::ValueId v : roles.outputs) graph.mark_output(v);
    if (roles.loss != ir::kNone) graph.mark_output(roles.loss);
  }
  Program program;
  if (options.count_unfused_ops) {
    ir::Graph plain = graph;
    if (options.backward) autodiff::build_backward(plain, roles.loss, plain.params());
    program.log.ops_before = op_counts(plain);
  }
  PassState state{options, roles};
  run_stage(Stage::Forward, graph, state, program.log);
  if (options.backward) {
    ir::ValueId seed =
        options.loss_scale_input ? graph.add_input(kLossScaleInput, Shape{}, DType::f32) : ir::kNone;
    autodiff::build_backward(graph, roles.loss, graph.params(), seed);
    run_stage(Stage::Joint, graph, state, program.log);
  }
  run_stage(Stage::Final, graph, state, program.log);
  program.log.ops_after = op_counts(graph);
  program.plan = compile_plan(graph, params, options.plan);
  program.roles = std::move(roles);
  return program;
}

Program* ProgramCache::find(const Key& key) {
  for (auto& [k, program] : entries_)
    if (k == key) return program.get();
  return nullptr;
}

Program& ProgramCache::insert(Key key, Program program) {
  FT_CHECK(find(key) == nullptr, "ProgramCache: a program for this key is already stored");
  entries_.emplace_back(std::move(key), std::make_unique<Program>(std::move(program)));
  return *entries_.back().second;
}

}  // namespace fusetrain::compile
