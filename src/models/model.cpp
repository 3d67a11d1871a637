// models::Model: parameter naming and weight decay, and running batches through plans compiled per batch shape.
// Loading and saving (model_load.cpp), LoRA (model_lora.cpp), input validation (model_inputs.cpp) and the weights'
// way to and from the Device (weights.cpp) are units of their own.
#include "fusetrain/models/model.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "models/family.h"
#include "models/lora_graph.h"
#include "models/model_units.h"

namespace fusetrain::models {



Model::~Model() = default;

int64_t Model::max_positions() const { return family_->max_positions(); }

bool Model::uses_token_type_ids() const { return family_->uses_token_type_ids(); }

int64_t max_positions(const nlohmann::json& config) {
  // Positions do not depend on the head: the base model of the config's model_type answers, whatever
  // config["architectures"] names; choose_architecture throws the problem of a config without a known model_type.
  const nlohmann::json model_type = config.is_object() ? config.value("model_type", nlohmann::json()) : nullptr;
  const ArchitectureInfo* base = model_type.is_string() ? find_architecture(model_type.get<std::string>(), Head::Base)
                                                        : nullptr;
  return family_for(choose_architecture(config, base ? base->name : ""), config)->max_positions();
}

bool decayed_by_name(const std::string& name) {
  // transformers' Trainer.get_decay_parameter_names: the lower-cased full name must not match "bias", "layernorm",
  // "rmsnorm", "(^|\.)norm($|\.)" or "_norm($|\.)".
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  for (const char* part : {"bias", "layernorm", "rmsnorm"})
    if (lower.find(part) != std::string::npos) return false;
  for (size_t at = lower.find("norm"); at != std::string::npos; at = lower.find("norm", at + 1)) {
    const size_t end = at + 4;
    const bool ends = end == lower.size() || lower[end] == '.';
    const bool starts = at == 0 || lower[at - 1] == '.' || lower[at - 1] == '_';
    if (ends && starts) return false;
  }
  return true;
}

bool Model::decays(const std::string& name) const {
  if (decayed_) {
    const auto alias = aliases_.find(name);
    return decayed_->count(alias == aliases_.end() ? name : alias->second) > 0;
  }
  return decayed_by_name(name) && !family_->in_layer_norm(name);
}

void Model::set_decayed(const std::set<std::string>& names) {
  std::set<std::string> stored;
  for (const std::string& name : names) {
    const auto alias = aliases_.find(name);
    const std::string& held = alias == aliases_.end() ? name : alias->second;
    FT_CHECK(params_->contains(held), architecture_, ": weight decay was asked for \"", name,
             "\", which is not a trained parameter of the model");
    stored.insert(held);
  }
  decayed_ = std::move(stored);
  for (size_t i = 0; i < params_->slots().size(); ++i) params_->set_weight_decay(i, decays(params_->slots()[i].name));
}

std::vector<std::string> Model::state_dict_names() const {
  std::vector<std::string> names;
  for (const runtime::FrozenSlot& slot : params_->frozen_slots()) names.push_back(slot.name);
  for (const runtime::ParamSlot& slot : params_->slots()) names.push_back(slot.name);
  for (const auto& [alias, stored] : aliases_) names.push_back(alias);
  return names;
}

std::vector<std::string> Model::trainable_names() const {
  std::vector<std::string> names;
  for (const runtime::ParamSlot& slot : params_->slots()) names.push_back(slot.name);
  for (const auto& [alias, stored] : aliases_)
    if (params_->contains(stored)) names.push_back(alias);
  return names;
}

DerivedInputs Model::derived_inputs() const { return family_->derived_inputs(); }

Tensor Model::parameter(const std::string& hf_name) const {
  auto alias = aliases_.find(hf_name);
  const std::string& name = alias == aliases_.end() ? hf_name : alias->second;
  if (lora_ && params_->contains_frozen(name)) return params_->frozen(name);
  return params_->param(name);
}

namespace {

// `view` (the device's memory) for the host to read: itself where the device is host-visible, else a downloaded copy.
Tensor host_readable(const Tensor& view, const kernels::Device& device) {
  if (device.host_visible()) return view;
  Tensor copy = Tensor::zeros(view.shape(), view.dtype());
  device.download(copy.data(), view.data(), view.nbytes());
  return copy;
}

}  // namespace

Tensor Model::host_parameter(const std::string& hf_name) const {
  return host_readable(parameter(hf_name), params_->device());
}

Tensor Model::host_gradient(const std::string& hf_name) const {
  return host_readable(gradient(hf_name), params_->device());
}

Tensor Model::gradient(const std::string& hf_name) const {
  auto alias = aliases_.find(hf_name);
  const std::string& name = alias == aliases_.end() ? hf_name : alias->second;
  FT_CHECK(!params_->contains_frozen(name), "\"", hf_name, "\" is a frozen base weight of this LoRA model: it has no ",
           "gradient");
  return params_->grad(name);
}

BuiltGraph Model::build(const BatchSpec& spec) const {
  BuiltGraph built = family_->build(spec);
  if (lora_) {
    std::vector<ir::ValueId*> watched = {&built.logits, &built.end_logits, &built.hidden_states};
    for (ir::ValueId& v : built.layer_boundaries) watched.push_back(&v);
    lora::apply(built.graph, *lora_, spec.training, lora_bf16_, family_->head_prefixes(), watched,
                /*with_adapters=*/!spec.reference);
  }
  return built;
}

namespace {

// Whether a batch packs several examples in a row, as transformers decides: no attention_mask, and position_ids
// that somewhere do not step by one (find_packed_sequence_indices).
bool packed_rows(const Batch& batch) {
  const Tensor& positions = batch.get(InputNames::position_ids);
  if (batch.has(InputNames::attention_mask) || positions.data() == nullptr || positions.shape().rank() != 2 ||
      positions.dtype() != DType::i64)
    return false;
  const int64_t* p = positions.data_as<int64_t>();
  const int64_t rows = positions.shape()[0], T = positions.shape()[1];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 1; t < T; ++t)
      if (p[r * T + t] != p[r * T + t - 1] + 1) return true;
  return false;
}

// key_begin of packed rows: each token's example starts where the position ids last failed to step by one.
void example_starts(const int64_t* positions, int64_t B, int64_t T, int64_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t > 0 && positions[b * T + t] != positions[b * T + t - 1] + 1) start = t;
      out[b * T + t] = start;
    }
  }
}

// The token rows an unpadded run of this batch computes (BatchSpec::tokens), or 0 when it runs padded. Kept are the
// tokens the attention_mask keeps, and every row's first token, which sequence classification pools whatever the
// mask says; their count is rounded up to a step that keeps the distinct program shapes few (8 to 64 rows, about a
// sixteenth of the padded positions). Unpadding pays for its gathers only when it drops a quarter of the positions,
// and a row the mask hides entirely (attention spreads evenly over its padding, whose keys unpadding does not keep)
// or a mask of other values than 0 and 1 runs padded.
int64_t unpadded_tokens(const Batch& batch, int64_t B, int64_t T) {
  const Tensor& mask = batch.get(InputNames::attention_mask);
  if (mask.data() == nullptr || mask.dtype() != DType::i64 || mask.shape() != Shape({B, T})) return 0;
  const int64_t* m = mask.data_as<int64_t>();
  int64_t kept = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t row = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v = m[b * T + t];
      if (v != 0 && v != 1) return 0;
      row += v;
    }
    if (row == 0) return 0;
    kept += row + (m[b * T] == 0);
  }
  const int64_t step = std::clamp<int64_t>(static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(B * T / 16))),
                                           8, 64);
  const int64_t tokens = (kept + step - 1) / step * step;
  return 4 * tokens <= 3 * B * T ? tokens : 0;
}

// An unpadded run's row maps (InputNames::token_rows, padded_rows): the first token of every row first, then the
// other kept tokens row by row; the rounding's spare rows and every padded position read row 0.
void fill_token_rows(const int64_t* mask, int64_t B, int64_t T, int64_t tokens, int64_t* token_rows,
                     int64_t* padded_rows) {
  std::fill(padded_rows, padded_rows + B * T, int64_t{0});
  int64_t n = 0;
  for (int64_t b = 0; b < B; ++b) {
    token_rows[n] = b * T;
    padded_rows[b * T] = n++;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 1; t < T; ++t)
      if (mask[b * T + t] != 0) {
        token_rows[n] = b * T + t;
        padded_rows[b * T + t] = n++;
      }
  FT_CHECK(n <= tokens, "unpadded batch: ", n, " kept tokens exceed the ", tokens, " token rows planned");
  std::fill(token_rows + n, token_rows + tokens, int64_t{0});
}

}  // namespace

BatchSpec Model::spec_for(const Batch& batch, bool training, bool with_backward) const {
  BatchSpec spec;
  spec.batch = 0;
  for (const InputDecl& input : inputs_) {
    const Tensor& t = batch.get(input.name);
    if (t.data() == nullptr) continue;
    spec.shapes.emplace_back(input.name, t.shape());
    spec.batch = t.shape()[0];
    if (input.seq_axis >= 0) (input.target ? spec.target_seq : spec.seq) = t.shape()[input.seq_axis];
  }
  // A CTC head's labels are sequences of their own length: the target axis.
  if (family_->head() == Head::Ctc && batch.get(InputNames::labels).shape().rank() == 2)
    spec.target_seq = batch.get(InputNames::labels).shape()[1];
  spec.packed = packed_rows(batch) && (family_->packs_sequences() || family_->head() == Head::CausalLM);
  FT_CHECK(!spec.packed || family_->packs_sequences(), architecture_, ": position_ids restart inside a row and no ",
           "attention_mask is given, so the rows pack several examples; this model cannot keep them apart (the ",
           "GPT-2, Llama, Mistral and Qwen2 families can). Give an attention_mask, or one example per row");
  if (unpad_ && family_->unpads() && !spec.packed && !preference_)
    spec.tokens = unpadded_tokens(batch, spec.batch, spec.seq);
  spec.training = training;
  spec.bf16 = bf16_;
  spec.fp16 = fp16_;
  spec.recompute = recompute_ && with_backward;
  spec.fusions = fusions_;
  const Tensor& labels = batch.get(InputNames::labels);
  if (batch.has(InputNames::start_positions) || batch.has(InputNames::end_positions))
    spec.labels = LabelKind::Spans;
  else if (labels.data() != nullptr) {
    if (labels.dtype() == DType::f32)
      spec.labels = LabelKind::Values;
    else
      spec.labels = labels.shape().rank() == 2 ? LabelKind::TokenIds : LabelKind::ClassIds;
  }
  spec.token_stats = token_stats_ && spec.labels == LabelKind::TokenIds &&
                     (family_->head() == Head::CausalLM || family_->head() == Head::MaskedLM);
  if (preference_ && spec.labels != LabelKind::None) {
    FT_CHECK(family_->head() == Head::CausalLM && spec.labels == LabelKind::TokenIds, architecture_,
             ": a preference loss needs a causal LM and (batch, sequence) token labels");
    FT_CHECK(!spec.packed, "a preference batch cannot pack sequences (position_ids restart inside a row): give "
             "one sequence per row with an attention_mask");
    FT_CHECK(!imported_from_onnx(), architecture_, ": a preference loss needs a causal LM fusetrain builds (an "
             "imported graph computes its own logits only)");
    spec.preference = preference_;
  }
  return spec;
}

compile::Program& Model::plan_for(const BatchSpec& spec, bool with_backward) {
  // Everything that decides the graph or how it is compiled: the shapes of the inputs the batch must give (an
  // optional input shares their batch and sequence axes, and one left out is filled with its default, so the
  // same program serves a batch with or without it), then the settings.
  compile::ProgramCache::Key key;
  for (const auto& given : spec.shapes) {
    const std::string& name = given.first;
    const Shape& shape = given.second;
    const auto input = std::find_if(inputs_.begin(), inputs_.end(), [&](const InputDecl& d) { return d.name == name; });
    // An optional float input (SpecAugment's masks) changes the graph when given: its shape is part of the key.
    if (input->source != InputSource::Batch && input->dtype != DType::f32) continue;
    key.push_back(input->source == InputSource::Batch ? 0 : 1 + (input - inputs_.begin()));
    key.push_back(shape.rank());
    key.insert(key.end(), shape.dims().begin(), shape.dims().end());
  }
  for (int64_t setting : {int64_t{spec.training}, int64_t{spec.bf16}, int64_t{spec.fp16}, int64_t{spec.recompute},
                          int64_t{spec.fusions}, static_cast<int64_t>(spec.labels), int64_t{with_backward},
                          int64_t{count_unfused_ops_}, int64_t{spec.packed}, int64_t{spec.token_stats},
                          int64_t{spec.preference.has_value()}, int64_t{spec.reference}, spec.tokens,
                          spec.target_seq})
    key.push_back(setting);
  if (spec.preference) {
    key.push_back(static_cast<int64_t>(std::hash<std::string>{}(spec.preference->loss_type)));
    int64_t beta_bits = 0;
    std::memcpy(&beta_bits, &spec.preference->beta, sizeof(beta_bits));
    key.push_back(beta_bits);
  }
  if (compile::Program* program = programs_.find(key)) return *program;
  BuiltGraph built = build(spec);
  FT_CHECK(!with_backward || built.loss != ir::kNone, architecture_, ": gradients need labels (no loss without them)");
  compile::GraphRoles roles;
  roles.loss = built.loss;
  // A preference program returns sequence log-probabilities, never the logits (they are formed in chunks only).
  if (!spec.preference)
    for (ir::ValueId v : {built.logits, built.end_logits})
      if (v != ir::kNone) roles.outputs.push_back(v);
  roles.layer_boundaries = built.layer_boundaries;
  if (built.token_stats != ir::kNone) roles.metrics.push_back(built.token_stats);
  for (ir::ValueId v : {built.sequence_logps, built.row_stats})  // metrics 0 and 1 of a preference program
    if (v != ir::kNone) roles.metrics.push_back(v);
  compile::CompileOptions options;
  options.backward = with_backward;
  options.fusions = spec.fusions;
  options.loss_scale_input = spec.fp16 && with_backward;
  options.recompute = spec.recompute;
  options.count_unfused_ops = count_unfused_ops_;
  options.plan.num_threads = num_threads_;
  options.plan.shared_arena = arena_;
  compile::Program& program =
      programs_.insert(key, compile::compile(std::move(built.graph), std::move(roles), *params_, options));
  // Defaults for inputs the caller may leave out: all-ones mask, zero token types.
  if (program.plan->has_input(InputNames::attention_mask)) {
    Tensor mask = program.plan->staging(InputNames::attention_mask);
    std::fill(mask.data_as<int64_t>(), mask.data_as<int64_t>() + mask.numel(), int64_t{1});
    program.plan->upload_staging(InputNames::attention_mask);
  }
  return program;
}


namespace {

// A preference run's per-sequence figures: its sequence log-probabilities (metric 0), the reference's (input), and
// over the positions with a (shifted) label, their count and the sums of the row statistics (metric 1).
PreferenceStats preference_stats(runtime::Plan& plan, const std::vector<ir::ValueId>& metrics, const BatchSpec& spec,
                                 const Tensor& shifted) {
  const int64_t B = spec.batch, T = spec.seq;
  PreferenceStats s;
  const Tensor logps = plan.read_output(metrics[0]);
  const int64_t* labels = shifted.data_as<int64_t>();
  const float* rows = metrics.size() > 1 ? plan.read_output(metrics[1]).data_as<float>() : nullptr;
  const float* ref = spec.reference ? nullptr : plan.staging(InputNames::ref_logps).data_as<float>();
  for (int64_t b = 0; b < B; ++b) {
    s.logps.push_back(logps.item(b));
    if (ref) s.ref_logps.push_back(ref[b]);
    double tokens = 0, entropy = 0, top1 = 0, mean_logit = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (labels[b * T + t] == -100) continue;
      tokens += 1;
      if (!rows) continue;
      const float* r = rows + (b * T + t) * 3;
      entropy += r[0];
      top1 += r[1];
      mean_logit += r[2];
    }
    s.tokens.push_back(tokens);
    if (rows) {
      s.entropy_sum.push_back(entropy);
      s.top1.push_back(top1);
      s.mean_logit_sum.push_back(mean_logit);
    }
  }
  return s;
}

}  // namespace

ModelOutput Model::run(const Batch& batch, bool training, bool with_backward, bool zero_grads,
                       runtime::RunObserver* observer, bool reference) {
  check_inputs(batch);
  const Family* family = family_.get();
  BatchSpec spec = spec_for(batch, training, with_backward);
  if (reference) {
    FT_CHECK(family->head() == Head::CausalLM && spec.labels == LabelKind::TokenIds && !spec.packed,
             architecture_, ": sequence log-probabilities need a causal LM, (batch, sequence) token labels and one "
             "sequence per row");
    FT_CHECK(!lora_ || lora_->modules_to_save.empty(), architecture_, ": the reference (the base without its ",
             "adapters) is not kept for modules_to_save, which train in full; give a reference model or precomputed "
             "reference log-probabilities");
    if (!spec.preference) spec.preference = PreferenceConfig{};
    spec.reference = true;
    spec.token_stats = false;
  }
  const int64_t B = spec.batch, T = spec.seq;
  last_token_rows_ = spec.tokens > 0 ? spec.tokens : B * T;
  compile::Program& program = plan_for(spec, with_backward);
  runtime::Plan& plan = *program.plan;
  const ir::ValueId logits = program.roles.outputs.empty() ? ir::kNone : program.roles.outputs[0];
  const Tensor& ids = batch.get(InputNames::input_ids);
  const int64_t* id_data = ids.data() != nullptr ? ids.data_as<int64_t>() : nullptr;

  if (family->binds_inputs()) {
    family->bind_inputs(plan, batch, spec);
  } else {
    for (const InputDecl& input : inputs_) {
      if (input.name == InputNames::position_ids) continue;
      const Tensor& t = batch.get(input.name);
      plan.upload_input(input.name.c_str(), t.data());  // null: the plan's buffer keeps the default
    }
    std::vector<int64_t> default_positions;
    const Tensor& given_positions = batch.get(InputNames::position_ids);
    const int64_t* positions = given_positions.data() != nullptr ? given_positions.data_as<int64_t>() : nullptr;
    if (positions == nullptr) {
      default_positions.resize(static_cast<size_t>(B * T));
      family->default_position_ids(id_data, B, T, default_positions.data());
      positions = default_positions.data();
    }
    if (plan.has_input(InputNames::position_ids)) {
      std::copy(positions, positions + B * T, plan.staging(InputNames::position_ids).data_as<int64_t>());
      plan.upload_staging(InputNames::position_ids);
    }
    if (spec.packed) {
      example_starts(positions, B, T, plan.staging(InputNames::key_begin).data_as<int64_t>());
      plan.upload_staging(InputNames::key_begin);
    }
    family->bind_extra_inputs(plan, positions, B, T);
  }
  if (spec.tokens > 0) {
    fill_token_rows(batch.get(InputNames::attention_mask).data_as<int64_t>(), B, T, spec.tokens,
                    plan.staging(InputNames::token_rows).data_as<int64_t>(),
                    plan.staging(InputNames::padded_rows).data_as<int64_t>());
    plan.upload_staging(InputNames::token_rows);
    plan.upload_staging(InputNames::padded_rows);
  }
  if (family->reads_pool_index()) {
    int64_t* rows = plan.staging(InputNames::pool_index).data_as<int64_t>();
    for (int64_t b = 0; b < B; ++b) rows[b] = b * T + family->pool_position(id_data + b * T, T);
    plan.upload_staging(InputNames::pool_index);
  }

  const Tensor& labels = batch.get(InputNames::labels);
  // Integer labels must name a class of the logits (or be -100, ignored).
  auto check_classes = [&](const Tensor& labels) {
    const int64_t classes = logits != ir::kNone ? plan.graph().value(logits).shape[-1]
                                                : ConfigReader(config_).get_int("vocab_size");
    const int64_t* l = labels.data_as<int64_t>();
    for (int64_t i = 0; i < labels.numel(); ++i)
      FT_CHECK(l[i] == -100 || (l[i] >= 0 && l[i] < classes), "labels: value ", l[i], " at position ", i,
               " is outside [0, ", classes, ") (the model has ", classes, " classes; -100 marks ignored positions)");
  };
  switch (spec.labels) {
    case LabelKind::None:
      break;
    case LabelKind::TokenIds: {
      if (family->head() == Head::Ctc) {  // label sequences of any length, -100 padding
        FT_CHECK(labels.dtype() == DType::i64 && labels.shape() == Shape({B, spec.target_seq}), "labels have shape ",
                 labels.shape().to_string(), " (", dtype_name(labels.dtype()), "); a CTC model's labels are int64 ",
                 "(batch, label length), padded with -100");
        check_classes(labels);
        plan.upload_input(InputNames::labels, labels.data());
        break;
      }
      FT_CHECK(std::any_of(inputs_.begin(), inputs_.end(), [](const InputDecl& d) { return d.seq_axis >= 0; }),
               "labels have shape ", labels.shape().to_string(), "; ", architecture_,
               " reads no sequence, so its labels are one class per example, of shape (", B, ")");
      if (family->head() == Head::Seq2SeqLM)
        FT_CHECK(labels.dtype() == DType::i64 && labels.shape() == Shape({B, spec.target_length()}), "labels have shape ",
                 labels.shape().to_string(), " (", dtype_name(labels.dtype()), "); a sequence-to-sequence model's ",
                 "labels are int64 (batch, target sequence) like decoder_input_ids: (", B, ", ", spec.target_length(), ")");
      else
        require_ids(labels, "labels", B, T);
      check_classes(labels);
      if (family->head() == Head::CausalLM) {
        // Shift left: position t predicts token t + 1; the last position is ignored, and in packed rows the last
        // of each example (it would predict the next example's first token).
        int64_t* shifted = plan.staging(InputNames::labels).data_as<int64_t>();
        const int64_t* given = labels.data_as<int64_t>();
        const int64_t* starts = spec.packed ? plan.staging(InputNames::key_begin).data_as<int64_t>() : nullptr;
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t t = 0; t + 1 < T; ++t)
            shifted[b * T + t] = starts && starts[b * T + t + 1] == t + 1 ? -100 : given[b * T + t + 1];
          shifted[b * T + T - 1] = -100;
        }
        plan.upload_staging(InputNames::labels);
      } else {
        plan.upload_input(InputNames::labels, labels.data());
      }
      break;
    }
    case LabelKind::ClassIds:
      FT_CHECK(labels.dtype() == DType::i64 && labels.shape() == Shape({B}), "labels have shape ",
               labels.shape().to_string(), "; class labels must be int64 of shape (", B, ")");
      check_classes(labels);
      plan.upload_input(InputNames::labels, labels.data());
      break;
    case LabelKind::Values: {
      Tensor dest = plan.input(InputNames::labels);
      FT_CHECK(labels.numel() == dest.numel(), "float labels have shape ", labels.shape().to_string(),
               ", expected ", dest.shape().to_string());
      plan.upload_input(InputNames::labels, labels.data());
      break;
    }
    case LabelKind::Spans: {
      FT_CHECK(batch.has(InputNames::start_positions) && batch.has(InputNames::end_positions),
               "question answering needs both start_positions and end_positions");
      for (auto [name, t] : {std::pair{InputNames::start_positions, &batch.get(InputNames::start_positions)},
                             std::pair{InputNames::end_positions, &batch.get(InputNames::end_positions)}}) {
        FT_CHECK(t->dtype() == DType::i64 && t->shape() == Shape({B}), name, " must be int64 of shape (", B, ")");
        int64_t* dest = plan.staging(name).data_as<int64_t>();
        for (int64_t b = 0; b < B; ++b) dest[b] = std::clamp<int64_t>(t->data_as<int64_t>()[b], 0, T);
        plan.upload_staging(name);
      }
      break;
    }
  }

  if (spec.preference && !spec.reference) {
    // Completion lengths (TRL counts the completion mask, before the shift) and the reference log-probabilities.
    const int64_t* given = labels.data_as<int64_t>();
    float* lengths = plan.staging(InputNames::completion_lengths).data_as<float>();
    for (int64_t b = 0; b < B; ++b)
      lengths[b] = static_cast<float>(std::count_if(given + b * T, given + (b + 1) * T, [](int64_t l) { return l != -100; }));
    plan.upload_staging(InputNames::completion_lengths);
    float* ref = plan.staging(InputNames::ref_logps).data_as<float>();
    const Tensor& given_ref = batch.get(InputNames::ref_logps);
    if (given_ref.data() != nullptr) {
      FT_CHECK(given_ref.dtype() == DType::f32 && given_ref.numel() == B, "ref_logps must be float32 of shape (", B,
               ",): one reference log-probability per sequence; found ", element_type_name(given_ref.dtype()), " ",
               given_ref.shape().to_string());
      const float* r = given_ref.data_as<float>();
      for (int64_t b = 0; b < B; ++b)
        FT_CHECK(std::isfinite(r[b]), "ref_logps: value ", r[b], " at sequence ", b, " is not finite");
      std::copy(r, r + B, ref);
    } else {
      reference_log_probs(batch, ref);
    }
    plan.upload_staging(InputNames::ref_logps);
  }
  if (spec.fp16 && with_backward) {
    *plan.staging(compile::kLossScaleInput).data_as<float>() = static_cast<float>(loss_scale_);
    plan.upload_staging(compile::kLossScaleInput);
  }
  if (zero_grads) params_->zero_grads();
  if (training) plan.set_step((dropout_seed_ << 32) + rng_step_++);
  plan.run(observer);
  last_plan_ = &plan;
  last_pass_log_ = &program.log;
  ModelOutput out;
  if (!with_backward && logits != ir::kNone) {
    out.logits = plan.read_output(logits);
    if (program.roles.outputs.size() > 1) out.end_logits = plan.read_output(program.roles.outputs[1]);
  }
  if (program.roles.loss != ir::kNone) out.loss = plan.read_output(program.roles.loss).item();
  if (spec.preference) {
    out.preference = preference_stats(plan, program.roles.metrics, spec, plan.staging(InputNames::labels));
    if (!reference) last_preference_stats_ = out.preference;
    last_token_stats_.reset();
    return out;
  }
  if (!program.roles.metrics.empty()) {
    const Tensor stats = plan.read_output(program.roles.metrics[0]);
    out.token_stats = TokenStats{stats.item(0), stats.item(1), stats.item(2)};
  }
  last_token_stats_ = out.token_stats;
  return out;
}

ModelOutput Model::forward(const Batch& batch, bool training) { return run(batch, training, false, false); }

std::vector<double> Model::sequence_log_probs(const Batch& batch) {
  return run(batch, /*training=*/false, false, false, nullptr, /*reference=*/true).preference->logps;
}

void Model::reference_log_probs(const Batch& batch, float* out) {
  std::vector<double> logps;
  if (reference_ != nullptr)
    logps = reference_->sequence_log_probs(batch);
  else if (lora_)
    logps = sequence_log_probs(batch);  // the base: the same weights without the adapters
  else
    throw Error(str(architecture_, ": a preference loss compares against reference log-probabilities: give them "
                    "(ref_logps), a reference model, or train LoRA adapters (the reference is then the base)"));
  for (size_t i = 0; i < logps.size(); ++i) out[i] = static_cast<float>(logps[i]);
}

double Model::loss_and_grads(const Batch& batch, bool training) { return *run(batch, training, true, true).loss; }

double Model::accumulate_grads(const Batch& batch, bool training, runtime::RunObserver* observer) {
  return *run(batch, training, true, false, observer).loss;
}

}  // namespace fusetrain::models
