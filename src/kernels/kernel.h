// The kernel interface: one Kernel object per node, created at plan-compile time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "fusetrain/core/tensor.h"
#include "fusetrain/ir/graph.h"

namespace fusetrain::kernels {

/// Which implementation a plan binds: tuned CPU kernels, or the plain-loop
/// references under kernels/ref that tests compare against.
enum class Backend { Optimized, Reference };

/// Per-step values a kernel may read. Plain data: building one never allocates.
struct StepContext {
  uint64_t rng_offset = 0;  ///< advances every step; dropout masks depend on (seed, rng_offset, element)
  int num_threads = 1;
};

/// The memory a node reads and writes, bound once at plan time.
struct KernelArgs {
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;
  /// Per output: 1 means add into the existing contents (gradient buffers), 0 means overwrite.
  std::vector<uint8_t> accumulate;
  /// scratch_bytes() bytes of 64-byte aligned arena memory, live only during run().
  void* scratch = nullptr;
};

/// A kernel for one node. The constructor reads the node's attributes and
/// shapes; run() does the arithmetic and must not allocate.
class Kernel {
 public:
  virtual ~Kernel() = default;
  /// Scratch memory run() needs with `num_threads` threads.
  virtual size_t scratch_bytes(int num_threads) const {
    (void)num_threads;
    return 0;
  }
  /// True if run() honours KernelArgs::accumulate itself; otherwise the runtime
  /// directs the output to a temporary and adds it into the destination.
  virtual bool accumulates() const { return false; }
  virtual void run(const KernelArgs& args, const StepContext& ctx) = 0;
};

/// Creates the kernel that computes `node` of `graph` with `backend`.
/// Throws Error if the combination of dtypes is not implemented.
std::unique_ptr<Kernel> create_kernel(const ir::Graph& graph, const ir::Node& node, Backend backend);

}  // namespace fusetrain::kernels
