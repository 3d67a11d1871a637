// The compiler: a forward graph with a loss in, a runnable program out. The pass pipeline is data
// (an ordered table of named passes, each with the stage it runs in), and this is the one entry point
// for every graph, whether a model builder made it or it was built by hand or imported.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fusetrain/ir/graph.h"
#include "fusetrain/runtime/plan.h"

namespace fusetrain::compile {

/// The graph input an fp16 training program reads its loss scale from (backward starts from it).
inline constexpr const char* kLossScaleInput = "loss_scale";

/// What to compile a graph into.
struct CompileOptions {
  /// A training program: autodiff with respect to every parameter, the joint passes, and each
  /// parameter's gradient bound to (and accumulated into) the parameter store's gradient buffer.
  bool backward = false;
  /// The fusion and memory passes (off: the graph as built, to measure or test what they change).
  bool fusions = true;
  /// fp16 loss scaling: backward starts from the scalar input kLossScaleInput instead of 1.
  bool loss_scale_input = false;
  /// Activation checkpointing at the layer boundaries (training programs only).
  bool recompute = false;
  /// Also count the ops of the unfused training graph (a second autodiff; for reports only).
  bool count_unfused_ops = false;
  /// Kernels, threads.
  runtime::PlanOptions plan;
};

/// Values of the graph the compiler must know by role.
struct GraphRoles {
  ir::ValueId loss = ir::kNone;                 ///< scalar loss; required for a training program
  std::vector<ir::ValueId> outputs;             ///< read after a run (logits, ...); training keeps only the loss
  std::vector<ir::ValueId> metrics;             ///< small values read after any run, training included (TokenStats)
  std::vector<ir::ValueId> layer_boundaries;    ///< where recompute may cut (a layer's input, each layer's output)
};

/// How the passes changed a program.
struct PassLog {
  std::map<std::string, int> ops_before;  ///< op name -> node count of the graph as built (count_unfused_ops)
  std::map<std::string, int> ops_after;   ///< the same after every pass
  std::vector<std::string> applied;       ///< "<pass>: <what it did>", one line per pass that changed the graph
};

/// When a pass runs.
enum class Stage : uint8_t {
  Forward,  ///< on the forward graph, before autodiff (backward is derived from what it fused)
  Joint,    ///< on the training graph after autodiff (training programs only)
  Final,    ///< last, on every program
};

/// What a pass may read and update besides the graph.
struct PassState {
  const CompileOptions& options;
  GraphRoles& roles;
};

/// One row of the pipeline.
struct Pass {
  const char* name;
  Stage stage;
  /// Whether the pass runs for these options.
  bool (*applies)(const CompileOptions& options);
  /// Rewrites the graph; returns what it did for the report ("" when it changed nothing).
  std::string (*run)(ir::Graph& graph, PassState& state);
};

/// The passes in the order they run (see src/compile/pipeline.cpp).
const std::vector<Pass>& pipeline();

/// A compiled graph: the plan that runs it and how the passes changed it. Value ids of the graph as
/// given (roles) stay valid in plan->graph().
struct Program {
  std::unique_ptr<runtime::Plan> plan;
  PassLog log;
  GraphRoles roles;
};

/// Compiles `graph` (forward, with its loss): forward passes, autodiff and the joint passes for a
/// training program, the final passes, then planning and kernel creation against `params` (which must
/// outlive the program). Throws Error naming what is missing or malformed.
Program compile(ir::Graph graph, GraphRoles roles, runtime::ParameterStore& params, const CompileOptions& options);

/// Programs compiled once per key (input shapes and whatever else decides the graph). Collators pad
/// lengths to a multiple of 8, so few keys occur; a lookup allocates nothing.
class ProgramCache {
 public:
  using Key = std::vector<int64_t>;
  /// The program for `key`, or null if none was compiled for it yet.
  Program* find(const Key& key);
  /// Stores the program compiled for `key` and returns it.
  Program& insert(Key key, Program program);
  size_t size() const { return entries_.size(); }
  /// Drops every program (the model's parameter layout changed).
  void clear() { entries_.clear(); }

 private:
  std::vector<std::pair<Key, std::unique_ptr<Program>>> entries_;
};

/// Node count per op name.
std::map<std::string, int> op_counts(const ir::Graph& graph);

}  // namespace fusetrain::compile
