#include "support/op_cases.h"

#include <cmath>
#include <random>
#include <string>

namespace fusetrain::testing {

using ir::GraphBuilder;
using ir::OpKind;
using ir::ValueId;
using Outs = std::vector<ValueId>;

namespace {

std::vector<OpCase> make_cases() {
  std::vector<OpCase> c;
  auto add = [&](std::string name, OpKind op, std::function<Outs(GraphBuilder&, int64_t)> build,
                 std::map<std::string, Fill> fills = {}) -> OpCase& {
    c.push_back({std::move(name), op, std::move(build), std::move(fills)});
    return c.back();
  };

  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      add("matmul_2d_ta" + std::to_string(ta) + "_tb" + std::to_string(tb), OpKind::MatMul,
          [ta, tb](GraphBuilder& b, int64_t n) {
            ValueId a = b.param("a", ta ? Shape{5, n} : Shape{n, 5});
            ValueId w = b.param("b", tb ? Shape{4, 5} : Shape{5, 4});
            return Outs{b.matmul(a, w, ta, tb)};
          });
  add("matmul_batched", OpKind::MatMul, [](GraphBuilder& b, int64_t n) {
    return Outs{b.matmul(b.param("a", {2, 3, n, 4}), b.param("b", {2, 3, 5, 4}), false, true)};
  });
  add("matmul_broadcast_b", OpKind::MatMul, [](GraphBuilder& b, int64_t n) {
    return Outs{b.matmul(b.param("a", {2, n, 4}), b.param("b", {4, 3}))};
  });
  add("matmul_broadcast_a", OpKind::MatMul, [](GraphBuilder& b, int64_t n) {
    return Outs{b.matmul(b.param("a", {n, 4}), b.param("b", {2, 4, 3}))};
  });
  {
    // Values on a 1/16 grid in [-1, 1] and steps of 1/16 stay exact in bf16; the
    // loss is linear in each element, so central differences are exact too.
    OpCase& bf16 = add("matmul_bf16", OpKind::MatMul,
                       [](GraphBuilder& b, int64_t n) {
                         ValueId a = b.cast(b.param("a", {n, 8}), DType::bf16);
                         ValueId w = b.cast(b.param("b", {8, 4}), DType::bf16);
                         return Outs{b.matmul(a, w)};
                       },
                       {{"a", {-1, 1, 0, 0, 1.0 / 16}}, {"b", {-1, 1, 0, 0, 1.0 / 16}}});
    bf16.eps = 1.0 / 16;
  }
  add("linear_bias", OpKind::Linear, [](GraphBuilder& b, int64_t n) {
    return Outs{b.linear(b.param("x", {2, n, 6}), b.param("w", {4, 6}), b.param("bias", {4}))};
  });
  add("linear_no_bias", OpKind::Linear, [](GraphBuilder& b, int64_t n) {
    return Outs{b.linear(b.param("x", {n, 5}), b.param("w", {3, 5}))};
  });
  for (const char* approximate : {"none", "tanh"})
    add(std::string("linear_gelu_") + approximate, OpKind::LinearGelu, [approximate](GraphBuilder& b, int64_t n) {
      ValueId x = b.param("x", {2, n, 6}), w = b.param("w", {4, 6}), bias = b.param("bias", {4});
      Outs yz = b.graph().add_node(OpKind::LinearGelu, {x, w, bias}, {{"approximate", std::string(approximate)}});
      return Outs{yz[0], b.mul(yz[1], yz[1])};  // both outputs reach the loss
    });
  // GELU results rounded to bf16 (out_dtype, as fold_output_casts writes them), from f32 or bf16
  // inputs, and LinearGelu's with a bf16 z: the rounding swamps central differences, so these are
  // compared with the reference kernels only.
  for (int variant = 0; variant < 3; ++variant) {
    OpCase& c = add(variant == 0   ? "gelu_bf16_out"
                    : variant == 1 ? "gelu_bf16_in_out"
                                   : "linear_gelu_bf16_out",
                    variant < 2 ? OpKind::Gelu : OpKind::LinearGelu, [variant](GraphBuilder& b, int64_t n) {
                      const ir::Attrs bf16_out{{"approximate", std::string("none")}, {"out_dtype", std::string("bf16")}};
                      if (variant < 2) {
                        ValueId x = b.param("x", {n, 40});
                        if (variant == 1) x = b.cast(x, DType::bf16);
                        return Outs{b.cast(b.graph().add(OpKind::Gelu, {x}, bf16_out), DType::f32)};
                      }
                      ir::Attrs attrs = bf16_out;
                      attrs.set("z_dtype", std::string("bf16"));
                      ValueId x = b.cast(b.param("x", {2, n, 24}), DType::bf16);
                      ValueId w = b.cast(b.param("w", {20, 24}), DType::bf16);
                      Outs yz = b.graph().add_node(OpKind::LinearGelu, {x, w, b.param("bias", {20})}, attrs);
                      return Outs{b.cast(yz[0], DType::f32)};
                    });
    c.tolerance = 2e-2;
    c.max_gradcheck_n = 0;
  }

  add("add_broadcast", OpKind::Add, [](GraphBuilder& b, int64_t n) {
    return Outs{b.add(b.param("a", {n, 4}), b.param("b", {4}))};
  });
  add("add_both_broadcast", OpKind::Add, [](GraphBuilder& b, int64_t n) {
    return Outs{b.add(b.param("a", {n, 1}), b.param("b", {1, 3}))};
  });
  add("add_same_value", OpKind::Add, [](GraphBuilder& b, int64_t n) {
    ValueId x = b.param("x", {n, 3});
    return Outs{b.add(x, x)};
  });
  add("sub_broadcast", OpKind::Sub, [](GraphBuilder& b, int64_t n) {
    return Outs{b.sub(b.param("a", {2, n}), b.param("b", {2, 1}))};
  });
  add("mul_broadcast", OpKind::Mul, [](GraphBuilder& b, int64_t n) {
    return Outs{b.mul(b.param("a", {n, 4}), b.param("b", {1, 4}))};
  });
  add("div_broadcast", OpKind::Div,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.div(b.param("a", {n, 3}), b.param("b", {3}))};
      },
      {{"b", {0.5, 1.5}}});
  add("scale", OpKind::Scale, [](GraphBuilder& b, int64_t n) { return Outs{b.scale(b.param("x", {n, 3}), -2.5)}; });
  add("gelu_erf", OpKind::Gelu,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.gelu(b.param("x", {n, 5}), "none")};
      },
      {{"x", {-3, 3}}});
  add("gelu_tanh", OpKind::Gelu,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.gelu(b.param("x", {n, 5}), "tanh")};
      },
      {{"x", {-3, 3}}});
  add("tanh", OpKind::Tanh,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.tanh(b.param("x", {n, 4}))};
      },
      {{"x", {-2, 2}}});
  for (double exponent : {2.0, -0.5})
    add(exponent == 2.0 ? "pow_2" : "pow_minus_half", OpKind::Pow,
        [exponent](GraphBuilder& b, int64_t n) {
          return Outs{b.graph().add(OpKind::Pow, {b.param("x", {n, 5})}, {{"exponent", exponent}})};
        },
        {{"x", {0.5, 2}}});
  add("sqrt", OpKind::Sqrt,
      [](GraphBuilder& b, int64_t n) { return Outs{b.graph().add(OpKind::Sqrt, {b.param("x", {n, 5})})}; },
      {{"x", {0.5, 2}}});
  add("erf", OpKind::Erf,
      [](GraphBuilder& b, int64_t n) { return Outs{b.graph().add(OpKind::Erf, {b.param("x", {n, 5})})}; },
      {{"x", {-2, 2}}});
  add("relu", OpKind::Relu, [](GraphBuilder& b, int64_t n) { return Outs{b.relu(b.param("x", {n, 4}))}; });
  add("softmax", OpKind::Softmax,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.softmax(b.param("x", {n, 7}))};
      },
      {{"x", {-3, 3}}});
  add("layer_norm", OpKind::LayerNorm,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.layer_norm(b.param("x", {2, n, 8}), b.param("gamma", {8}), b.param("beta", {8}), 1e-5)};
      },
      {{"gamma", {0.5, 1.5}}});
  add("rms_norm", OpKind::RMSNorm,
      [](GraphBuilder& b, int64_t n) { return Outs{b.rms_norm(b.param("x", {2, n, 8}), b.param("weight", {8}), 1e-6)}; },
      {{"weight", {0.5, 1.5}}});
  add("swiglu", OpKind::SwiGLU,
      [](GraphBuilder& b, int64_t n) { return Outs{b.swiglu(b.param("gate", {n, 7}), b.param("up", {n, 7}))}; },
      {{"gate", {-4, 4}}});
  {
    // bf16 gate and up (the bf16 model's form): rounding swamps central differences, so this is compared with the
    // reference kernels only.
    OpCase& bf16 = add("swiglu_bf16", OpKind::SwiGLU, [](GraphBuilder& b, int64_t n) {
      ValueId gate = b.cast(b.param("gate", {n, 40}), DType::bf16), up = b.cast(b.param("up", {n, 40}), DType::bf16);
      return Outs{b.cast(b.swiglu(gate, up), DType::f32)};
    });
    bf16.tolerance = 2e-2;
    bf16.max_gradcheck_n = 0;
  }
  for (bool inverse : {false, true})
    add(inverse ? "rope_inverse" : "rope", OpKind::RoPE, [inverse](GraphBuilder& b, int64_t n) {
      return Outs{b.rope(b.param("x", {2, n, 3, 8}), b.input("cos", {2, n, 8}), b.input("sin", {2, n, 8}), inverse)};
    });
  // Partial rotary (Phi, GPT-NeoX): tables 4 wide rotate the first 4 of each head's 8; the other 4 pass through.
  add("rope_partial", OpKind::RoPE, [](GraphBuilder& b, int64_t n) {
    return Outs{b.rope(b.param("x", {2, n, 3, 8}), b.input("cos", {2, n, 4}), b.input("sin", {2, n, 4}))};
  });
  // Convolutions: n scales the width. Whisper's front end (1-D, stride 2, padded), a 3×3 same-padded 2-D one, a
  // grouped, dilated, strided one with uneven padding, ConvNeXt's depthwise 7×7, a strided depthwise 1-D one
  // (Wav2Vec2's grouped positional convolution at one channel per group), a pointwise 1×1 one.
  add("conv1d_stride2", OpKind::Conv, [](GraphBuilder& b, int64_t n) {
    return Outs{b.conv(b.param("x", {2, 3, n + 2}), b.param("w", {4, 3, 3}), b.param("bias", {4}), {2}, {1, 1})};
  });
  add("conv2d_3x3", OpKind::Conv, [](GraphBuilder& b, int64_t n) {
    return Outs{b.conv(b.param("x", {2, 3, 4, n}), b.param("w", {5, 3, 3, 3}), ir::kNone, {}, {1, 1, 1, 1})};
  });
  add("conv2d_grouped_dilated", OpKind::Conv, [](GraphBuilder& b, int64_t n) {
    return Outs{b.conv(b.param("x", {2, 4, 5, n + 3}), b.param("w", {6, 2, 2, 3}), b.param("bias", {6}), {1, 2},
                       {1, 0, 0, 2}, {2, 1}, 2)};
  });
  add("conv2d_depthwise_7x7", OpKind::Conv, [](GraphBuilder& b, int64_t n) {
    return Outs{b.conv(b.param("x", {2, 3, 5, n}), b.param("w", {3, 1, 7, 7}), b.param("bias", {3}), {},
                       {3, 3, 3, 3}, {}, 3)};
  });
  add("conv1d_depthwise_stride2", OpKind::Conv, [](GraphBuilder& b, int64_t n) {
    return Outs{b.conv(b.param("x", {2, 4, n + 3}), b.param("w", {4, 1, 4}), ir::kNone, {2}, {2, 1}, {}, 4)};
  });
  add("conv2d_pointwise", OpKind::Conv, [](GraphBuilder& b, int64_t n) {
    return Outs{b.conv(b.param("x", {2, 4, 3, n}), b.param("w", {6, 4, 1, 1}), b.param("bias", {6}))};
  });
  // Pooling: ResNet's max pool (3x3, stride 2, padding 1), a dilated one with ceil_mode's partial last window, 1-D;
  // PoolFormer's average pool without the padding in its divisor (count_include_pad=0), one with it and ceil_mode
  // (its last window clipped at the padded edge). Continuous random inputs leave no ties within a max window.
  add("max_pool2d_3x3_stride2", OpKind::Pool, [](GraphBuilder& b, int64_t n) {
    return Outs{b.pool(b.param("x", {2, 3, 5, n + 3}), true, {3, 3}, {2, 2}, {1, 1, 1, 1})};
  });
  add("max_pool2d_dilated_ceil", OpKind::Pool, [](GraphBuilder& b, int64_t n) {
    return Outs{b.pool(b.param("x", {1, 2, 6, n + 4}), true, {2, 3}, {2, 2}, {0, 1, 1, 0}, {2, 1}, true)};
  });
  add("max_pool1d", OpKind::Pool, [](GraphBuilder& b, int64_t n) {
    return Outs{b.pool(b.param("x", {2, 3, n + 4}), true, {3}, {2})};
  });
  add("avg_pool2d_exclude_pad", OpKind::Pool, [](GraphBuilder& b, int64_t n) {
    return Outs{b.pool(b.param("x", {2, 3, 4, n + 2}), false, {3, 3}, {1, 1}, {1, 1, 1, 1})};
  });
  add("avg_pool2d_include_pad_ceil", OpKind::Pool, [](GraphBuilder& b, int64_t n) {
    return Outs{b.pool(b.param("x", {2, 2, 5, n + 3}), false, {2, 3}, {2, 2}, {1, 1, 0, 1}, {}, true, true)};
  });
  for (const bool depthwise : {false, true}) {
    // bf16 operands on a 1/16 grid with steps of 1/16 stay exact in bf16 (as matmul_bf16), so the products the
    // kernels form in f32 are exact and central differences resolve them.
    OpCase& bf16 = add(depthwise ? "conv2d_depthwise_bf16" : "conv2d_bf16", OpKind::Conv,
                       [depthwise](GraphBuilder& b, int64_t n) {
                         ValueId x = b.cast(b.param("x", {2, 4, 3, n + 1}), DType::bf16);
                         ValueId w = b.cast(b.param("w", depthwise ? Shape{4, 1, 3, 3} : Shape{2, 4, 2, 2}),
                                            DType::bf16);
                         return Outs{b.conv(x, w, ir::kNone, {}, {1, 1, 1, 1}, {}, depthwise ? 4 : 1)};
                       },
                       {{"x", {-1, 1, 0, 0, 1.0 / 16}}, {"w", {-1, 1, 0, 0, 1.0 / 16}}});
    bf16.eps = 1.0 / 16;
  }
  for (double p : {0.0, 0.3})
    add(p == 0.0 ? "add_layer_norm" : "add_layer_norm_dropout", OpKind::AddLayerNorm,
        [p](GraphBuilder& b, int64_t n) {
          ValueId x = b.param("x", {2, n, 8}), residual = b.param("residual", {2, n, 8});
          Outs out = b.graph().add_node(OpKind::AddLayerNorm,
                                        {x, residual, b.param("gamma", {8}), b.param("beta", {8})},
                                        {{"eps", 1e-5}, {"p", p}, {"seed", int64_t{4}}});
          return Outs{out[1], b.mul(out[0], out[0])};  // the sum is read again, as pre-LN models do
        },
        {{"gamma", {0.5, 1.5}}});
  add("embedding", OpKind::Embedding,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.embedding(b.param("weight", {11, 6}), b.input("ids", {2, n}, DType::i64))};
      },
      {{"ids", {0, 0, 11}}});
  {
    // Ids in {0, 1}: the padding row 1 is read by the forward but gets no gradient.
    OpCase& padding = add("embedding_padding_idx", OpKind::Embedding,
                          [](GraphBuilder& b, int64_t n) {
                            return Outs{b.embedding(b.param("weight", {4, 3}), b.input("ids", {2, n}, DType::i64), 1)};
                          },
                          {{"ids", {0, 0, 2}}});
    padding.expected_from_numeric = [](size_t, std::vector<double>& numeric) {
      for (size_t c = 3; c < 6; ++c) numeric[c] = 0.0;
    };
  }
  add("embedding_i32", OpKind::Embedding,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.embedding(b.param("weight", {5, 3}), b.input("ids", {n}, DType::i32))};
      },
      {{"ids", {0, 0, 5}}});
  add("dropout", OpKind::Dropout, [](GraphBuilder& b, int64_t n) {
    return Outs{b.dropout(b.param("x", {n, 8}), 0.3)};
  });
  // Rows of a larger tensor (prune_sliced_rows): rows [2, 5) of 7 of 40 elements, and rows [1, 4)
  // of 6 of 37, whose runs start off a Philox block of four.
  for (int64_t width : {int64_t{40}, int64_t{37}}) {
    add("dropout_stream_rows_" + std::to_string(width), OpKind::Dropout, [width](GraphBuilder& b, int64_t n) {
      const int64_t first = width == 40 ? 2 : 1, rows = width == 40 ? 7 : 6;
      return Outs{b.graph().add(OpKind::Dropout, {b.param("x", {n, 3, width})},
                                {{"p", 0.3},
                                 {"seed", int64_t{5}},
                                 {"index_block", 3 * width},
                                 {"index_stride", rows * width},
                                 {"index_start", first * width}})};
    });
  }
  add("dropout_add", OpKind::DropoutAdd, [](GraphBuilder& b, int64_t n) {
    ValueId x = b.param("x", {n, 40}), residual = b.param("residual", {n, 40});
    Outs y{b.graph().add(OpKind::DropoutAdd, {x, residual}, {{"p", 0.3}, {"seed", int64_t{9}}})};
    return Outs{b.mul(y[0], y[0])};  // a non-linear use so both gradients depend on the mask
  });
  add("reshape", OpKind::Reshape, [](GraphBuilder& b, int64_t n) {
    ValueId y = b.reshape(b.param("x", {n, 6}), {-1, 2, 3});
    return Outs{b.mul(y, y)};  // a non-linear use so the gradient depends on x
  });
  add("transpose_0213", OpKind::Transpose, [](GraphBuilder& b, int64_t n) {
    return Outs{b.transpose(b.param("x", {2, n, 3, 4}), {0, 2, 1, 3})};
  });
  add("transpose_last_two", OpKind::Transpose, [](GraphBuilder& b, int64_t n) {
    return Outs{b.transpose(b.param("x", {n, 5}), {1, 0})};
  });
  add("split", OpKind::Split, [](GraphBuilder& b, int64_t n) { return b.split(b.param("x", {n, 9}), 1, {2, 3, 4}); });
  add("split_unused_piece", OpKind::Split, [](GraphBuilder& b, int64_t n) {
    std::vector<ValueId> pieces = b.split(b.param("x", {4, n}), 0, {1, 3});
    return Outs{pieces[1]};
  });
  add("concat", OpKind::Concat, [](GraphBuilder& b, int64_t n) {
    return Outs{b.concat({b.param("a", {n, 2}), b.param("b", {n, 3}), b.param("c", {n, 1})}, -1)};
  });
  add("slice", OpKind::Slice, [](GraphBuilder& b, int64_t n) { return Outs{b.slice(b.param("x", {n, 7}), 1, 2, 5)}; });
  add("reduce_sum", OpKind::ReduceSum, [](GraphBuilder& b, int64_t n) {
    return Outs{b.reduce_sum(b.param("x", {2, n, 3}), {1})};
  });
  add("reduce_sum_keepdims", OpKind::ReduceSum, [](GraphBuilder& b, int64_t n) {
    return Outs{b.reduce_sum(b.param("x", {n, 4, 3}), {0, 2}, true)};
  });
  add("reduce_mean", OpKind::ReduceMean, [](GraphBuilder& b, int64_t n) {
    return Outs{b.reduce_mean(b.param("x", {n, 5}), {-1})};
  });
  {
    // Values on a 1/8 grid are exact in bf16, and a step of 1/8 keeps them exact.
    OpCase& cast = add("cast_bf16_round_trip", OpKind::Cast,
                       [](GraphBuilder& b, int64_t n) {
                         ValueId x = b.param("x", {n, 4});
                         ValueId y = b.cast(b.cast(x, DType::bf16), DType::f32);
                         return Outs{b.mul(y, y)};
                       },
                       {{"x", {-2, 2, 0, 0, 0.125}}});
    cast.eps = 0.125;
  }
  add("softmax_cross_entropy", OpKind::SoftmaxCrossEntropy,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.softmax_cross_entropy(b.param("logits", {n, 7}), b.input("targets", {n}, DType::i64))};
      },
      {{"logits", {-2, 2}}, {"targets", {0, 0, 7, 0.25}}});
  add("softmax_cross_entropy_3d", OpKind::SoftmaxCrossEntropy,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.softmax_cross_entropy(b.param("logits", {2, n, 5}), b.input("targets", {2, n}, DType::i64))};
      },
      {{"logits", {-2, 2}}, {"targets", {0, 0, 5}}});
  // Chunks of 2 rows make the weight gradient accumulate over several chunks; a quarter of
  // the targets are ignored and must drop out of the loss and every gradient.
  for (int64_t chunk : {int64_t{0}, int64_t{2}})
    add(chunk == 0 ? "linear_cross_entropy" : "linear_cross_entropy_chunked", OpKind::LinearCrossEntropy,
        [chunk](GraphBuilder& b, int64_t n) {
          ValueId x = b.param("x", {2, n, 6}), w = b.param("w", {7, 6}), bias = b.param("bias", {7});
          Outs out = b.graph().add_node(OpKind::LinearCrossEntropy, {x, w, b.input("targets", {2, n}, DType::i64), bias},
                                        {{"ignore_index", int64_t{-100}}, {"chunk_rows", chunk}});
          return Outs{out[0]};  // outputs 1-3 are the gradients the op forms itself
        },
        {{"targets", {0, 0, 7, 0.25}}});
  add("linear_cross_entropy_frozen_weight", OpKind::LinearCrossEntropy,
      [](GraphBuilder& b, int64_t n) {
        // weight_grad 0 (a frozen head): outputs loss and dx only; w and bias are inputs, not parameters.
        ValueId x = b.param("x", {2, n, 6}), w = b.input("w", {7, 6}), bias = b.input("bias", {7});
        Outs out = b.graph().add_node(OpKind::LinearCrossEntropy, {x, w, b.input("targets", {2, n}, DType::i64), bias},
                                      {{"chunk_rows", int64_t{2}}, {"weight_grad", int64_t{0}}});
        return Outs{out[0]};
      },
      {{"targets", {0, 0, 7, 0.25}}});
  add("linear_cross_entropy_no_bias", OpKind::LinearCrossEntropy,
      [](GraphBuilder& b, int64_t n) {
        ValueId x = b.param("x", {n, 5}), w = b.param("w", {9, 5});
        return Outs{b.graph().add_node(OpKind::LinearCrossEntropy, {x, w, b.input("targets", {n}, DType::i32)},
                                       {{"chunk_rows", int64_t{3}}})[0]};
      },
      {{"targets", {0, 0, 9}}});
  {
    // bf16 operands: values on a 1/16 grid are exact in bf16, and so are steps of 1/16.
    OpCase& bf16 = add("linear_cross_entropy_bf16", OpKind::LinearCrossEntropy,
                       [](GraphBuilder& b, int64_t n) {
                         ValueId x = b.cast(b.param("x", {n, 8}), DType::bf16);
                         ValueId w = b.cast(b.param("w", {6, 8}), DType::bf16);
                         ValueId targets = b.input("targets", {n}, DType::i64);
                         return Outs{b.graph().add_node(OpKind::LinearCrossEntropy, {x, w, targets, b.param("bias", {6})},
                                                        {{"chunk_rows", int64_t{2}}})[0]};
                       },
                       {{"x", {-1, 1, 0, 0, 1.0 / 16}},
                        {"w", {-1, 1, 0, 0, 1.0 / 16}},
                        {"bias", {-1, 1, 0, 0, 1.0 / 16}},
                        {"targets", {0, 0, 6, 0.25}}});
    bf16.eps = 1.0 / 16;
    bf16.tolerance = 5e-2;
  }
  // Per-row log-probabilities: a quarter of the targets ignored (log p 0, no gradient); the row statistics are an
  // output too, so the vs-reference test compares them (they take no gradient).
  add("token_log_probs", OpKind::TokenLogProbs,
      [](GraphBuilder& b, int64_t n) {
        Outs out = b.token_log_probs(b.param("logits", {2, n, 7}), b.input("targets", {2, n}, DType::i64), true);
        return Outs{out[0]};
      },
      {{"logits", {-2, 2}}, {"targets", {0, 0, 7, 0.25}}});
  // The fused head: forward forms each row's unit d(log p)/dx (input_grad), backward scales it by the row's
  // incoming gradient and forms dw, dbias from the chunks again (LinearLogProbsWeightGrad, chunks of 2 rows).
  for (int64_t chunk : {int64_t{0}, int64_t{2}})
    add(chunk == 0 ? "linear_log_probs" : "linear_log_probs_chunked", OpKind::LinearLogProbs,
        [chunk](GraphBuilder& b, int64_t n) {
          ValueId x = b.param("x", {2, n, 6}), w = b.param("w", {7, 6}), bias = b.param("bias", {7});
          Outs out = b.graph().add_node(OpKind::LinearLogProbs, {x, w, b.input("targets", {2, n}, DType::i64), bias},
                                        {{"chunk_rows", chunk}, {"input_grad", int64_t{1}}, {"row_stats", int64_t{1}}});
          return Outs{out[0]};  // lse, the unit gradients and the statistics are not differentiated
        },
        {{"targets", {0, 0, 7, 0.25}}});
  add("linear_log_probs_frozen_weight", OpKind::LinearLogProbs,
      [](GraphBuilder& b, int64_t n) {
        ValueId x = b.param("x", {n, 5}), w = b.input("w", {9, 5});
        return Outs{b.graph().add_node(OpKind::LinearLogProbs, {x, w, b.input("targets", {n}, DType::i32)},
                                       {{"chunk_rows", int64_t{3}}, {"input_grad", int64_t{1}}})[0]};
      },
      {{"targets", {0, 0, 9, 0.25}}});
  // A 4-bit quantised weight (random codes, absmax and code table), f32 or bf16 dequantised values, f32 or bf16
  // activations: x and the bias take gradients, the weight none (it is frozen). K = 2n·32 spans blocks of 32.
  for (int variant = 0; variant < 3; ++variant)
    add(variant == 0 ? "quantized_linear" : variant == 1 ? "quantized_linear_bf16_weight" : "quantized_linear_bf16",
        OpKind::QuantizedLinear,
        [variant](GraphBuilder& b, int64_t n) {
          const int64_t N = 5, K = 64 * ((n + 1) / 2);
          ValueId x = b.param("x", {2, n, K});
          if (variant == 2) x = b.cast(x, DType::bf16);
          ValueId q = b.input("q", {N * K / 2}, DType::u8), absmax = b.input("absmax", {N * K / 32});
          ValueId code = b.input("code", {16});
          return Outs{b.graph().add(OpKind::QuantizedLinear, {x, q, absmax, code, b.param("bias", {N})},
                                    {{"rows", N}, {"cols", K}, {"blocksize", int64_t{32}},
                                     {"bf16", int64_t{variant > 0}}})};
        },
        {{"q", {0, 0, 256}}, {"absmax", {0.1, 2}}, {"code", {-1, 1}}, {"x", {-1, 1, 0, 0, 1.0 / 16}}}).eps = 1.0 / 16;
  // An LLM.int8 weight (random int8 codes, one absmax a row; any width), f32 or bf16 activations, with and
  // without a bias.
  for (int variant = 0; variant < 2; ++variant)
    add(variant == 0 ? "quantized_linear_int8" : "quantized_linear_int8_bf16", OpKind::QuantizedLinear,
        [variant](GraphBuilder& b, int64_t n) {
          const int64_t N = 6, K = 40 + n;
          ValueId x = b.param("x", {n, K});
          if (variant == 1) x = b.cast(x, DType::bf16);
          std::vector<ValueId> inputs{x, b.input("q", {N * K}, DType::u8), b.input("absmax", {N})};
          if (variant == 0) inputs.push_back(b.param("bias", {N}));
          return Outs{b.graph().add(OpKind::QuantizedLinear, inputs,
                                    {{"rows", N}, {"cols", K}, {"bits", int64_t{8}}, {"bf16", int64_t{0}}})};
        },
        {{"q", {0, 0, 256}}, {"absmax", {0.5, 4}}, {"x", {-1, 1, 0, 0, 1.0 / 16}}}).eps = 1.0 / 16;
  // DPO's losses over 2P sequences (P chosen, then P rejected); lengths are completion token counts (ipo).
  for (const char* loss_type : {"sigmoid", "hinge", "ipo"})
    add(std::string("preference_loss_") + loss_type, OpKind::PreferenceLoss,
        [loss_type](GraphBuilder& b, int64_t n) {
          ValueId logps = b.param("logps", {2 * n});
          ValueId ref = b.input("ref_logps", {2 * n}), lengths = b.input("lengths", {2 * n});
          return Outs{b.preference_loss(logps, ref, lengths, loss_type, 0.5)};
        },
        {{"logps", {-8, -1}}, {"ref_logps", {-8, -1}}, {"lengths", {1, 9, 0, 0, 1}}});
  // CTC over 6 classes, the last the blank; 3 examples of 6 + n frames with up to 3 labels (a quarter of the slots
  // padding, -100) drawn from the 5 others, so repeats (which need a blank between) occur. The second case gives each
  // example its own frame count (some too short for their target: zero_infinity's zero) and divides by the target
  // lengths.
  add("ctc_loss", OpKind::CtcLoss,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.ctc_loss(b.param("logits", {3, 6 + n, 6}), b.input("labels", {3, 3}, DType::i64), ir::kNone, 5,
                               false, false)};
      },
      {{"logits", {-2, 2}}, {"labels", {0, 0, 5, 0.25}}});
  add("ctc_loss_lengths_per_target", OpKind::CtcLoss,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.ctc_loss(b.param("logits", {3, 6 + n, 6}), b.input("labels", {3, 2}, DType::i64),
                               b.input("lengths", {3}, DType::i64), 5, true, true)};
      },
      {{"logits", {-2, 2}}, {"labels", {0, 0, 5, 0.25}}, {"lengths", {0, 0, 8}}});
  add("sigmoid_cross_entropy", OpKind::SigmoidCrossEntropy,
      [](GraphBuilder& b, int64_t n) {
        return Outs{b.sigmoid_cross_entropy(b.param("logits", {n, 3}), b.param("targets", {n, 3}))};
      },
      {{"logits", {-3, 3}}, {"targets", {0, 1}}});
  add("attention", OpKind::Attention, [](GraphBuilder& b, int64_t n) {
    ValueId q = b.param("q", {2, 2, n, 4}), k = b.param("k", {2, 2, 5, 4}), v = b.param("v", {2, 2, 5, 4});
    return Outs{b.attention(q, k, v, ir::kNone, 0.5)};
  });
  add("attention_mask", OpKind::Attention,
      [](GraphBuilder& b, int64_t n) {
        ValueId q = b.param("q", {2, 2, n, 4}), k = b.param("k", {2, 2, 6, 4}), v = b.param("v", {2, 2, 6, 4});
        return Outs{b.attention(q, k, v, b.input("mask", {2, 6}), 0.5)};
      },
      {{"mask", {0, 0, 0, 0, 0, 0.3}}});
  add("attention_causal", OpKind::Attention, [](GraphBuilder& b, int64_t n) {
    ValueId q = b.param("q", {1, 3, n, 4}), k = b.param("k", {1, 3, n + 2, 4}), v = b.param("v", {1, 3, n + 2, 4});
    return Outs{b.attention(q, k, v, ir::kNone, 0.5, true)};
  });
  add("attention_sliding_window", OpKind::Attention, [](GraphBuilder& b, int64_t n) {
    // Each query sees its 2 newest keys: the window hides keys of every query past the first two.
    ValueId q = b.param("q", {1, 2, n + 2, 4}), k = b.param("k", {1, 2, n + 3, 4}), v = b.param("v", {1, 2, n + 3, 4});
    return Outs{b.attention(q, k, v, ir::kNone, 0.5, true, 0.0, DType::f32, 2)};
  });
  add("attention_packed", OpKind::Attention,
      [](GraphBuilder& b, int64_t n) {
        // Packed examples of 3 tokens (the last one shorter): each query sees only its own example's keys, with a
        // key mask and grouped key/value heads.
        ValueId q = b.param("q", {2, 4, n + 4, 4}), k = b.param("k", {2, 2, n + 4, 4}), v = b.param("v", {2, 2, n + 4, 4});
        ValueId key_begin = b.input("key_begin", {2, n + 4}, DType::i64);
        return Outs{b.attention(q, k, v, b.input("mask", {2, n + 4}), 0.5, true, 0.0, DType::f32, 0, 0.0, key_begin)};
      },
      {{"key_begin", Fill{.segment = 3}}});
  add("attention_seq_major", OpKind::Attention, [](GraphBuilder& b, int64_t n) {
    // (B, T, H, D) operands, causal, with dropout: the layout fold_attention_transposes writes.
    ValueId q = b.param("q", {1, n, 2, 4}), k = b.param("k", {1, n + 2, 2, 4}), v = b.param("v", {1, n + 2, 2, 4});
    Outs outs = b.graph().add_node(
        OpKind::Attention, {q, k, v},
        {{"scale", 0.5}, {"causal", int64_t{1}}, {"dropout_p", 0.2}, {"seed", int64_t{4}}, {"seq_major", int64_t{1}}});
    return Outs{outs[0]};  // lse is not differentiated (the op's own builder exposes only out)
  });
  for (bool seq_major : {false, true})
    add(seq_major ? "attention_grouped_query_seq_major" : "attention_grouped_query", OpKind::Attention,
        [seq_major](GraphBuilder& b, int64_t n) {
          // 6 query heads on 2 key/value heads, causal: dk and dv sum three query heads' contributions.
          auto shape = [&](int64_t len, int64_t heads) {
            return seq_major ? Shape{2, len, heads, 4} : Shape{2, heads, len, 4};
          };
          ValueId q = b.param("q", shape(n, 6)), k = b.param("k", shape(n + 1, 2)), v = b.param("v", shape(n + 1, 2));
          Outs outs = b.graph().add_node(OpKind::Attention, {q, k, v},
                                         {{"scale", 0.5}, {"causal", int64_t{1}}, {"seq_major", int64_t{seq_major}}});
          return Outs{outs[0]};
        });
  for (bool broadcast : {false, true})
    add(broadcast ? "attention_score_bias_broadcast" : "attention_score_bias", OpKind::Attention,
        [broadcast](GraphBuilder& b, int64_t n) {
          // A learned score bias (T5's relative positions), over the batch's keys or broadcast over the batch (its
          // gradient then sums the batch's), with a key mask; causal when broadcast.
          ValueId q = b.param("q", {2, 3, n, 4}), k = b.param("k", {2, 3, n + 2, 4}), v = b.param("v", {2, 3, n + 2, 4});
          ValueId bias = b.param("bias", {broadcast ? 1 : 2, 3, n, n + 2});
          return Outs{b.attention(q, k, v, b.input("mask", {2, n + 2}), 0.5, broadcast, 0.0, DType::f32, 0, 0.0,
                                  ir::kNone, bias)};
        },
        {{"mask", {0, 0, 0, 0, 0, 0.3}}, {"bias", {-2, 2}}});
  add("attention_dropout", OpKind::Attention, [](GraphBuilder& b, int64_t n) {
    ValueId q = b.param("q", {1, 2, n, 8}), k = b.param("k", {1, 2, 4, 8}), v = b.param("v", {1, 2, 4, 8});
    return Outs{b.attention(q, k, v, ir::kNone, 0.35, false, 0.2)};
  });
  add("attention_dropout_query_rows", OpKind::Attention, [](GraphBuilder& b, int64_t n) {
    // Query rows [3, 3 + n) of n + 5 (prune_sliced_rows): the probabilities keep those rows' masks.
    ValueId q = b.param("q", {1, 2, n, 8}), k = b.param("k", {1, 2, 4, 8}), v = b.param("v", {1, 2, 4, 8});
    Outs outs = b.graph().add_node(OpKind::Attention, {q, k, v},
                                   {{"scale", 0.35},
                                    {"causal", int64_t{0}},
                                    {"dropout_p", 0.2},
                                    {"seed", int64_t{6}},
                                    {"rng_rows", n + 5},
                                    {"rng_row_start", int64_t{3}}});
    return Outs{outs[0]};
  });
  // bf16 q, k, v (bf16 mixed precision), in both layouts, with a mask and causal: values on a 1/16
  // grid are exact in bf16, and so are steps of 1/16. With a bf16 output as well, rounding the output
  // swamps central differences, so that case is compared with the reference kernels only.
  for (int variant = 0; variant < 3; ++variant) {
    const bool seq_major = variant > 0, out_bf16 = variant == 2;
    OpCase& bf16 = add(variant == 0 ? "attention_bf16" : variant == 1 ? "attention_bf16_seq_major"
                                                                      : "attention_bf16_seq_major_bf16_out",
                       OpKind::Attention,
                       [seq_major, out_bf16](GraphBuilder& b, int64_t n) {
                         auto operand = [&](const char* name, int64_t len) {
                           Shape shape = seq_major ? Shape{2, len, 2, 4} : Shape{2, 2, len, 4};
                           return b.cast(b.param(name, shape), DType::bf16);
                         };
                         ValueId q = operand("q", n), k = operand("k", n + 2), v = operand("v", n + 2);
                         ir::Attrs attrs{{"scale", 0.5},
                                         {"causal", int64_t{1}},
                                         {"seed", int64_t{4}},
                                         {"seq_major", int64_t{seq_major}}};
                         if (out_bf16) attrs.set("out_dtype", std::string("bf16"));
                         Outs outs = b.graph().add_node(OpKind::Attention, {q, k, v, b.input("mask", {2, n + 2})}, attrs);
                         return Outs{out_bf16 ? b.cast(outs[0], DType::f32) : outs[0]};
                       },
                       {{"q", {-1, 1, 0, 0, 1.0 / 16}},
                        {"k", {-1, 1, 0, 0, 1.0 / 16}},
                        {"v", {-1, 1, 0, 0, 1.0 / 16}},
                        {"mask", {0, 0, 0, 0, 0, 0.3}}});
    bf16.eps = 1.0 / 16;
    bf16.tolerance = 5e-2;
    bf16.gradcheck_reference_kernels = true;  // with AVX512-BF16 the tuned tiles round P and dS to bf16
    if (out_bf16) bf16.max_gradcheck_n = 0;
  }
  return c;
}

}  // namespace

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = make_cases();
  return cases;
}

std::map<std::string, std::vector<double>> random_values(const ir::Graph& graph,
                                                         const std::map<std::string, Fill>& fills, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::map<std::string, std::vector<double>> out;
  for (const ir::Value& v : graph.values()) {
    if (v.kind == ir::ValueKind::Activation) continue;
    auto it = fills.find(v.name);
    Fill f = it == fills.end() ? Fill{} : it->second;
    std::vector<double> data(static_cast<size_t>(v.shape.numel()));
    if (f.segment > 0) {  // each row: the first position of the segment holding t
      const int64_t T = v.shape[-1];
      for (size_t i = 0; i < data.size(); ++i) data[i] = double(int64_t(i) % T - int64_t(i) % T % f.segment);
      out[v.name] = std::move(data);
      continue;
    }
    for (double& x : data) {
      if (!is_floating(v.dtype)) {
        std::uniform_int_distribution<int64_t> pick(0, std::max<int64_t>(f.int_high, 1) - 1);
        x = static_cast<double>(pick(rng));
        if (f.ignore_fraction > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < f.ignore_fraction) x = -100;
      } else {
        x = std::uniform_real_distribution<double>(f.low, f.high)(rng);
        if (f.quantum > 0) x = std::round(x / f.quantum) * f.quantum;
        if (f.mask_fraction > 0)
          x = std::uniform_real_distribution<double>(0, 1)(rng) < f.mask_fraction ? -10000.0 : 0.0;
      }
    }
    out[v.name] = std::move(data);
  }
  return out;
}

}  // namespace fusetrain::testing
