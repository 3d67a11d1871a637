// A compiled plan: scheduled nodes, one activation arena, kernels bound to memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/tensor.h"
#include "fusetrain/ir/graph.h"
#include "fusetrain/kernels/device.h"
#include "fusetrain/memory/planner.h"
#include "fusetrain/memory/storage.h"
#include "fusetrain/runtime/parameters.h"

namespace fusetrain::runtime {

class Plan;

/// Watches a run between its nodes: data parallel training communicates each gradient bucket as soon as backward
/// has finished it.
class RunObserver {
 public:
  virtual ~RunObserver() = default;
  /// Called before the first node of `plan`'s run.
  virtual void begin(const Plan& plan) = 0;
  /// Called after scheduled node `index` and its gradient accumulations.
  virtual void after_node(size_t index) = 0;
  /// Called after the last node.
  virtual void end() = 0;
};

/// Device memory that several plans take turns in: one model's programs, of which one runs at a time, share one
/// arena sized to the largest any of them planned, rather than each holding its own. A plan whose arena another plan
/// has since grown (a new, larger buffer) rebinds its kernels to the new buffer before its next run.
class SharedArena {
 public:
  /// At least `bytes` of `device`'s memory: the current buffer, or a larger one that replaces it (every plan on the
  /// old one rebinds before its next run).
  char* reserve(const kernels::Device& device, size_t bytes);
  char* base() const { return static_cast<char*>(buffer_.get()); }
  size_t bytes() const { return bytes_; }

 private:
  kernels::DeviceBuffer buffer_;
  size_t bytes_ = 0;
};

/// How a graph is compiled into a plan.
struct PlanOptions {
  /// Run the plain-loop reference kernels instead of the tuned ones (tests).
  bool reference_kernels = false;
  /// OpenMP threads for the kernels; 0 means omp_get_max_threads().
  int num_threads = 0;
  /// The arena to share with other plans (null: the plan allocates its own). Outputs the plan returns are then
  /// valid until the next run of any plan sharing it.
  std::shared_ptr<SharedArena> shared_arena;
};

/// What the compiler hands the runtime (compile::lower_program): the graph (names and shapes of its values), the
/// nodes in execution order with the kernel the device built for each, and the storage plan of the one arena. The
/// runtime binds it to memory and runs it; it calls no compiler.
struct LoweredProgram {
  ir::Graph graph;
  const kernels::Device* device = nullptr;  ///< built the kernels; allocates the arena and the inputs
  std::vector<ir::NodeId> schedule;
  std::vector<std::unique_ptr<kernels::Kernel>> kernels;  ///< one per scheduled node
  memory::StoragePlan storage;
  int num_threads = 1;
};

/// A graph compiled once for fixed input shapes (compile::compile_plan). Compilation schedules the nodes
/// that the graph outputs need, creates every kernel, plans one arena for all
/// activations and scratch, and binds each kernel to its memory: parameters and
/// gradients to the ParameterStore (gradients accumulate), inputs to buffers the
/// plan owns (or to caller memory via bind_input), the rest to the arena. The kernels, the arena and the input
/// buffers are the store's device's (the reference device's kernels with reference_kernels).
/// After compile, run() performs no heap allocation.
class Plan {
 public:
  /// Binds a lowered program to memory: parameters, frozen parameters and gradients to `params` (which must outlive
  /// the plan; a graph output that is a parameter's gradient, Value::gradient_of, to that parameter's gradient
  /// buffer), inputs to buffers the plan owns, the rest to one arena the program's device allocates.
  /// `shared_arena`, when given, holds the arena instead (PlanOptions::shared_arena).
  static std::unique_ptr<Plan> bind(LoweredProgram program, ParameterStore& params,
                                    std::shared_ptr<SharedArena> shared_arena = nullptr);
  ~Plan();
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  /// The plan-owned buffer of input `name`; write the step's data into it.
  Tensor input(const std::string& name) const;
  /// Whether the plan reads an input called `name` (the passes may drop an input nothing uses).
  bool has_input(const std::string& name) const;
  /// Points input `name` at caller memory for the following steps (zero copy);
  /// `data` must hold the input's shape and dtype and stay alive while used, and be memory the plan's device reads
  /// (the device's own, or host memory on a CPU device); null binds the plan's own buffer again.
  void bind_input(const std::string& name, const void* data);
  /// Binds input `name` to the plan's own buffer and, unless `host_data` is null (the buffer keeps what it holds),
  /// uploads the input's shape and dtype worth of host memory into it through the device: a batch's tensors.
  void upload_input(const std::string& name, const void* host_data);
  /// Host memory in which to build input `name` (derived inputs: positions, shifted labels, rotary tables): the
  /// plan's own buffer where the device is host-visible (no copy), else a host mirror the plan keeps. Its contents
  /// stay until the next write, so what was staged can be read back.
  Tensor staging(const std::string& name);
  /// Binds input `name` to the plan's own buffer and uploads its staging memory into it (nothing to copy where the
  /// device is host-visible).
  void upload_staging(const std::string& name);
  /// Runs every scheduled node once. Dropout streams advance by one step. `observer`, when given, is called
  /// between the nodes.
  void run(RunObserver* observer = nullptr);
  /// Like run(), timing every node: seconds[i] += wall time of scheduled node i.
  void run_profiled(std::vector<double>& seconds);
  /// The scheduled nodes, in execution order (for profiles and reports).
  std::vector<const ir::Node*> scheduled_nodes() const;
  /// A graph output (loss, logits, ...) where it lives: the device's memory, until the next run() (of any plan
  /// sharing its arena).
  Tensor output(ir::ValueId value) const;
  /// A graph output for the host to read: output() itself where the device is host-visible (no copy), else a host
  /// mirror the plan keeps per output, downloaded now (sized on the first read, reused after). Valid until the next
  /// run() or read_output() of the same value.
  Tensor read_output(ir::ValueId value);
  /// Number of run() calls so far; dropout masks depend on it.
  uint64_t step() const { return step_; }
  /// Sets the step counter (when resuming), so dropout masks continue exactly.
  void set_step(uint64_t step) { step_ = step; }

  const memory::MemoryReport& memory_report() const { return report_; }
  /// Records the optimizer's state size in the report (the plan does not own it).
  void set_optimizer_state_bytes(size_t bytes) { report_.optimizer_state_bytes = bytes; }
  /// The arena's buffers and their offsets, for the memory checker.
  const std::vector<memory::BufferRequest>& buffers() const { return buffers_; }
  const memory::ArenaPlan& arena_plan() const { return arena_plan_; }
  /// For parameter slot i of the ParameterStore the plan was compiled against, the index of the last scheduled
  /// node that writes its gradient (-1 when the plan writes none): after that node the gradient is final.
  const std::vector<int>& gradient_final_node() const { return gradient_final_node_; }
  /// Nodes in execution order (after dead-node elimination).
  size_t num_scheduled_nodes() const;
  int num_threads() const { return num_threads_; }
  const ir::Graph& graph() const { return graph_; }

 private:
  Plan() = default;
  struct Step;
  struct InputBinding;
  ir::Graph graph_;
  std::vector<Step> steps_;
  std::vector<InputBinding> inputs_;
  std::vector<Tensor> value_tensors_;  // indexed by ValueId: where each value lives
  std::vector<int64_t> value_offsets_;  // indexed by ValueId: its offset in the arena, -1 outside it
  std::map<ir::ValueId, std::vector<std::byte>> output_mirrors_;  // read_output's host copies (not host-visible)
  // Points every arena address the plan holds (values, kernel arguments, scratch, accumulation temporaries) at
  // `base` instead of arena_base_.
  void rebase_arena(char* base);
  // Before a run: rebases onto the shared arena when another plan has replaced it.
  void follow_shared_arena();
  kernels::DeviceBuffer arena_;  // activations, scratch and gradient temporaries: the device's memory (own arena)
  std::shared_ptr<SharedArena> shared_arena_;  // or the arena shared with other plans
  char* arena_base_ = nullptr;                 // where the plan's arena addresses point now
  kernels::DeviceBuffer input_memory_;  // the plan's inputs: the device's memory
  std::vector<memory::BufferRequest> buffers_;
  std::vector<ir::NodeId> schedule_;
  memory::ArenaPlan arena_plan_;
  memory::MemoryReport report_;
  std::vector<int> gradient_final_node_;
  int num_threads_ = 1;
  uint64_t step_ = 0;
  const kernels::Device* device_ = nullptr;  // builds the kernels; adds accumulations
};

}  // namespace fusetrain::runtime
