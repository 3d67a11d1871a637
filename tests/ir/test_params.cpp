// decode_params: typed op parameters from node attributes, the op table's Params column,
// and the messages for attributes an op does not take.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <type_traits>

#include "fusetrain/core/error.h"
#include "fusetrain/ir/builder.h"
#include "fusetrain/ir/params.h"
#include "support/test_util.h"

namespace fusetrain::ir {
namespace {

using fusetrain::testing::error_of;

static_assert(std::is_same_v<ParamsOf<OpKind::MatMul>, ops::MatMulParams>);
static_assert(std::is_same_v<ParamsOf<OpKind::AttentionBackward>, ops::AttentionParams>);
static_assert(std::is_same_v<ParamsOf<OpKind::Relu>, ops::NoParams>);
static_assert(ops::params_index(OpKind::SoftmaxCrossEntropy) == ops::params_index_of<ops::CrossEntropyParams>());

TEST(DecodeParams, ReadsTypedValuesAndDefaults) {
  const OpParams mm = decode_params(OpKind::MatMul, {{"trans_b", int64_t{1}}}, "mm");
  EXPECT_FALSE(std::get<ops::MatMulParams>(mm).trans_a);
  EXPECT_TRUE(std::get<ops::MatMulParams>(mm).trans_b);
  EXPECT_EQ(std::get<ops::MatMulParams>(mm).out_dtype, DType::f32);

  EXPECT_EQ(std::get<ops::CrossEntropyParams>(decode_params(OpKind::SoftmaxCrossEntropy, {}, "")).ignore_index, -100);

  const OpParams attention = decode_params(
      OpKind::Attention, {{"scale", 0.125}, {"causal", int64_t{1}}, {"out_dtype", std::string("bf16")}}, "attn");
  const auto& a = std::get<ops::AttentionParams>(attention);
  EXPECT_EQ(a.scale, 0.125);
  EXPECT_TRUE(a.causal);
  EXPECT_EQ(a.out_dtype, DType::bf16);
  EXPECT_EQ(a.stream_rows(7), 7);  // rng_rows absent: the query length
  EXPECT_EQ(a.window, 0);            // absent: no sliding window

  // An integer is accepted where a number is expected.
  EXPECT_EQ(std::get<ops::ScaleParams>(decode_params(OpKind::Scale, {{"alpha", int64_t{3}}}, "")).alpha, 3.0);
  const ops::GeluParams gelu =
      std::get<ops::GeluParams>(decode_params(OpKind::Gelu, {{"approximate", std::string("tanh")}}, ""));
  EXPECT_EQ(gelu.approximate, ops::GeluApproximation::Tanh);
}

TEST(DecodeParams, EveryOpDecodesToItsTableStruct) {
  // Every required attribute of every op, with a valid value. Decoding all of them names the
  // ones the op takes ("unknown attribute ... (Op takes a, b)"); decoding just those must give
  // the op's Params struct from ops.def.
  const Attrs all{{"shape", std::vector<int64_t>{2}}, {"value", 1.0},       {"alpha", 1.0},
                  {"exponent", 2.0},                  {"eps", 1e-5},        {"p", 0.1},
                  {"seed", int64_t{1}},               {"num_embeddings", int64_t{4}},
                  {"perm", std::vector<int64_t>{0}},  {"axis", int64_t{0}}, {"sizes", std::vector<int64_t>{1}},
                  {"start", int64_t{0}},              {"end", int64_t{1}},  {"axes", std::vector<int64_t>{0}},
                  {"dtype", std::string("f32")},      {"scale", 1.0},       {"rows", int64_t{2}},
                  {"cols", int64_t{64}},              {"kernel", std::vector<int64_t>{2}}};
  for (int i = 0; i < kNumOps; ++i) {
    const OpKind op = static_cast<OpKind>(i);
    const std::string msg = error_of([&] { decode_params(op, all, "n"); });
    const size_t takes = msg.find(" takes ");
    ASSERT_NE(takes, std::string::npos) << msg;
    const std::string names = ", " + msg.substr(takes + 7, msg.size() - takes - 8) + ",";  // ", a, b,"
    Attrs used;
    for (const auto& [name, value] : all.items())
      if (names.find(", " + name + ",") != std::string::npos) used.set(name, value);
    OpParams params;
    ASSERT_NO_THROW(params = decode_params(op, used, "n")) << op_name(op);
    EXPECT_EQ(params.index(), ops::params_index(op)) << op_name(op);
  }
}

TEST(DecodeParams, RejectsAnUnknownAttribute) {
  const std::string msg =
      error_of([&] { decode_params(OpKind::MatMul, {{"trans_a", int64_t{1}}, {"transpose", int64_t{1}}}, "proj"); });
  EXPECT_NE(msg.find("MatMul \"proj\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown attribute \"transpose\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("trans_a, trans_b, out_dtype"), std::string::npos) << msg;

  // Graph building decodes too: a node with a misspelt attribute is refused at once.
  Graph g;
  GraphBuilder b(g);
  const ValueId x = b.param("x", {4});
  const std::string built = error_of([&] { g.add(OpKind::Relu, {x}, {{"alpha", 0.1}}); });
  EXPECT_NE(built.find("Relu"), std::string::npos) << built;
  EXPECT_NE(built.find("unknown attribute \"alpha\" (Relu takes no attributes)"), std::string::npos) << built;
}

TEST(DecodeParams, RejectsAWronglyTypedAttribute) {
  const std::string msg =
      error_of([&] { decode_params(OpKind::SoftmaxCrossEntropy, {{"ignore_index", 0.5}}, "loss"); });
  EXPECT_NE(msg.find("SoftmaxCrossEntropy \"loss\": attribute \"ignore_index\" should be an integer, found a number"),
            std::string::npos)
      << msg;
  const std::string missing = error_of([&] { decode_params(OpKind::Transpose, {}, "t"); });
  EXPECT_NE(missing.find("Transpose \"t\": missing attribute \"perm\" (a list of integers)"), std::string::npos)
      << missing;
  const std::string dtype = error_of([&] { decode_params(OpKind::Cast, {{"dtype", std::string("f8")}}, "c"); });
  EXPECT_NE(dtype.find("Cast \"c\": dtype names an unknown dtype \"f8\""), std::string::npos) << dtype;
}

}  // namespace
}  // namespace fusetrain::ir

namespace fusetrain::testing {
namespace {

// Output sizes as torch's max_pool2d / avg_pool2d give them (floor, or ceil with a last window starting inside the
// input), and the geometries the op refuses.
TEST(PoolGeometry, SizesAsTorchAndRefusals) {
  using ops::PoolGeometry;
  using ops::PoolParams;
  PoolParams resnet{true, {3, 3}, {2, 2}, {1, 1, 1, 1}, {}, false, false};
  PoolGeometry g = PoolGeometry::of(resnet, {2, 8, 56, 56});
  EXPECT_EQ(g.output_dims(), (std::vector<int64_t>{2, 8, 28, 28}));
  PoolParams ceil{true, {3, 3}, {2, 2}, {}, {}, true, false};
  EXPECT_EQ(PoolGeometry::of(ceil, {1, 1, 6, 7}).output_dims(), (std::vector<int64_t>{1, 1, 3, 3}));  // floor: 2, 3
  // ceil_mode with padding: a window that would start in the trailing padding is dropped (torch: 7 -> 4, not 5).
  PoolParams padded{true, {2}, {2}, {1, 1}, {}, true, false};
  EXPECT_EQ(PoolGeometry::of(padded, {1, 1, 7}).output_dims(), (std::vector<int64_t>{1, 1, 4}));
  PoolParams dilated{true, {3}, {1}, {}, {2}, false, false};
  EXPECT_EQ(PoolGeometry::of(dilated, {1, 1, 9}).output_dims(), (std::vector<int64_t>{1, 1, 5}));
  EXPECT_CONTAINS(error_of([] { PoolGeometry::of(PoolParams{true, {3, 3}, {}, {3, 0, 0, 0}, {}, false, false},
                                                 {1, 1, 8, 8}); }),
                  "as large as a window");
  EXPECT_CONTAINS(error_of([] { PoolGeometry::of(PoolParams{false, {2}, {}, {}, {2}, false, false}, {1, 1, 8}); }),
                  "average pooling with dilations");
  EXPECT_CONTAINS(error_of([] { PoolGeometry::of(PoolParams{true, {3}, {}, {}, {}, false, false}, {1, 1, 8, 8}); }),
                  "\"kernel\" has 1 sizes; expected 2");
  EXPECT_CONTAINS(error_of([] { PoolGeometry::of(PoolParams{true, {5, 5}, {}, {}, {}, false, false}, {1, 1, 4, 9}); }),
                  "a window spanning (5, 5) over a padded input of (4, 9)");
}

}  // namespace
}  // namespace fusetrain::testing
