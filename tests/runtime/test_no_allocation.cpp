// After the first step, a training step (zero gradients, forward, backward,
// clipped AdamW update) performs no heap allocation. Every malloc-family call
// and operator new in the process is counted; this binary holds only this test.
// FUSETRAIN_TRAP_ON_ALLOCATION=1 stops at the first counted allocation (run under gdb).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <new>
#include <vector>

#include "fusetrain/fusetrain.h"
#include "support/models.h"

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void __libc_free(void*);
}

namespace {
std::atomic<long> g_allocations{0};
std::atomic<bool> g_counting{false};
bool trap_on_allocation = false;
void count() {
  if (g_counting.load(std::memory_order_relaxed)) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    if (trap_on_allocation) __builtin_trap();
  }
}
}  // namespace

extern "C" {
void* malloc(size_t n) {
  count();
  return __libc_malloc(n);
}
void* calloc(size_t n, size_t size) {
  count();
  return __libc_calloc(n, size);
}
void* realloc(void* p, size_t n) {
  count();
  return __libc_realloc(p, n);
}
void free(void* p) { __libc_free(p); }
int posix_memalign(void** out, size_t align, size_t n) {
  count();
  *out = __libc_memalign(align, n);
  return *out ? 0 : 12;
}
void* aligned_alloc(size_t align, size_t n) {
  count();
  return __libc_memalign(align, n);
}
void* memalign(size_t align, size_t n) {
  count();
  return __libc_memalign(align, n);
}
}

namespace fusetrain::testing {
namespace {

long allocations_during(const std::function<void()>& work) {
  g_allocations = 0;
  g_counting = true;
  work();
  g_counting = false;
  return g_allocations.load();
}

TEST(NoAllocation, CounterSeesAllocations) {
  // The counter must be able to fail: a vector allocation is seen.
  long n = allocations_during([] {
    std::vector<int> v(1000);
    v[10] = 1;
    asm volatile("" : : "r"(v.data()) : "memory");
  });
  EXPECT_GT(n, 0);
}

TEST(NoAllocation, SteadyStateTrainingStep) {
  ir::Graph graph;
  ir::GraphBuilder b(graph, 3);
  TinyTransformer cfg;
  ir::ValueId loss = build_tiny_transformer(b, cfg);
  graph.mark_output(loss);
  autodiff::build_backward(graph, loss, graph.params());
  runtime::ParameterStore params(graph);
  for (int64_t i = 0; i < params.flat_numel(); ++i)
    params.params_data()[i] = 0.02f * static_cast<float>((i * 7919) % 101 - 50) / 50.0f;
  runtime::PlanOptions options;
  options.num_threads = 2;
  auto plan = compile::compile_plan(graph, params, options);
  int64_t* ids = plan->input("input_ids").data_as<int64_t>();
  int64_t* labels = plan->input("labels").data_as<int64_t>();
  for (int64_t i = 0; i < cfg.batch * cfg.seq; ++i) {
    ids[i] = i % cfg.vocab;
    labels[i] = (i * 3) % cfg.vocab;
  }
  optim::AdamW optimizer(params, {.lr = 1e-3});
  optimizer.set_num_threads(2);
  auto step = [&] {
    params.zero_grads();
    plan->run();
    optimizer.clip_and_step(1.0);
  };
  trap_on_allocation = std::getenv("FUSETRAIN_TRAP_ON_ALLOCATION") != nullptr;
  step();  // warm-up: the OpenMP pool starts here
  step();
  long n = allocations_during([&] {
    for (int i = 0; i < 5; ++i) step();
  });
  EXPECT_EQ(n, 0) << "heap allocations during 5 steady-state training steps";
  EXPECT_TRUE(std::isfinite(plan->output(loss).item()));
}

}  // namespace
}  // namespace fusetrain::testing
