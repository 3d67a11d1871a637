#include "fusetrain/ops/params.h"

#include <array>

namespace fusetrain::ops {
namespace {

// In OpParams order.
constexpr std::array<const char*, std::variant_size_v<OpParams>> kParamsNames = {
    "NoParams",           "FillParams",        "MatMulParams",          "GeluParams",
    "GeluBackwardParams", "LinearGeluParams",  "ScaleParams",           "PowParams",
    "LayerNormParams",    "DropoutParams",     "AddLayerNormParams",    "EmbeddingParams",
    "EmbeddingBackwardParams", "ShapeParams",  "TransposeParams",       "SplitParams",
    "ConcatParams",       "SliceParams",       "SliceBackwardParams",   "ReduceParams",
    "CastParams",         "CrossEntropyParams", "LinearCrossEntropyParams", "LogProbsParams",
    "PreferenceParams",   "QuantizedParams",   "AttentionParams",       "RoPEParams",
    "LinearParams",       "ConvParams",        "CtcParams"};

static_assert(params_index_of<CtcParams>() == kParamsNames.size() - 1);
static_assert(params_index_of<LogProbsParams>() == 23 && params_index_of<AttentionParams>() == 26);
static_assert(params_index_of<MatMulParams>() == 2 && params_index_of<ShapeParams>() == 13);

}  // namespace

const char* params_name(size_t index) { return index < kParamsNames.size() ? kParamsNames[index] : "?"; }

}  // namespace fusetrain::ops
