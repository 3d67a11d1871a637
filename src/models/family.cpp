#include "models/family.h"

#include <cmath>
#include <limits>

#include "fusetrain/core/error.h"

namespace fusetrain::models {

using ir::ValueId;

ValueId Family::dense(ir::GraphBuilder& b, ValueId x, const std::string& name, int64_t out, int64_t in) const {
  ValueId weight = b.param(name + ".weight", {out, in});
  ValueId bias = b.param(name + ".bias", {out});
  return project(b, x, weight, bias, matmul_dtype_);
}

ValueId Family::self_attention(ir::GraphBuilder& b, ValueId x, ValueId mask_add, const std::string& q,
                               const std::string& k, const std::string& v, const std::string& out, int64_t B, int64_t T,
                               int64_t C, int64_t H, double dropout_p, const TokenRows& rows) const {
  const int64_t D = C / H;
  // bf16: q, k, v and the context are kept in bf16, as autocast's bf16 projections and attention produce them.
  const DType io = attention_dtype(matmul_dtype_);
  auto heads = [&](const std::string& name) {
    ValueId y = pad(b, dense(b, x, name, C, C), rows, B, T, C);
    return split_heads(b, io == DType::f32 ? y : b.cast(y, io), B, T, H, D);
  };
  ValueId qh = heads(q), kh = heads(k), vh = heads(v);
  ValueId context =
      b.attention(qh, kh, vh, mask_add, 1.0 / std::sqrt(static_cast<double>(D)), false, dropout_p, io);
  return dense(b, unpad(b, merge_heads(b, context, B, T, H, D), rows, C), out, C, C);
}

ValueId Family::named_layer_norm(ir::GraphBuilder& b, ValueId x, const std::string& name, int64_t channels,
                                 double eps) const {
  ValueId weight = b.param(name + ".weight", {channels});
  ValueId bias = b.param(name + ".bias", {channels});
  return b.layer_norm(x, weight, bias, eps);
}

bool ends_with(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void Family::default_position_ids(const int64_t* input_ids, int64_t B, int64_t T, int64_t* out) const {
  (void)input_ids;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) out[b * T + t] = t;
}

// ---- config ----------------------------------------------------------------------------------

int64_t ConfigReader::get_int(const std::string& key) const {
  FT_CHECK(has(key), "config.json: missing required field \"", key, "\"");
  const nlohmann::json& v = config_[key];
  // transformers 5 types every integer field of these configs `int`, and its strict dataclass refuses a JSON float
  // there, 12.0 included. An unsigned value above INT64_MAX is no int64_t (converting it would be undefined
  // behaviour).
  const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}
                                           : v.is_number_integer();
  FT_CHECK(fits, "config.json: \"", key, "\" should be an integer, found ", v.dump(),
           v.is_number_float() ? " (transformers refuses a float for it too)" : "");
  return v.get<int64_t>();
}

int64_t ConfigReader::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double ConfigReader::get_float(const std::string& key, double fallback) const {
  if (!has(key)) return fallback;
  const nlohmann::json& v = config_[key];
  FT_CHECK(v.is_number(), "config.json: \"", key, "\" should be a number, found ", v.dump());
  return v.get<double>();
}

std::string ConfigReader::get_string(const std::string& key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  const nlohmann::json& v = config_[key];
  FT_CHECK(v.is_string(), "config.json: \"", key, "\" should be a string, found ", v.dump());
  return v.get<std::string>();
}

bool ConfigReader::get_bool(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  const nlohmann::json& v = config_[key];
  FT_CHECK(v.is_boolean(), "config.json: \"", key, "\" should be true or false, found ", v.dump());
  return v.get<bool>();
}

int64_t ConfigReader::num_labels() const {
  if (has("id2label")) {
    FT_CHECK(config_["id2label"].is_object(), "config.json: \"id2label\" should be an object");
    return static_cast<int64_t>(config_["id2label"].size());
  }
  return get_int("num_labels", 2);
}

int64_t ConfigReader::positive(const std::string& key) const {
  int64_t v = get_int(key);
  FT_CHECK(v > 0, "config.json: \"", key, "\" must be positive, found ", v);
  return v;
}

void ConfigReader::check_float_field(const std::string& key, const char* expected) const {
  if (!config_.contains(key)) return;
  const nlohmann::json& v = config_[key];
  FT_CHECK(!v.is_null() && !v.is_number_integer(), "config.json: \"", key, "\" is ", v.dump(), ", expected ", expected,
           " written as a float: transformers types it `float` and refuses ", v.is_null() ? "null" : "an integer",
           " for it too");
}

double ConfigReader::epsilon(const std::string& key, double fallback) const {
  check_float_field(key, "a positive number");
  const double v = get_float(key, fallback);
  // Stricter than transformers, which takes 0.0, a negative or a non-finite epsilon without a word: the norm divides
  // by sqrt(variance + eps), so 0 makes NaN of any row of zero variance (Llama's zeroed padding embedding, for one),
  // a negative one NaN wherever the variance is below it, and NaN or infinity NaN or zero everywhere.
  FT_CHECK(v > 0 && std::isfinite(v), "config.json: \"", key, "\" is ", v,
           ", expected a positive number (the epsilon added to the variance in each LayerNorm)");
  return v;
}

double ConfigReader::init_std(const std::string& key, double fallback) const {
  check_float_field(key, "a standard deviation >= 0");
  const double v = get_float(key, fallback);
  FT_CHECK(v >= 0 && std::isfinite(v), "config.json: \"", key, "\" is ", v,
           ", expected a standard deviation >= 0 (of the normal distribution fresh weights are drawn from)");
  return v;
}

double ConfigReader::probability(const std::string& key, double fallback) const {
  const double v = get_float(key, fallback);
  FT_CHECK(v >= 0 && v < 1, "config.json: \"", key, "\" is ", v, ", expected a dropout probability in [0, 1)");
  return v;
}

// ---- graph pieces ----------------------------------------------------------------------------

DType attention_dtype(DType matmul_dtype) { return matmul_dtype == DType::bf16 ? DType::bf16 : DType::f32; }

ValueId project(ir::GraphBuilder& b, ValueId x, ValueId w, ValueId bias, DType matmul_dtype) {
  if (matmul_dtype != DType::f32) {
    if (b.graph().value(x).dtype != matmul_dtype) x = b.cast(x, matmul_dtype);
    w = b.cast(w, matmul_dtype);
  }
  return b.linear(x, w, bias);
}

ValueId project_in_out(ir::GraphBuilder& b, ValueId x, ValueId w, ValueId bias, DType matmul_dtype) {
  if (matmul_dtype != DType::f32) {
    if (b.graph().value(x).dtype != matmul_dtype) x = b.cast(x, matmul_dtype);
    w = b.cast(w, matmul_dtype);
  }
  return b.add(b.matmul(x, w), bias);
}

SequenceInputs sequence_inputs(ir::GraphBuilder& b, int64_t B, int64_t T) {
  SequenceInputs in;
  in.ids = b.input(InputNames::input_ids, {B, T}, DType::i64);
  in.mask = b.input(InputNames::attention_mask, {B, T}, DType::i64);
  in.positions = b.input(InputNames::position_ids, {B, T}, DType::i64);
  return in;
}

TokenRows token_rows(ir::GraphBuilder& b, const BatchSpec& spec) {
  TokenRows rows;
  if (spec.tokens == 0) return rows;
  rows.tokens = b.input(InputNames::token_rows, {spec.tokens}, DType::i64);
  rows.padded = b.input(InputNames::padded_rows, {spec.batch * spec.seq}, DType::i64);
  return rows;
}

// Both directions are row gathers (Embedding on an activation table); each one's backward scatters the gradient
// rows back, and a row read by no kept position (padding, the rounding's spare rows) gets exactly zero.
ValueId unpad(ir::GraphBuilder& b, ValueId x, const TokenRows& rows, int64_t C) {
  if (!rows.unpadded()) return x;
  const Shape& shape = b.graph().value(x).shape;
  return b.embedding(b.reshape(x, {shape.numel() / C, C}), rows.tokens);
}

ValueId pad(ir::GraphBuilder& b, ValueId x, const TokenRows& rows, int64_t B, int64_t T, int64_t C) {
  if (!rows.unpadded()) return x;
  return b.reshape(b.embedding(x, rows.padded), {B, T, C});
}

ValueId packed_key_begin(ir::GraphBuilder& b, const BatchSpec& spec) {
  return spec.packed ? b.input(InputNames::key_begin, {spec.batch, spec.seq}, DType::i64) : ir::kNone;
}

ValueId maybe_dropout(ir::GraphBuilder& b, ValueId x, double p, bool training) {
  return training && p > 0 ? b.dropout(x, p) : x;
}

void check_activation(const std::string& name, const char* field) {
  static const char* kSupported[] = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "tanh"};
  for (const char* s : kSupported)
    if (name == s) return;
  throw Error(str("config.json: \"", field, "\" is \"", name,
                  "\", which fusetrain does not support (supported: gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, "
                  "relu, tanh)"));
}

ValueId activation(ir::GraphBuilder& b, ValueId x, const std::string& name, DType matmul_dtype) {
  const bool tanh_form = name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast";
  if (name == "gelu" || tanh_form) {
    if (matmul_dtype == DType::bf16) x = b.cast(x, DType::bf16);
    return b.gelu(x, tanh_form ? "tanh" : "none");
  }
  if (name == "relu") return b.relu(x);
  if (name == "tanh") return b.tanh(x);
  check_activation(name, "activation");
  return x;
}

ValueId additive_mask(ir::GraphBuilder& b, ValueId mask, int64_t B, int64_t T) {
  ValueId keep = b.cast(mask, DType::f32);
  ValueId dropped = b.sub(b.fill(Shape{B, T}, 1.0), keep);
  return b.scale(dropped, static_cast<double>(std::numeric_limits<float>::lowest()));
}

ValueId split_heads(ir::GraphBuilder& b, ValueId x, int64_t B, int64_t T, int64_t H, int64_t D) {
  return b.transpose(b.reshape(x, {B, T, H, D}), {0, 2, 1, 3});
}

ValueId merge_heads(ir::GraphBuilder& b, ValueId x, int64_t B, int64_t T, int64_t H, int64_t D) {
  return b.reshape(b.transpose(x, {0, 2, 1, 3}), {B, T, H * D});
}

ValueId first_token(ir::GraphBuilder& b, ValueId x, int64_t B, int64_t T, int64_t C, const TokenRows& rows) {
  (void)T;
  if (rows.unpadded()) return b.slice(x, 0, 0, B);
  return b.reshape(b.slice(x, 1, 0, 1), {B, C});
}

namespace {

ValueId sequence_classification_loss(ir::GraphBuilder& b, ValueId logits, const BatchSpec& spec,
                                     const ConfigReader& config, int64_t num_labels) {
  std::string problem = config.get_string("problem_type", "");
  if (problem.empty()) {
    if (num_labels == 1)
      problem = "regression";
    else if (spec.labels == LabelKind::ClassIds)
      problem = "single_label_classification";
    else
      problem = "multi_label_classification";
  }
  if (problem == "regression") {
    FT_CHECK(spec.labels == LabelKind::Values, "regression (num_labels == 1 or problem_type \"regression\") needs ",
             "float labels");
    ValueId labels = b.input(InputNames::labels, {spec.batch, num_labels}, DType::f32);
    ValueId diff = b.sub(logits, labels);
    return b.reduce_mean(b.mul(diff, diff), {0, 1});
  }
  if (problem == "single_label_classification") {
    FT_CHECK(spec.labels == LabelKind::ClassIds, "single-label classification needs integer class labels of shape (",
             spec.batch, ")");
    return b.softmax_cross_entropy(logits, b.input(InputNames::labels, {spec.batch}, DType::i64));
  }
  if (problem == "multi_label_classification") {
    FT_CHECK(spec.labels == LabelKind::Values, "multi-label classification needs float labels of shape (", spec.batch,
             ", ", num_labels, ")");
    return b.sigmoid_cross_entropy(logits, b.input(InputNames::labels, {spec.batch, num_labels}, DType::f32));
  }
  throw Error(str("config.json: \"problem_type\" is \"", problem,
                  "\" (expected regression, single_label_classification or multi_label_classification)"));
}

}  // namespace

void head_outputs(ir::GraphBuilder& b, Head head, HeadLogits logits, const BatchSpec& spec,
                  const ConfigReader& config, BuiltGraph& out) {
  const int64_t B = spec.batch, T = spec.seq;
  const Shape& shape = b.graph().value(logits.logits).shape;
  const bool labelled = spec.labels != LabelKind::None;
  switch (head) {
    case Head::Base:
      out.logits = logits.logits;
      return;
    case Head::SequenceClassification:
      FT_CHECK(shape.rank() == 2 && shape[0] == B, "sequence classification needs logits of shape (batch, labels) = (",
               B, ", L), the model returns ", shape.to_string());
      out.logits = logits.logits;
      if (labelled) out.loss = sequence_classification_loss(b, out.logits, spec, config, shape[1]);
      return;
    case Head::QuestionAnswering: {
      if (logits.end_logits != ir::kNone) {
        for (ValueId v : {logits.logits, logits.end_logits})
          FT_CHECK(b.graph().value(v).shape == Shape({B, T}), "question answering needs start and end logits of shape (",
                   B, ", ", T, "), the model returns ", b.graph().value(v).shape.to_string());
        out.logits = logits.logits;
        out.end_logits = logits.end_logits;
      } else {
        FT_CHECK(shape == Shape({B, T, 2}), "question answering needs start_logits and end_logits, or logits of shape ",
                 "(batch, sequence, 2) = (", B, ", ", T, ", 2); the model returns ", shape.to_string());
        std::vector<ValueId> parts = b.split(logits.logits, -1, {1, 1});
        out.logits = b.reshape(parts[0], {B, T});
        out.end_logits = b.reshape(parts[1], {B, T});
      }
      if (!labelled) return;
      FT_CHECK(spec.labels == LabelKind::Spans, "question answering needs start_positions and end_positions");
      // Positions arrive clamped to [0, T]; T is ignored, as in transformers.
      ValueId start = b.input(InputNames::start_positions, {B}, DType::i64);
      ValueId end = b.input(InputNames::end_positions, {B}, DType::i64);
      ValueId start_loss = b.softmax_cross_entropy(out.logits, start, T);
      ValueId end_loss = b.softmax_cross_entropy(out.end_logits, end, T);
      out.loss = b.scale(b.add(start_loss, end_loss), 0.5);
      return;
    }
    case Head::Seq2SeqLM: {
      // The decoder's logits against unshifted labels (the decoder inputs are the labels shifted right).
      const int64_t target = spec.target_length();
      FT_CHECK(shape.rank() == 3 && shape[0] == B && shape[1] == target, "a sequence-to-sequence head needs logits of ",
               "shape (batch, target sequence, vocabulary) = (", B, ", ", target, ", V), the model returns ",
               shape.to_string());
      out.logits = logits.logits;
      if (!labelled) return;
      FT_CHECK(spec.labels == LabelKind::TokenIds, "a sequence-to-sequence head needs integer token labels of shape (",
               B, ", ", target, ")");
      const ValueId labels = b.input(InputNames::labels, {B, target}, DType::i64);
      out.loss = b.softmax_cross_entropy(out.logits, labels);
      if (spec.token_stats) out.token_stats = b.token_stats(out.logits, labels);
      return;
    }
    case Head::Ctc: {
      // Per-frame logits against label sequences; the frames are the model's (the audio's length through its
      // convolutions), the labels' length the batch's. Reduction and blank as transformers' ...ForCTC: the sum (or
      // the mean of each loss over its target length) of torch's ctc_loss with blank = pad_token_id.
      FT_CHECK(shape.rank() == 3 && shape[0] == B, "a CTC head needs logits of shape (batch, frames, classes) with ",
               "batch ", B, "; the model returns ", shape.to_string());
      out.logits = logits.logits;
      if (!labelled) return;
      FT_CHECK(spec.labels == LabelKind::TokenIds && spec.target_seq > 0, "a CTC head needs integer label ",
               "sequences of shape (batch, L)");
      const std::string reduction = config.get_string("ctc_loss_reduction", "sum");
      FT_CHECK(reduction == "sum" || reduction == "mean", "config.json: \"ctc_loss_reduction\" is \"", reduction,
               "\" (expected sum or mean)");
      const int64_t blank = config.get_int("pad_token_id", 0);
      FT_CHECK(blank >= 0 && blank < shape[2], "config.json: \"pad_token_id\" (the CTC blank) is ", blank,
               ", not one of the ", shape[2], " classes");
      const ValueId labels = b.input(InputNames::labels, {B, spec.target_seq}, DType::i64);
      const ValueId losses = b.ctc_loss(out.logits, labels, ir::kNone, blank,
                                        config.get_bool("ctc_zero_infinity", false), reduction == "mean");
      out.loss = reduction == "sum" ? b.reduce_sum(losses, {0}) : b.reduce_mean(losses, {0});
      return;
    }
    case Head::MaskedLM:
    case Head::CausalLM:
    case Head::TokenClassification:
      FT_CHECK(shape.rank() == 3 && shape[0] == B && shape[1] == T, "this head needs logits of shape (batch, sequence, ",
               "classes) = (", B, ", ", T, ", L), the model returns ", shape.to_string());
      out.logits = logits.logits;
      if (!labelled) return;
      FT_CHECK(spec.labels == LabelKind::TokenIds, "this head needs integer token labels of shape (", B, ", ", T, ")");
      if (spec.preference && head == Head::CausalLM) {
        const ValueId labels = b.input(InputNames::labels, {B, T}, DType::i64);
        std::vector<ValueId> lp = b.token_log_probs(out.logits, labels, spec.token_stats);
        out.sequence_logps = b.reduce_sum(lp[0], {1});
        if (spec.token_stats) out.row_stats = lp[1];
        if (spec.reference) return;
        const ValueId ref = b.input(InputNames::ref_logps, {B});
        const ValueId lengths = b.input(InputNames::completion_lengths, {B});
        out.loss = b.preference_loss(out.sequence_logps, ref, lengths, spec.preference->loss_type,
                                     spec.preference->beta);
        return;
      }
      {
        const ValueId labels = b.input(InputNames::labels, {B, T}, DType::i64);
        out.loss = b.softmax_cross_entropy(out.logits, labels);
        if (spec.token_stats && head != Head::TokenClassification) out.token_stats = b.token_stats(out.logits, labels);
      }
      return;
  }
  throw Error("unknown head");
}

ValueId last_token_logits(ir::GraphBuilder& b, ValueId x, const BatchSpec& spec, int64_t num_labels, int64_t C) {
  ValueId scores = b.linear(x, b.param("score.weight", {num_labels, C}));  // (B, T, L)
  // Gather row b·T + t of the flattened scores: an embedding lookup, whose backward scatters the gradient back to
  // that row.
  ValueId rows = b.reshape(scores, {spec.batch * spec.seq, num_labels});
  return b.embedding(rows, b.input(InputNames::pool_index, {spec.batch}, DType::i64));
}

int64_t last_non_pad(const int64_t* ids, int64_t T, int64_t pad) {
  if (pad < 0) return T - 1;
  int64_t last = 0;
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] != pad) last = t;
  return last;
}

}  // namespace fusetrain::models
