// Small test graphs, one or more per differentiable op, used by the forward
// (tuned vs reference) tests and the finite-difference gradient checks.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fusetrain/ir/builder.h"

namespace fusetrain::testing {

/// How to fill one graph input or parameter before a run.
struct Fill {
  double low = -1.0, high = 1.0;  ///< uniform range for floats
  int64_t int_high = 0;           ///< integer inputs: uniform in [0, int_high)
  double ignore_fraction = 0.0;   ///< integer inputs: fraction set to -100 (ignored targets)
  double quantum = 0.0;           ///< round float values to multiples of this (0: no rounding)
  double mask_fraction = 0.0;     ///< float inputs named "mask*": fraction set to -10000
  int64_t segment = 0;            ///< integer (rows, T) inputs: t − t mod segment (packed examples' key_begin)
};

/// A case: `build` declares parameters (differentiated) and inputs (fed data)
/// and returns the outputs the loss is taken over. `n` scales one axis so the
/// case runs at sizes 1, 3, 17, 129.
struct OpCase {
  std::string name;
  ir::OpKind op;
  std::function<std::vector<ir::ValueId>(ir::GraphBuilder&, int64_t n)> build;
  std::map<std::string, Fill> fills;  ///< by parameter/input name; default uniform [-1, 1]
  double eps = 1e-3;                  ///< finite-difference step
  double tolerance = 2e-2;            ///< norm-wise relative error allowed by the gradient check
  int64_t max_gradcheck_n = 3;        ///< largest n used by the (slow) gradient check
  /// The gradient check runs the reference kernels: the tuned ones round inside the op (bf16 attention tiles round
  /// each probability to bf16), noise central differences cannot resolve; tests/kernels compare the two.
  bool gradcheck_reference_kernels = false;
  /// Where the op's gradient intentionally differs from the derivative (an
  /// embedding's padding row gets none), edits the numeric gradient of parameter i.
  std::function<void(size_t param, std::vector<double>& numeric)> expected_from_numeric;
};

/// Every case, for every op that has one.
const std::vector<OpCase>& op_cases();

/// Fills the inputs and parameters of `graph` named in `fills` (or with the default).
std::map<std::string, std::vector<double>> random_values(const ir::Graph& graph,
                                                         const std::map<std::string, Fill>& fills, uint64_t seed);

}  // namespace fusetrain::testing
