#include "fusetrain/core/error.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {

std::unique_ptr<Kernel> create_kernel(const ir::Graph& graph, const ir::Node& node, Backend backend) {
  if (backend == Backend::Optimized) {
    if (std::unique_ptr<Kernel> k = make_cpu_dense_kernel(graph, node)) return k;
    if (std::unique_ptr<Kernel> k = make_cpu_basic_kernel(graph, node)) return k;
  }
  return make_ref_kernel(graph, node);
}

}  // namespace fusetrain::kernels
