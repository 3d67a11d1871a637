#include "fusetrain/runtime/plan.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "fusetrain/core/error.h"
#include "fusetrain/compile/lower.h"
#include "fusetrain/kernels/device.h"

namespace fusetrain::runtime {

using ir::kNone;
using ir::NodeId;
using ir::ValueId;
using ir::ValueKind;

struct Plan::Step {
  const ir::Node* node = nullptr;
  std::unique_ptr<kernels::Kernel> kernel;
  kernels::KernelArgs args;
  // Outputs whose kernel cannot accumulate: computed into `temp`, then added into `dest`.
  struct Accumulation {
    float* temp;
    float* dest;
    int64_t numel;
  };
  std::vector<Accumulation> accumulations;
};

struct Plan::InputBinding {
  std::string name;
  ValueId value = kNone;
  void* owned = nullptr;                           // the plan's own buffer for this input
  std::vector<std::pair<size_t, size_t>> readers;  // (step index, input slot)
};

namespace {

// Storage: a byte range in the arena shared by a value, its aliases and in-place successors.
struct Storage {
  size_t bytes = 0;
  int first = 0;
  int last = 0;
  bool pinned = false;  // a graph output: lives to the end
  std::string name;
};

}  // namespace

Plan::~Plan() = default;

size_t Plan::num_scheduled_nodes() const { return steps_.size(); }

std::unique_ptr<Plan> Plan::compile(const ir::Graph& graph, ParameterStore& params, const PlanOptions& options) {
  std::unique_ptr<Plan> plan(new Plan());
  Plan& p = *plan;
  p.graph_ = graph;
  p.graph_.verify();
  FT_CHECK(!p.graph_.outputs().empty(), "cannot compile a plan for a graph without outputs");
  p.num_threads_ = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  const ir::Graph& g = p.graph_;
  const size_t num_values = g.values().size();
  p.device_ = &kernels::device_for(options.reference_kernels ? kernels::Backend::Reference : kernels::Backend::Optimized);

  // Schedule: the nodes the outputs depend on, in graph order.
  std::vector<bool> needed(num_values, false);
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
  const int num_steps = static_cast<int>(schedule.size());

  // Parameters and gradients: views into the store.
  p.value_tensors_.assign(num_values, Tensor());
  std::vector<bool> is_grad(num_values, false);
  for (const ir::Value& v : g.values()) {
    if (v.kind == ValueKind::Param) {
      Tensor t = params.param(v.name);
      FT_CHECK(t.shape() == v.shape && v.dtype == DType::f32, "parameter \"", v.name, "\" is ", dtype_name(v.dtype),
               v.shape.to_string(), " in the graph but f32", t.shape().to_string(), " in the parameter store");
      p.value_tensors_[static_cast<size_t>(v.id)] = t;
    } else if (v.kind == ValueKind::Activation && v.name.rfind("grad:", 0) == 0 && g.is_output(v.id) &&
               params.contains(v.name.substr(5))) {
      Tensor t = params.grad(v.name.substr(5));
      FT_CHECK(t.shape() == v.shape && v.dtype == DType::f32, "gradient ", g.describe(v.id),
               " does not match its parameter ", t.shape().to_string());
      p.value_tensors_[static_cast<size_t>(v.id)] = t;
      is_grad[static_cast<size_t>(v.id)] = true;
    }
  }

  // Kernels, created before planning because they tell how much scratch they need.
  p.steps_.resize(schedule.size());
  for (size_t i = 0; i < schedule.size(); ++i) {
    p.steps_[i].node = &g.node(schedule[i]);
    p.steps_[i].kernel = p.device_->make_kernel(compile::lower(g, *p.steps_[i].node));
  }

  // Last use of every value, in schedule positions.
  std::vector<int> last_use(num_values, -1);
  for (int i = 0; i < num_steps; ++i)
    for (ValueId v : p.steps_[static_cast<size_t>(i)].node->inputs) last_use[static_cast<size_t>(v)] = i;

  // Storage for every activation: fresh, an alias, or in place of input 0.
  std::vector<int> storage_of(num_values, -1);
  std::vector<Storage> storages;
  std::vector<int> scratch_storage(schedule.size(), -1);
  std::vector<std::vector<int>> temp_storage(schedule.size());
  size_t naive = 0;
  auto extend = [&](int s, ValueId v, int position) {
    Storage& st = storages[static_cast<size_t>(s)];
    st.last = std::max({st.last, position, last_use[static_cast<size_t>(v)]});
    st.pinned = st.pinned || g.is_output(v);
  };
  for (int i = 0; i < num_steps; ++i) {
    Step& step = p.steps_[static_cast<size_t>(i)];
    const ir::Node& n = *step.node;
    const ir::OpInfo& info = ir::op_info(n.op);
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      ValueId v = n.outputs[k];
      const ir::Value& val = g.value(v);
      if (is_grad[static_cast<size_t>(v)]) {
        if (!step.kernel->accumulates()) {
          temp_storage[static_cast<size_t>(i)].push_back(static_cast<int>(storages.size()));
          storages.push_back({val.shape.numel() * sizeof(float), i, i, false, "accumulate:" + val.name});
        } else {
          temp_storage[static_cast<size_t>(i)].push_back(-1);
        }
        continue;
      }
      size_t bytes = static_cast<size_t>(val.shape.numel()) * dtype_size(val.dtype);
      const size_t source = info.has(ir::kInPlaceInput1) ? 1 : 0;  // the input output 0 may overwrite
      if (k == 0 && n.inputs.size() > source) {
        ValueId in = n.inputs[source];
        int s = storage_of[static_cast<size_t>(in)];
        const ir::Value& in_val = g.value(in);
        size_t in_bytes = static_cast<size_t>(in_val.shape.numel()) * dtype_size(in_val.dtype);
        bool alias = info.has(ir::kAlias) && s >= 0;
        bool in_place = !options.reference_kernels && (info.has(ir::kInPlace) || info.has(ir::kInPlaceInput1)) &&
                        s >= 0 && in_bytes == bytes &&
                        in_val.dtype == val.dtype && !storages[static_cast<size_t>(s)].pinned &&
                        storages[static_cast<size_t>(s)].last <= i;
        // An input read again at another slot of the same node would be clobbered mid-kernel unless elementwise.
        for (size_t j = 0; in_place && j < n.inputs.size(); ++j)
          if (j != source && storage_of[static_cast<size_t>(n.inputs[j])] == s && !info.has(ir::kElementwise))
            in_place = false;
        if (alias || in_place) {
          storage_of[static_cast<size_t>(v)] = s;
          extend(s, v, i);
          if (in_place && !alias) ++p.report_.num_in_place;
          if (!alias) naive += align_up(bytes);
          continue;
        }
      }
      storage_of[static_cast<size_t>(v)] = static_cast<int>(storages.size());
      storages.push_back({bytes, i, i, false, val.name});
      extend(storage_of[static_cast<size_t>(v)], v, i);
      naive += align_up(bytes);
    }
    size_t scratch = step.kernel->scratch_bytes(p.num_threads_);
    if (scratch > 0) {
      scratch_storage[static_cast<size_t>(i)] = static_cast<int>(storages.size());
      storages.push_back({scratch, i, i, false, "scratch:" + n.name});
      naive += align_up(scratch);
    }
  }
  for (Storage& s : storages)
    if (s.pinned) s.last = num_steps;

  // One arena for all of them.
  for (const Storage& s : storages) p.buffers_.push_back({s.bytes, s.first, s.last, s.name});
  p.arena_plan_ = memory::plan_arena(p.buffers_);
  memory::check_arena(p.buffers_, p.arena_plan_);
  p.arena_ = aligned_allocate(p.arena_plan_.arena_bytes);
  char* arena = static_cast<char*>(p.arena_.get());
  auto storage_ptr = [&](int s) { return arena + p.arena_plan_.offsets[static_cast<size_t>(s)]; };
  for (const ir::Value& v : g.values())
    if (storage_of[static_cast<size_t>(v.id)] >= 0)
      p.value_tensors_[static_cast<size_t>(v.id)] =
          Tensor::view(storage_ptr(storage_of[static_cast<size_t>(v.id)]), v.shape, v.dtype);

  // Inputs: one plan-owned buffer each, inside a single allocation.
  size_t input_bytes = 0;
  for (ValueId v : g.inputs()) input_bytes += align_up(g.value(v).shape.numel() * dtype_size(g.value(v).dtype));
  AlignedPtr input_memory = aligned_allocate(input_bytes);
  char* cursor = static_cast<char*>(input_memory.get());
  for (ValueId v : g.inputs()) {
    const ir::Value& val = g.value(v);
    InputBinding binding;
    binding.name = val.name;
    binding.value = v;
    binding.owned = cursor;
    p.value_tensors_[static_cast<size_t>(v)] = Tensor::view(cursor, val.shape, val.dtype);
    cursor += align_up(val.shape.numel() * dtype_size(val.dtype));
    p.inputs_.push_back(std::move(binding));
  }

  // Bind every kernel to its memory.
  for (int i = 0; i < num_steps; ++i) {
    Step& step = p.steps_[static_cast<size_t>(i)];
    const ir::Node& n = *step.node;
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      step.args.inputs.push_back(p.value_tensors_[static_cast<size_t>(n.inputs[k])]);
      for (InputBinding& b : p.inputs_)
        if (b.value == n.inputs[k]) b.readers.emplace_back(static_cast<size_t>(i), k);
    }
    size_t temp_index = 0;
    for (ValueId v : n.outputs) {
      Tensor out = p.value_tensors_[static_cast<size_t>(v)];
      uint8_t accumulate = 0;
      if (is_grad[static_cast<size_t>(v)]) {
        int temp = temp_storage[static_cast<size_t>(i)][temp_index++];
        if (temp >= 0) {
          Tensor t = Tensor::view(storage_ptr(temp), out.shape(), out.dtype());
          step.accumulations.push_back({t.data_as<float>(), out.data_as<float>(), out.numel()});
          out = t;
        } else {
          accumulate = 1;
        }
      }
      step.args.outputs.push_back(out);
      step.args.accumulate.push_back(accumulate);
    }
    if (scratch_storage[static_cast<size_t>(i)] >= 0)
      step.args.scratch = storage_ptr(scratch_storage[static_cast<size_t>(i)]);
  }
  p.report_.input_bytes = input_bytes;
  p.report_.parameter_bytes = static_cast<size_t>(params.flat_numel()) * sizeof(float);
  p.report_.gradient_bytes = p.report_.parameter_bytes;
  p.report_.activation_peak_bytes = p.arena_plan_.arena_bytes;
  p.report_.activation_naive_bytes = naive;
  p.report_.num_buffers = storages.size();
  p.input_memory_ = std::move(input_memory);
  return plan;
}

Tensor Plan::input(const std::string& name) const {
  for (const InputBinding& b : inputs_)
    if (b.name == name) {
      const ir::Value& v = graph_.value(b.value);
      return Tensor::view(b.owned, v.shape, v.dtype);
    }
  std::string known;
  for (const InputBinding& b : inputs_) known += (known.empty() ? "" : ", ") + b.name;
  throw Error(str("plan has no input named \"", name, "\" (inputs: ", known, ")"));
}

void Plan::bind_input(const std::string& name, const void* data) {
  for (InputBinding& b : inputs_)
    if (b.name == name) {
      void* target = data ? const_cast<void*>(data) : b.owned;
      for (auto [step, slot] : b.readers) {
        Tensor& t = steps_[step].args.inputs[slot];
        t = Tensor::view(target, t.shape(), t.dtype());
      }
      return;
    }
  input(name);  // throws with the list of inputs
}

void Plan::run() {
  kernels::StepContext ctx;
  ctx.rng_offset = step_;
  ctx.num_threads = num_threads_;
  for (Step& step : steps_) {
    step.kernel->run(step.args, ctx);
    for (const Step::Accumulation& a : step.accumulations) device_->add_into(a.dest, a.temp, a.numel, ctx);
  }
  ++step_;
}

void Plan::run_profiled(std::vector<double>& seconds) {
  seconds.resize(steps_.size(), 0.0);
  kernels::StepContext ctx;
  ctx.rng_offset = step_;
  ctx.num_threads = num_threads_;
  for (size_t i = 0; i < steps_.size(); ++i) {
    double start = omp_get_wtime();
    steps_[i].kernel->run(steps_[i].args, ctx);
    for (const Step::Accumulation& a : steps_[i].accumulations) device_->add_into(a.dest, a.temp, a.numel, ctx);
    seconds[i] += omp_get_wtime() - start;
  }
  ++step_;
}

std::vector<const ir::Node*> Plan::scheduled_nodes() const {
  std::vector<const ir::Node*> nodes;
  for (const Step& s : steps_) nodes.push_back(s.node);
  return nodes;
}

Tensor Plan::output(ValueId value) const {
  FT_CHECK(graph_.is_output(value), "value ", graph_.describe(value), " is not a graph output of this plan");
  return value_tensors_[static_cast<size_t>(value)];
}

Plan& PlanCache::get(const std::vector<Shape>& input_shapes) {
  for (Entry& e : entries_)
    if (e.shapes == input_shapes) return *e.plan;
  ir::Graph graph = factory_(input_shapes, user_);
  entries_.push_back({input_shapes, Plan::compile(graph, params_, options_)});
  return *entries_.back().plan;
}

}  // namespace fusetrain::runtime
