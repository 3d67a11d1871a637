// models::Model: loading, saving, parameter naming, and running batches through
// plans compiled per batch shape.
#include "fusetrain/models/model.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/autodiff/backward.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/passes/fusion.h"
#include "fusetrain/passes/recompute.h"
#include "models/family.h"

namespace fusetrain::models {

namespace {

// The family of a registry row, built from a config.
std::unique_ptr<Family> family_for(const ArchitectureInfo& info, const nlohmann::json& config) {
  return info.make_family(info.head, config);
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Copies `src` into f32 storage; `where` names the tensor (and its file) when a value is inf or NaN, which no
// weight may hold.
void copy_converted(float* dst, const Tensor& src, const std::string& where) {
  const int64_t bad = find_nonfinite(src.data(), src.dtype(), src.numel());
  FT_CHECK(bad < 0, where, " holds a non-finite value at element ", bad,
           "; a model with inf or NaN weights cannot be trained or evaluated (was it saved from a diverged run?)");
  switch (src.dtype()) {
    case DType::f32:
      std::memcpy(dst, src.data(), src.nbytes());
      return;
    case DType::bf16:
      bf16_to_float(dst, static_cast<const uint16_t*>(src.data()), static_cast<size_t>(src.numel()));
      return;
    case DType::f16:
      f16_to_float(dst, static_cast<const uint16_t*>(src.data()), static_cast<size_t>(src.numel()));
      return;
    default:
      throw Error(str("expected a floating-point tensor, found ", dtype_name(src.dtype())));
  }
}

}  // namespace

// A compiled plan for one batch spec, with where its outputs live.
struct Model::Entry {
  BatchSpec spec;
  bool with_backward = false;
  BuiltGraph built;
  std::unique_ptr<runtime::Plan> plan;
  PassLog passes;
};

Model::~Model() = default;

namespace {

// Fills every parameter as the architecture initialises it, from one seeded stream.
void initialise(runtime::ParameterStore& params, const Family& family, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < params.slots().size(); ++i) {
    const runtime::ParamSlot& slot = params.slots()[i];
    float* p = params.param(i).data_as<float>();
    ParamInit init = family.init(slot.name);
    switch (init.kind) {
      case Init::Zeros:
        std::fill(p, p + slot.numel, 0.0f);
        break;
      case Init::Ones:
        std::fill(p, p + slot.numel, 1.0f);
        break;
      case Init::Normal: {
        std::normal_distribution<float> normal(0.0f, static_cast<float>(init.stddev));
        for (int64_t k = 0; k < slot.numel; ++k) p[k] = normal(rng);
        if (init.zero_row >= 0 && slot.shape.rank() == 2 && init.zero_row < slot.shape[0])
          std::fill(p + init.zero_row * slot.shape[1], p + (init.zero_row + 1) * slot.shape[1], 0.0f);
        break;
      }
    }
  }
}

std::unique_ptr<runtime::ParameterStore> layout_parameters(const Family& family) {
  BatchSpec probe;
  BuiltGraph built = family.build(probe);
  return std::make_unique<runtime::ParameterStore>(built.graph);
}

}  // namespace

std::unique_ptr<Model> Model::from_config(const nlohmann::json& config_or_path, uint64_t seed,
                                          const std::string& architecture) {
  nlohmann::json config =
      config_or_path.is_string() ? io::read_json_file(config_or_path.get<std::string>()) : config_or_path;
  std::unique_ptr<Model> m(new Model());
  const ArchitectureInfo& info = choose_architecture(config, architecture);
  m->architecture_info_ = &info;
  m->architecture_ = info.name;
  m->model_type_ = info.model_type;
  m->config_ = config;
  m->config_["architectures"] = nlohmann::json::array({m->architecture_});
  m->family_ = family_for(info, m->config_);
  m->params_ = layout_parameters(*m->family_);
  m->aliases_ = m->family_->tied();
  initialise(*m->params_, *m->family_, seed);
  return m;
}

std::unique_ptr<Model> Model::from_pretrained(const std::string& dir, const std::string& architecture,
                                              const nlohmann::json& config_overrides, uint64_t init_seed) {
  return from_pretrained(io::read_hf_dir(dir), architecture, config_overrides, init_seed);
}

std::unique_ptr<Model> Model::from_pretrained(const io::HfModelDir& hf, const std::string& architecture,
                                              const nlohmann::json& config_overrides, uint64_t init_seed) {
  const std::string& dir = hf.path;
  nlohmann::json config = hf.config;
  FT_CHECK(config_overrides.is_object(), "config overrides must be a JSON object");
  for (auto it = config_overrides.begin(); it != config_overrides.end(); ++it) config[it.key()] = it.value();
  if (config_overrides.contains("num_labels"))  // the checkpoint's label names no longer apply, unless given anew
    for (const char* key : {"id2label", "label2id"})
      if (!config_overrides.contains(key)) config.erase(key);
  std::unique_ptr<Model> m = from_config(config, init_seed, architecture);
  const Family* family = m->family_.get();
  const std::string prefix = family->base_prefix() + ".";
  const bool head_model = family->head() != Head::Base;
  runtime::ParameterStore& params = *m->params_;

  auto known = [&](const std::string& name) { return params.contains(name) || m->aliases_.count(name) > 0; };
  auto droppable = [&](const std::string& name) {
    std::string local = starts_with(name, prefix) ? name.substr(prefix.size()) : name;
    for (const std::string& head : family->head_prefixes())
      if (starts_with(name, head) || starts_with(local, head)) return true;
    // Buffers older checkpoints carry.
    for (const char* buffer : {"position_ids", "attn.bias", "attn.masked_bias", "token_type_ids"})
      if (local.size() >= std::strlen(buffer) &&
          local.compare(local.size() - std::strlen(buffer), std::strlen(buffer), buffer) == 0)
        return true;
    return false;
  };

  std::set<std::string> loaded;
  std::vector<std::string> unexpected;
  std::string file_of_first_problem;
  for (const std::string& name : hf.tensor_names()) {
    std::string target;
    if (known(name))
      target = name;
    else if (head_model && known(prefix + name))
      target = prefix + name;
    else if (!head_model && starts_with(name, prefix) && known(name.substr(prefix.size())))
      target = name.substr(prefix.size());
    if (target.empty()) {
      if (!droppable(name)) unexpected.push_back(name);
      continue;
    }
    auto alias = m->aliases_.find(target);
    if (alias != m->aliases_.end()) {
      if (hf.tensor_file.count(alias->second) ||
          hf.tensor_file.count(alias->second.substr(starts_with(alias->second, prefix) ? prefix.size() : 0)))
        continue;  // a tied duplicate of a tensor the checkpoint also holds
      target = alias->second;
    }
    Tensor source = hf.tensor(name);
    Tensor dest = params.param(target);
    const std::string& file = hf.files[hf.tensor_file.at(name)].path();
    FT_CHECK(source.shape() == dest.shape(), file, ": tensor \"", name, "\" has shape ", source.shape().to_string(),
             " but the config (", m->architecture_, ") expects ", dest.shape().to_string());
    FT_CHECK(is_floating(source.dtype()), file, ": tensor \"", name, "\" is ", dtype_name(source.dtype()),
             "; weights must be F32, BF16 or F16");
    copy_converted(dest.data_as<float>(), source, str(file, ": tensor \"", name, "\""));
    loaded.insert(target);
  }
  std::vector<std::string> missing_required;
  for (const runtime::ParamSlot& slot : params.slots()) {
    if (loaded.count(slot.name)) continue;
    bool head_parameter =
        (head_model && !starts_with(slot.name, prefix)) || slot.name.find("pooler.") != std::string::npos;
    if (head_parameter)
      m->missing_keys_.push_back(slot.name);
    else
      missing_required.push_back(slot.name);
  }
  if (!unexpected.empty() || !missing_required.empty()) {
    std::string msg = str(dir, ": the weights do not match ", m->architecture_, " with this config.json");
    if (!missing_required.empty()) msg += str("; missing tensors: ", join(missing_required));
    if (!unexpected.empty()) msg += str("; unexpected tensors: ", join(unexpected));
    throw Error(msg);
  }
  return m;
}

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

bool Model::decays(const std::string& name) const {
  if (name.find("bias") != std::string::npos) return false;
  for (const char* norm : {"LayerNorm", "layer_norm", "ln_1.", "ln_2.", "ln_f."})
    if (name.find(norm) != std::string::npos) return false;
  return true;
}

std::vector<std::string> Model::state_dict_names() const {
  std::vector<std::string> names;
  for (const runtime::ParamSlot& slot : params_->slots()) names.push_back(slot.name);
  for (const auto& [alias, stored] : aliases_) names.push_back(alias);
  return names;
}

Tensor Model::parameter(const std::string& hf_name) const {
  auto alias = aliases_.find(hf_name);
  return params_->param(alias == aliases_.end() ? hf_name : alias->second);
}

Tensor Model::gradient(const std::string& hf_name) const {
  auto alias = aliases_.find(hf_name);
  return params_->grad(alias == aliases_.end() ? hf_name : alias->second);
}

void Model::load_state_dict(const std::map<std::string, Tensor>& tensors, bool strict) {
  std::vector<std::string> unexpected, missing;
  std::set<std::string> seen;
  for (const auto& [name, tensor] : tensors) {
    if (!params_->contains(name) && !aliases_.count(name)) {
      unexpected.push_back(name);
      continue;
    }
    Tensor dest = parameter(name);
    FT_CHECK(tensor.shape() == dest.shape(), "load_state_dict: \"", name, "\" has shape ", tensor.shape().to_string(),
             " but the model expects ", dest.shape().to_string());
    copy_converted(dest.data_as<float>(), tensor, str("tensor \"", name, "\""));
    seen.insert(aliases_.count(name) ? aliases_.at(name) : name);
  }
  for (const runtime::ParamSlot& slot : params_->slots())
    if (!seen.count(slot.name)) missing.push_back(slot.name);
  if (strict && (!unexpected.empty() || !missing.empty()))
    throw Error(str("load_state_dict: ", missing.empty() ? "" : "missing keys: " + join(missing),
                    !missing.empty() && !unexpected.empty() ? "; " : "",
                    unexpected.empty() ? "" : "unexpected keys: " + join(unexpected)));
}

void Model::save_pretrained(const std::string& dir) const {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < params_->slots().size(); ++i)
    tensors.emplace_back(params_->slots()[i].name, params_->param(i));
  nlohmann::json config = config_;
  config["architectures"] = nlohmann::json::array({architecture_});
  if (!config.contains("torch_dtype")) config["torch_dtype"] = "float32";
  io::write_hf_dir(dir, config, tensors);
}

namespace {

// fp16 training plans: the scalar backward starts from (the loss scale).
constexpr const char* kLossScaleInput = "loss_scale";

std::map<std::string, int> op_counts(const ir::Graph& g) {
  std::map<std::string, int> counts;
  for (const ir::Node& n : g.nodes()) ++counts[ir::op_name(n.op)];
  return counts;
}

}  // namespace

BuiltGraph Model::build(const BatchSpec& spec) const { return family_->build(spec); }

Model::Entry& Model::plan_for(const Batch& batch, bool training, bool with_backward) {
  BatchSpec spec;
  spec.batch = batch.input_ids.shape()[0];
  spec.seq = batch.input_ids.shape()[1];
  spec.training = training;
  spec.bf16 = bf16_;
  spec.fp16 = fp16_;
  spec.recompute = recompute_ && with_backward;
  spec.fusions = fusions_;
  if (batch.start_positions.defined() || batch.end_positions.defined())
    spec.labels = LabelKind::Spans;
  else if (batch.labels.defined() && batch.labels.data() != nullptr) {
    if (batch.labels.dtype() == DType::f32)
      spec.labels = LabelKind::Values;
    else
      spec.labels = batch.labels.shape().rank() == 2 ? LabelKind::TokenIds : LabelKind::ClassIds;
  }
  for (const std::unique_ptr<Entry>& e : plans_)
    if (e->spec == spec && e->with_backward == with_backward) return *e;
  auto entry = std::make_unique<Entry>();
  entry->spec = spec;
  entry->with_backward = with_backward;
  entry->built = build(spec);
  ir::Graph& g = entry->built.graph;
  // Training plans return only the loss: unpinned, the vocabulary-sized logits of a language-model head can be
  // overwritten by their own gradient.
  for (ir::ValueId v : {entry->built.logits, entry->built.end_logits, entry->built.loss})
    if (v != ir::kNone && (!with_backward || v == entry->built.loss)) g.mark_output(v);
  FT_CHECK(!with_backward || entry->built.loss != ir::kNone, architecture_,
           ": gradients need labels (no loss without them)");
  {  // op counts of the graph as built, for reports
    ir::Graph plain = g;
    if (with_backward) autodiff::build_backward(plain, entry->built.loss, plain.params());
    entry->passes.ops_before = op_counts(plain);
  }
  if (spec.fusions) {
    passes::FusionReport f = passes::fold_attention_transposes(g);
    if (f.fused > 0)
      entry->passes.applied.push_back(str("fold_attention_transposes: ", f.fused,
                                          " attentions read and write (B, T, H, D), ", f.nodes_removed,
                                          " transposes removed (and their gradients' transposes)"));
    // Decomposed LayerNorm and GELU first, so the passes after them see the fused ops.
    passes::FusionReport dl = passes::fuse_decomposed_layernorm(g);
    if (dl.fused > 0)
      entry->passes.applied.push_back(str("fuse_decomposed_layernorm: ", dl.fused, " written-out LayerNorms"));
    passes::FusionReport eg = passes::fuse_erf_gelu(g);
    if (eg.fused > 0) entry->passes.applied.push_back(str("fuse_erf_gelu: ", eg.fused, " written-out erf GELUs"));
    passes::FusionReport pr = passes::prune_sliced_rows(g);
    if (pr.fused > 0) {
      entry->passes.applied.push_back(
          str("prune_sliced_rows: ", pr.fused, " ops compute only the rows a later Slice keeps"));
      // The last layer's full output may be gone: checkpointing then keeps the boundaries still computed.
      std::vector<ir::ValueId>& boundaries = entry->built.layer_boundaries;
      std::erase_if(boundaries, [&](ir::ValueId v) {
        return g.value(v).kind == ir::ValueKind::Activation && g.value(v).producer == ir::kNone;
      });
    }
    passes::FusionReport d = passes::fuse_dropout_add(g);
    if (d.fused > 0)
      entry->passes.applied.push_back(str("fuse_dropout_add: ", d.fused, " dropout + residual adds in one pass"));
    passes::FusionReport al = passes::fuse_add_layernorm(g);
    if (al.fused > 0)
      entry->passes.applied.push_back(
          str("fuse_add_layernorm: ", al.fused, " residual adds formed and normalised in one pass"));
    passes::FusionReport lg = passes::fuse_linear_gelu(g);
    if (lg.fused > 0)
      entry->passes.applied.push_back(
          str("fuse_linear_gelu: ", lg.fused, " bias + GELU applied by the Linear's GEMM epilogue"));
  }
  if (with_backward) {
    if (spec.fusions && !spec.fp16) {  // fp16 must scale d(logits) before rounding it: not fused
      passes::FusionReport ce = passes::fuse_linear_cross_entropy(g);
      if (ce.fused > 0)
        entry->passes.applied.push_back(str("fuse_linear_cross_entropy: ", ce.fused,
                                            " output projections + losses in row chunks; logits never stored"));
    }
    size_t backward_begin = g.nodes().size();  // passes that drop forward nodes move it
    ir::ValueId seed = spec.fp16 ? g.add_input(kLossScaleInput, Shape{}, DType::f32) : ir::kNone;
    autodiff::build_backward(g, entry->built.loss, g.params(), seed);
    if (spec.fusions) {
      passes::MergeCastsReport m = passes::merge_duplicate_casts(g, backward_begin);
      backward_begin -= static_cast<size_t>(m.casts);  // each merged cast was a forward node, now removed
      if (m.casts > 0)
        entry->passes.applied.push_back(str("merge_duplicate_casts: ", m.casts, " repeated casts (",
                                            m.bytes_saved / (size_t{1} << 20), " MiB) merged into the first"));
    }
    if (spec.recompute) {
      passes::RecomputeReport r = passes::recompute_segments(g, entry->built.layer_boundaries, backward_begin);
      entry->passes.applied.push_back(str("recompute: ", r.segments, " layers, ", r.nodes_cloned,
                                          " forward nodes cloned into backward, ", r.values_freed,
                                          " saved activations freed after forward"));
    }
    if (spec.fusions) {
      passes::GeluRecomputeReport r = passes::recompute_gelu_outputs(g, backward_begin);
      if (r.gelus > 0)
        entry->passes.applied.push_back(str("recompute_gelu_outputs: ", r.gelus, " GELU outputs (",
                                            r.bytes_freed / (size_t{1} << 20),
                                            " MiB) computed again in backward from the input it keeps"));
      passes::RecastReport c = passes::recast_weights_for_backward(g, backward_begin);
      if (c.casts > 0)
        entry->passes.applied.push_back(str("recast_weights_for_backward: ", c.casts, " low-precision weight copies (",
                                            c.bytes_freed / (size_t{1} << 20),
                                            " MiB) cast again in backward instead of kept"));
    }
  }
  if (spec.fusions) {
    passes::OutputCastsReport oc = passes::fold_output_casts(g);
    if (oc.casts > 0)
      entry->passes.applied.push_back(str("fold_output_casts: ", oc.casts, " GELUs write bf16 themselves (",
                                          oc.bytes_saved / (size_t{1} << 20), " MiB of f32 results not written)"));
  }
  entry->passes.ops_after = op_counts(g);
  runtime::PlanOptions options;
  options.num_threads = num_threads_;
  entry->plan = runtime::Plan::compile(g, *params_, options);
  // Defaults for inputs the caller may leave out: all-ones mask, zero token types.
  Tensor mask = entry->plan->input(InputNames::attention_mask);
  std::fill(mask.data_as<int64_t>(), mask.data_as<int64_t>() + mask.numel(), int64_t{1});
  plans_.push_back(std::move(entry));
  return *plans_.back();
}

namespace {

void require_ids(const Tensor& t, const char* what, int64_t B, int64_t T) {
  FT_CHECK(t.dtype() == DType::i64, what, " must be int64, found ", dtype_name(t.dtype()));
  FT_CHECK(t.shape() == Shape({B, T}), what, " has shape ", t.shape().to_string(), ", expected (", B, ", ", T,
           ") like input_ids");
}

}  // namespace

ModelOutput Model::run(const Batch& batch, bool training, bool with_backward, bool zero_grads) {
  const Tensor& ids = batch.input_ids;
  FT_CHECK(ids.data() != nullptr && ids.shape().rank() == 2, "input_ids must have shape (batch, sequence), found ",
           ids.shape().to_string());
  FT_CHECK(ids.dtype() == DType::i64, "input_ids must be int64, found ", dtype_name(ids.dtype()));
  const int64_t B = ids.shape()[0], T = ids.shape()[1];
  FT_CHECK(B > 0 && T > 0, "input_ids is empty: shape ", ids.shape().to_string());
  const Family* family = family_.get();
  FT_CHECK(T <= family->max_positions(), "sequence length ", T, " exceeds the model's maximum of ",
           family->max_positions(), " positions");
  Entry& e = plan_for(batch, training, with_backward);
  runtime::Plan& plan = *e.plan;
  const int64_t* id_data = ids.data_as<int64_t>();
  plan.bind_input(InputNames::input_ids, ids.data());

  auto bind_optional = [&](const char* name, const Tensor& t) {
    if (t.data() == nullptr) {
      plan.bind_input(name, nullptr);
      return;
    }
    require_ids(t, name, B, T);
    plan.bind_input(name, t.data());
  };
  bind_optional(InputNames::attention_mask, batch.attention_mask);
  if (batch.attention_mask.data() != nullptr) {
    // The graph turns the mask into an additive bias, (1 - m) * min: any value but 0 or 1 would silently become
    // NaN (large values), a full mask (2) or a reweighting (negative values).
    const int64_t* mask = batch.attention_mask.data_as<int64_t>();
    for (int64_t i = 0; i < B * T; ++i)
      FT_CHECK(mask[i] == 0 || mask[i] == 1, "attention_mask: value ", mask[i], " at (", i / T, ", ", i % T,
               "); expected 1 for a token to attend to and 0 for padding");
  }
  if (family->uses_token_type_ids())
    bind_optional(InputNames::token_type_ids, batch.token_type_ids);
  else
    FT_CHECK(batch.token_type_ids.data() == nullptr, architecture_, " does not take token_type_ids");
  if (batch.position_ids.data() != nullptr) {
    require_ids(batch.position_ids, "position_ids", B, T);
    plan.bind_input(InputNames::position_ids, batch.position_ids.data());
  } else {
    plan.bind_input(InputNames::position_ids, nullptr);
    family->default_position_ids(id_data, B, T, plan.input(InputNames::position_ids).data_as<int64_t>());
  }
  if (family->reads_pool_index()) {
    int64_t* rows = plan.input(InputNames::pool_index).data_as<int64_t>();
    for (int64_t b = 0; b < B; ++b) rows[b] = b * T + family->pool_position(id_data + b * T, T);
  }

  // Integer labels must name a class of the logits (or be -100, ignored).
  auto check_classes = [&](const Tensor& labels) {
    const int64_t classes = e.built.graph.value(e.built.logits).shape[-1];
    const int64_t* l = labels.data_as<int64_t>();
    for (int64_t i = 0; i < labels.numel(); ++i)
      FT_CHECK(l[i] == -100 || (l[i] >= 0 && l[i] < classes), "labels: value ", l[i], " at position ", i,
               " is outside [0, ", classes, ") (the model has ", classes, " classes; -100 marks ignored positions)");
  };
  switch (e.spec.labels) {
    case LabelKind::None:
      break;
    case LabelKind::TokenIds: {
      require_ids(batch.labels, "labels", B, T);
      check_classes(batch.labels);
      if (family->head() == Head::CausalLM) {
        // Shift left: position t predicts token t + 1; the last position is ignored.
        int64_t* shifted = plan.input(InputNames::labels).data_as<int64_t>();
        const int64_t* labels = batch.labels.data_as<int64_t>();
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t t = 0; t + 1 < T; ++t) shifted[b * T + t] = labels[b * T + t + 1];
          shifted[b * T + T - 1] = -100;
        }
      } else {
        plan.bind_input(InputNames::labels, batch.labels.data());
      }
      break;
    }
    case LabelKind::ClassIds:
      FT_CHECK(batch.labels.dtype() == DType::i64 && batch.labels.shape() == Shape({B}), "labels have shape ",
               batch.labels.shape().to_string(), "; class labels must be int64 of shape (", B, ")");
      check_classes(batch.labels);
      plan.bind_input(InputNames::labels, batch.labels.data());
      break;
    case LabelKind::Values: {
      Tensor dest = plan.input(InputNames::labels);
      FT_CHECK(batch.labels.numel() == dest.numel(), "float labels have shape ", batch.labels.shape().to_string(),
               ", expected ", dest.shape().to_string());
      plan.bind_input(InputNames::labels, batch.labels.data());
      break;
    }
    case LabelKind::Spans: {
      FT_CHECK(batch.start_positions.defined() && batch.end_positions.defined(),
               "question answering needs both start_positions and end_positions");
      for (auto [name, t] : {std::pair{InputNames::start_positions, &batch.start_positions},
                             std::pair{InputNames::end_positions, &batch.end_positions}}) {
        FT_CHECK(t->dtype() == DType::i64 && t->shape() == Shape({B}), name, " must be int64 of shape (", B, ")");
        int64_t* dest = plan.input(name).data_as<int64_t>();
        for (int64_t b = 0; b < B; ++b) dest[b] = std::clamp<int64_t>(t->data_as<int64_t>()[b], 0, T);
      }
      break;
    }
  }

  if (e.spec.fp16 && with_backward) *plan.input(kLossScaleInput).data_as<float>() = static_cast<float>(loss_scale_);
  if (zero_grads) params_->zero_grads();
  if (training) plan.set_step((dropout_seed_ << 32) + rng_step_++);
  plan.run();
  last_plan_ = &plan;
  last_pass_log_ = &e.passes;
  ModelOutput out;
  if (!with_backward) {
    out.logits = plan.output(e.built.logits);
    if (e.built.end_logits != ir::kNone) out.end_logits = plan.output(e.built.end_logits);
  }
  if (e.built.loss != ir::kNone) out.loss = plan.output(e.built.loss).item();
  return out;
}

ModelOutput Model::forward(const Batch& batch, bool training) { return run(batch, training, false, false); }

double Model::loss_and_grads(const Batch& batch, bool training) { return *run(batch, training, true, true).loss; }

double Model::accumulate_grads(const Batch& batch, bool training) { return *run(batch, training, true, false).loss; }

}  // namespace fusetrain::models
