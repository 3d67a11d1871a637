#include "fusetrain/runtime/plan.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "fusetrain/core/error.h"
#include "fusetrain/kernels/device.h"
#include "fusetrain/memory/storage.h"

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
    int64_t temp_offset;  // temp's offset in the arena
  };
  std::vector<Accumulation> accumulations;
  std::vector<int64_t> output_offsets;  // each output's offset in the arena, -1 outside it
  int64_t scratch_offset = -1;
};

struct Plan::InputBinding {
  std::string name;
  ValueId value = kNone;
  void* owned = nullptr;                           // the plan's own buffer for this input
  std::vector<uint8_t> mirror;                     // staging memory where the device is not host-visible
  std::vector<std::pair<size_t, size_t>> readers;  // (step index, input slot)
};

Plan::~Plan() = default;

size_t Plan::num_scheduled_nodes() const { return steps_.size(); }

char* SharedArena::reserve(const kernels::Device& device, size_t bytes) {
  if (bytes > bytes_ || !buffer_) {
    buffer_.reset();  // the old buffer goes before the larger one is allocated: no moment holds both
    buffer_ = device.allocate(bytes);
    bytes_ = bytes;
  }
  return base();
}

void Plan::rebase_arena(char* base) {
  // By the offsets bind() recorded, not by address: memory outside the arena (an input bound to caller memory) may
  // sit where an earlier arena was.
  auto at = [&](int64_t offset, const Tensor& t) { return Tensor::view(base + offset, t.shape(), t.dtype()); };
  for (size_t v = 0; v < value_tensors_.size(); ++v)
    if (value_offsets_[v] >= 0) value_tensors_[v] = at(value_offsets_[v], value_tensors_[v]);
  for (Step& step : steps_) {
    for (size_t k = 0; k < step.node->inputs.size(); ++k) {
      const int64_t offset = value_offsets_[static_cast<size_t>(step.node->inputs[k])];
      if (offset >= 0) step.args.inputs[k] = at(offset, step.args.inputs[k]);
    }
    for (size_t k = 0; k < step.output_offsets.size(); ++k)
      if (step.output_offsets[k] >= 0) step.args.outputs[k] = at(step.output_offsets[k], step.args.outputs[k]);
    if (step.scratch_offset >= 0) step.args.scratch = base + step.scratch_offset;
    for (Step::Accumulation& a : step.accumulations) a.temp = reinterpret_cast<float*>(base + a.temp_offset);
  }
  arena_base_ = base;
}

void Plan::follow_shared_arena() {
  if (shared_arena_ && shared_arena_->base() != arena_base_) rebase_arena(shared_arena_->base());
}

std::unique_ptr<Plan> Plan::bind(LoweredProgram program, ParameterStore& params,
                                 std::shared_ptr<SharedArena> shared_arena) {
  std::unique_ptr<Plan> plan(new Plan());
  Plan& p = *plan;
  p.graph_ = std::move(program.graph);
  p.num_threads_ = program.num_threads;
  p.device_ = program.device;
  p.schedule_ = std::move(program.schedule);
  const ir::Graph& g = p.graph_;
  const size_t num_values = g.values().size();
  const int num_steps = static_cast<int>(p.schedule_.size());

  // Parameters and gradients: views into the store.
  p.value_tensors_.assign(num_values, Tensor());
  for (const ir::Value& v : g.values()) {
    if (v.kind == ValueKind::Param) {
      Tensor t = params.param(v.name);
      FT_CHECK(t.shape() == v.shape && v.dtype == DType::f32, "parameter \"", v.name, "\" is ", dtype_name(v.dtype),
               v.shape.to_string(), " in the graph but f32", t.shape().to_string(), " in the parameter store");
      p.value_tensors_[static_cast<size_t>(v.id)] = t;
    } else if (v.kind == ValueKind::Frozen) {
      Tensor t = params.frozen(v.name);
      FT_CHECK(t.shape() == v.shape && t.dtype() == v.dtype, "frozen parameter \"", v.name, "\" is ",
               dtype_name(v.dtype), v.shape.to_string(), " in the graph but ", dtype_name(t.dtype()),
               t.shape().to_string(), " in the parameter store");
      p.value_tensors_[static_cast<size_t>(v.id)] = t;
    } else if (memory::is_bound_gradient(g, v.id)) {
      Tensor t = params.grad(g.value(v.gradient_of).name);
      FT_CHECK(t.shape() == v.shape && v.dtype == DType::f32, "gradient ", g.describe(v.id),
               " does not match its parameter ", t.shape().to_string());
      p.value_tensors_[static_cast<size_t>(v.id)] = t;
    }
  }

  // Kernels, from the device, in execution order.
  p.steps_.resize(p.schedule_.size());
  for (size_t i = 0; i < p.schedule_.size(); ++i) {
    p.steps_[i].node = &g.node(p.schedule_[i]);
    p.steps_[i].kernel = std::move(program.kernels[i]);
  }

  // Storage: one arena for activations, scratch and gradient temporaries, as the compiler planned it.
  memory::StoragePlan& storage = program.storage;
  p.buffers_ = std::move(storage.buffers);
  p.arena_plan_ = std::move(storage.arena);
  char* arena = nullptr;
  if (shared_arena) {
    p.shared_arena_ = std::move(shared_arena);
    arena = p.shared_arena_->reserve(*p.device_, p.arena_plan_.arena_bytes);
  } else {
    p.arena_ = p.device_->allocate(p.arena_plan_.arena_bytes);
    arena = static_cast<char*>(p.arena_.get());
  }
  p.arena_base_ = arena;
  auto storage_offset = [&](int s) { return static_cast<int64_t>(p.arena_plan_.offsets[static_cast<size_t>(s)]); };
  auto storage_ptr = [&](int s) { return arena + storage_offset(s); };
  p.value_offsets_.assign(num_values, -1);
  for (const ir::Value& v : g.values())
    if (storage.buffer_of[static_cast<size_t>(v.id)] >= 0) {
      p.value_offsets_[static_cast<size_t>(v.id)] = storage_offset(storage.buffer_of[static_cast<size_t>(v.id)]);
      p.value_tensors_[static_cast<size_t>(v.id)] =
          Tensor::view(storage_ptr(storage.buffer_of[static_cast<size_t>(v.id)]), v.shape, v.dtype);
    }

  // Inputs: one plan-owned buffer each, inside a single allocation.
  size_t input_bytes = 0;
  for (ValueId v : g.inputs()) input_bytes += align_up(g.value(v).shape.numel() * dtype_size(g.value(v).dtype));
  kernels::DeviceBuffer input_memory = p.device_->allocate(input_bytes);
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
  p.gradient_final_node_.assign(params.slots().size(), -1);
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
      int64_t out_offset = p.value_offsets_[static_cast<size_t>(v)];
      uint8_t accumulate = 0;
      if (memory::is_bound_gradient(g, v)) {
        p.gradient_final_node_[params.index(g.value(g.value(v).gradient_of).name)] = i;
        int temp = storage.temporaries_of[static_cast<size_t>(i)][temp_index++];
        if (temp >= 0) {
          Tensor t = Tensor::view(storage_ptr(temp), out.shape(), out.dtype());
          step.accumulations.push_back({t.data_as<float>(), out.data_as<float>(), out.numel(), storage_offset(temp)});
          out = t;
          out_offset = storage_offset(temp);
        } else {
          accumulate = 1;
        }
      }
      step.args.outputs.push_back(out);
      step.output_offsets.push_back(out_offset);
      step.args.accumulate.push_back(accumulate);
    }
    if (storage.scratch_of[static_cast<size_t>(i)] >= 0) {
      step.scratch_offset = storage_offset(storage.scratch_of[static_cast<size_t>(i)]);
      step.args.scratch = storage_ptr(storage.scratch_of[static_cast<size_t>(i)]);
    }
  }
  p.report_.input_bytes = input_bytes;
  p.report_.parameter_bytes = static_cast<size_t>(params.flat_numel()) * sizeof(float);
  p.report_.gradient_bytes = p.report_.parameter_bytes;
  p.report_.frozen_parameter_bytes = params.frozen_bytes();
  p.report_.activation_peak_bytes = p.arena_plan_.arena_bytes;
  p.report_.activation_naive_bytes = storage.naive_bytes;
  p.report_.num_buffers = p.buffers_.size();
  p.report_.num_in_place = storage.num_in_place;
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

bool Plan::has_input(const std::string& name) const {
  for (const InputBinding& b : inputs_)
    if (b.name == name) return true;
  return false;
}

void Plan::bind_input(const std::string& name, const void* data) {
  FT_CHECK(data == nullptr || device_->host_visible(), "bind_input(\"", name, "\"): the plan runs on ",
           device_->name(), ", whose memory the host does not read in place; upload_input copies the data there");
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

void Plan::upload_input(const std::string& name, const void* host_data) {
  bind_input(name, nullptr);
  if (host_data == nullptr) return;
  const Tensor own = input(name);
  device_->upload(own.data(), host_data, own.nbytes());
}

Tensor Plan::staging(const std::string& name) {
  const Tensor own = input(name);  // throws with the list of inputs
  if (device_->host_visible()) return own;
  for (InputBinding& b : inputs_)
    if (b.name == name) {
      b.mirror.resize(own.nbytes());
      return Tensor::view(b.mirror.data(), own.shape(), own.dtype());
    }
  return own;
}

void Plan::upload_staging(const std::string& name) {
  bind_input(name, nullptr);
  if (device_->host_visible()) return;
  for (InputBinding& b : inputs_)
    if (b.name == name && !b.mirror.empty()) device_->upload(b.owned, b.mirror.data(), b.mirror.size());
}

void Plan::run(RunObserver* observer) {
  follow_shared_arena();
  kernels::StepContext ctx;
  ctx.rng_offset = step_;
  ctx.num_threads = num_threads_;
  if (observer == nullptr) {
    for (Step& step : steps_) {
      step.kernel->run(step.args, ctx);
      for (const Step::Accumulation& a : step.accumulations) device_->add_into(a.dest, a.temp, a.numel, ctx);
    }
  } else {
    observer->begin(*this);
    for (size_t i = 0; i < steps_.size(); ++i) {
      steps_[i].kernel->run(steps_[i].args, ctx);
      for (const Step::Accumulation& a : steps_[i].accumulations) device_->add_into(a.dest, a.temp, a.numel, ctx);
      observer->after_node(i);
    }
    observer->end();
  }
  ++step_;
}

void Plan::run_profiled(std::vector<double>& seconds) {
  follow_shared_arena();
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

Tensor Plan::read_output(ValueId value) {
  const Tensor out = output(value);
  if (device_->host_visible()) return out;
  std::vector<std::byte>& mirror = output_mirrors_[value];
  mirror.resize(out.nbytes());
  device_->download(mirror.data(), out.data(), out.nbytes());
  return Tensor::view(mirror.data(), out.shape(), out.dtype());
}

}  // namespace fusetrain::runtime
