// The training loop, evaluation and metrics.
#include "fusetrain/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>

#include "fusetrain/core/error.h"
#include "fusetrain/data/features.h"
#include "fusetrain/data/loader.h"
#include "fusetrain/data/qa.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/comm/communicator.h"
#include "fusetrain/train/schedule.h"
#include "train/checkpoint.h"
#include "train/progress.h"
#include "train/trainer_impl.h"

namespace fusetrain::train {

namespace fs = std::filesystem;
using models::Head;

optim::OptimizerSpec optimizer_spec(const TrainingArguments& args) {
  return {args.optim, args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_epsilon,
          optim::parse_optim_args(args.optim_args)};
}

Trainer::Trainer(models::Model& model, TrainingArguments args, Head task, const data::TokenizedDataset* train_dataset,
                 const data::TokenizedDataset* eval_dataset, CollationIds ids)
    : impl_(std::make_unique<Impl>()),
      model_(model),
      args_(std::move(args)),
      task_(task),
      train_(train_dataset),
      eval_(eval_dataset),
      ids_(std::move(ids)) {
  args_.validate();
  FT_CHECK(*models::head_info(task).task, "a model without a head (", model.architecture(), ") has nothing to train");
  FT_CHECK(!(args_.eval_strategy != "no" && eval_ == nullptr), "eval_strategy is \"", args_.eval_strategy,
           "\" but there is no evaluation dataset");
  if (fs::exists(args_.output_dir))
    FT_CHECK(fs::is_directory(args_.output_dir), "output_dir \"", args_.output_dir, "\" exists and is not a directory");
  check_vocabulary(train_, "training");
  check_vocabulary(eval_, "evaluation");
  model_.set_num_threads(static_cast<int>(args_.fusetrain_threads));
  model_.set_bf16(args_.bf16);
  model_.set_fp16(args_.fp16);
  model_.set_recompute(args_.gradient_checkpointing || args_.fusetrain_recompute);
  model_.set_dropout_seed(static_cast<uint64_t>(args_.seed));
  runtime::ParameterStore& params = model_.params();
  for (size_t i = 0; i < params.slots().size(); ++i) params.set_weight_decay(i, model_.decays(params.slots()[i].name));
  // The optimizer is made on first use: train() under ZeRO makes it with its shard only, so the whole moments
  // are never allocated on a rank.
  impl_->schedule = parse_lr_schedule(args_.lr_scheduler_type);
}

Trainer::~Trainer() = default;

// A tokenizer larger than the model's vocabulary gives ids the embedding has no row for: refused here, naming the
// vocabulary, rather than later by the loss (as "labels") or by a kernel in the middle of a step.
void Trainer::check_vocabulary(const data::TokenizedDataset* dataset, const char* which) const {
  const nlohmann::json& config = model_.config();
  if (dataset == nullptr || !config.contains("vocab_size") || !config["vocab_size"].is_number_integer()) return;
  const int64_t vocab = config["vocab_size"].get<int64_t>();
  for (int64_t i = 0; i < dataset->size(); ++i)
    for (const int64_t id : dataset->ids(i))
      FT_CHECK(id >= 0 && id < vocab, "the ", which, " data holds token id ", id, " (example ", i,
               ") but the model's vocabulary has ", vocab, " entries (config.json \"vocab_size\"): the tokenizer "
               "is larger than the model's embedding, so it is not this model's tokenizer (or the embedding needs "
               "resizing to it)");
}

void Trainer::check_same_configuration() {
  comm::Communicator& comm = *comm_;
  nlohmann::json mine = args_.to_json();
  mine["model"] = model_.architecture();
  mine["parameter_elements"] = model_.params().flat_numel();
  mine["train_examples"] = train_ ? train_->size() : 0;
  mine["eval_examples"] = eval_ ? eval_->size() : 0;
  // The content too: files of the same length but other text would otherwise train on a mix.
  auto hex = [](uint64_t h) { return str(std::hex, std::setw(16), std::setfill('0'), h); };
  mine["train_data_fingerprint"] = train_ ? hex(train_->fingerprint()) : "";
  mine["eval_data_fingerprint"] = eval_ ? hex(eval_->fingerprint()) : "";
  std::string text = mine.dump();
  int64_t length = static_cast<int64_t>(text.size());
  comm.broadcast(&length, sizeof length, 0);
  std::string reference = comm.rank() == 0 ? text : std::string(static_cast<size_t>(length), ' ');
  comm.broadcast(reference.data(), length, 0);
  const nlohmann::json first = nlohmann::json::parse(reference);
  std::string differences;
  for (const auto& [key, value] : first.items())
    if (!mine.contains(key) || mine[key] != value) {
      const bool data = key.size() > 17 && key.compare(key.size() - 17, 17, "_data_fingerprint") == 0;
      differences += str(differences.empty() ? "" : "; ",
                         data ? str("the ", key.substr(0, key.size() - 17) == "train" ? "training" : "evaluation",
                                    " data differs from rank 0's in content (fingerprint ",
                                    mine.contains(key) ? mine[key].get<std::string>() : "unset", " here, ",
                                    value.get<std::string>(), " on rank 0)")
                              : str(key, " is ", mine.contains(key) ? mine[key].dump() : "unset", " here and ",
                                    value.dump(), " on rank 0"));
    }
  std::vector<double> differs(static_cast<size_t>(comm.size()), 0.0);
  differs[static_cast<size_t>(comm.rank())] = differences.empty() ? 0.0 : 1.0;
  comm.all_reduce_sum(differs.data(), static_cast<int64_t>(differs.size()));
  std::string ranks;
  for (size_t r = 0; r < differs.size(); ++r)
    if (differs[r] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  FT_CHECK(differences.empty(), "rank ", comm.rank(), " of the data-parallel job was started with another ",
           "configuration than rank 0: ", differences);
  FT_CHECK(ranks.empty(), "rank(s) ", ranks, " of the data-parallel job were started with another configuration than ",
           "rank 0 (model, data or arguments); every rank must run the same job");
}

models::Batch Trainer::view_of(const data::Batch& b) const {
  models::Batch m;
  const int64_t B = b.batch_size, T = b.seq_len;
  auto ids = [&](const std::vector<int64_t>& v) {
    return Tensor::view(const_cast<int64_t*>(v.data()), {B, T}, DType::i64);
  };
  if (!b.input_ids.empty()) m.set("input_ids", ids(b.input_ids));
  if (!b.attention_mask.empty()) m.set("attention_mask", ids(b.attention_mask));
  if (model_.uses_token_type_ids() && !b.token_type_ids.empty()) m.set("token_type_ids", ids(b.token_type_ids));
  if (!b.position_ids.empty()) m.set("position_ids", ids(b.position_ids));
  for (const data::FloatInput& input : b.float_inputs)
    m.set(input.name, Tensor::view(const_cast<float*>(input.values.data()), Shape(input.shape), DType::f32));
  for (const data::TokenInput& input : b.token_inputs)
    m.set(input.name, Tensor::view(const_cast<int64_t*>(input.values.data()), Shape(input.shape), DType::i64));
  const int64_t L = b.label_seq_len > 0 ? b.label_seq_len : T;
  if (!b.float_labels.empty())
    m.set("labels", Tensor::view(const_cast<float*>(b.float_labels.data()), {B, 1}, DType::f32));
  else if (L > 0 && static_cast<int64_t>(b.labels.size()) == B * L && task_ != Head::SequenceClassification)
    m.set("labels", Tensor::view(const_cast<int64_t*>(b.labels.data()), {B, L}, DType::i64));
  else if (static_cast<int64_t>(b.labels.size()) == B)
    m.set("labels", Tensor::view(const_cast<int64_t*>(b.labels.data()), {B}, DType::i64));
  if (!b.start_positions.empty()) {
    m.set("start_positions", Tensor::view(const_cast<int64_t*>(b.start_positions.data()), {B}, DType::i64));
    m.set("end_positions", Tensor::view(const_cast<int64_t*>(b.end_positions.data()), {B}, DType::i64));
  }
  return m;
}

void Trainer::log(nlohmann::json entry) {
  entry["step"] = state_.global_step;
  if (comm_->rank() != 0) {  // every rank keeps the history; rank 0 alone writes it
    state_.log_history.push_back(entry);
    return;
  }
  if (delegated_) {  // the callbacks keep the history and write the logs
    for (const auto& c : callbacks_) c->on_log(state_, control_, entry);
    return;
  }
  state_.log_history.push_back(entry);
  if (log_sink_) log_sink_(entry);
  fs::create_directories(args_.output_dir);
  std::ofstream out(fs::path(args_.output_dir) / "log.jsonl", std::ios::app);
  out << entry.dump() << '\n';
  for (const auto& c : callbacks_) c->on_log(state_, control_, entry);
}

data::CollateFn Trainer::collate_for(const data::TokenizedDataset& dataset, uint64_t seed, bool training) const {
  if (collate_)
    return [collate = collate_, training](std::span<const int64_t> indices, uint64_t batch_number) {
      return collate(indices, batch_number, training);
    };
  if (const auto* features = dynamic_cast<const data::FeatureDataset*>(&dataset)) {
    // Images or audio: the dataset pads its own input; a speech model that reads SpecAugment's masks gets them
    // drawn per training batch from its config.json.
    std::vector<std::string> masks;
    for (const models::InputDecl& input : model_.inputs())
      if (input.name == "mask_time_indices" || input.name == "mask_feature_indices") masks.push_back(input.name);
    if (!training) masks.clear();
    const data::SpecAugment spec =
        masks.empty() ? data::SpecAugment{} : data::SpecAugment::from_config(model_.config());
    return [features, masks, spec, seed](std::span<const int64_t> indices, uint64_t batch_number) {
      data::Batch batch = features->collate(indices);
      if (!masks.empty()) data::add_spec_augment(batch, features->input_name(), spec, masks, seed, batch_number);
      return batch;
    };
  }
  data::CollateOptions options;
  options.pad_id = ids_.pad_id;
  options.seed = seed;
  options.decoder_start_id = ids_.decoder_start_id;
  // The engine masks tokens itself only when it collates: a data collator (set_collate) gives its own labels.
  FT_CHECK(!(task_ == Head::MaskedLM && !ids_.mlm), "masked-LM training needs a tokenizer with a mask token");
  if (task_ == Head::MaskedLM) options.mlm = ids_.mlm;
  return data::padded_collate(dataset, options);
}

const LossScaler& Trainer::loss_scaler() const { return impl_->scaler; }

LossScaler& Trainer::loss_scaler() { return impl_->scaler; }

optim::Optimizer& Trainer::optimizer() {
  if (!impl_->optimizer) make_optimizer({});
  return *impl_->optimizer;
}

void Trainer::make_optimizer(optim::Shard shard) {
  impl_->optimizer.reset();  // the old moments go before the new ones are allocated
  impl_->optimizer = optim::make_optimizer(model_.params(), optimizer_spec(args_), std::move(shard));
  impl_->optimizer->set_num_threads(static_cast<int>(args_.fusetrain_threads));
  impl_->optimizer->set_zero_grads(true);  // the update clears the gradients for the next step's accumulation
  if (impl_->sync && impl_->sync->zero_stage() > 0)  // a per-parameter statistic sums the ranks' shares
    impl_->optimizer->set_all_reduce([this](double* data, int64_t n) { comm_->all_reduce_sum(data, n); });
}

int64_t Trainer::nonfinite_skipped_steps() const { return impl_->nonfinite_skipped_steps; }

void Trainer::start_at(int64_t global_step, int64_t dropout_step, int64_t nonfinite_skipped_steps) {
  FT_CHECK(global_step >= 0 && dropout_step >= 0 && nonfinite_skipped_steps >= 0 &&
               nonfinite_skipped_steps <= global_step,
           "start_at: expected 0 <= nonfinite_skipped_steps (", nonfinite_skipped_steps, ") <= global_step (",
           global_step, ") and dropout_step >= 0 (", dropout_step, ")");
  start_step_ = global_step;
  impl_->resume_dropout_step = dropout_step;
  impl_->resume_nonfinite_skipped = nonfinite_skipped_steps;
}

// One call of train(): the loader, the step's running totals and the parts of the loop, named.
class Trainer::Run {
 public:
  explicit Run(Trainer& trainer);
  /// Epochs of micro-batches, a step after every gradient_accumulation_steps of them; the run's metrics.
  std::map<std::string, double> go();

 private:
  // What one step adds up over its micro-batches (over ranks, after reduce_over_ranks).
  struct StepTotals {
    double loss = 0, nonfinite_loss = 0, loss_sum = 0, entropy = 0, accuracy = 0;
    int64_t tokens = 0, samples = 0, predicted = 0, labelled = 0, counted = 0;
    std::vector<models::PreferenceStats> preference;
    std::vector<double> terms;  // data parallel: each micro-batch's share of the step's loss, summed over ranks
  };

  /// Forward and backward of micro-batch `micro` of the epoch (data parallel: its share of the global
  /// micro-batch, the gradients communicated as backward finishes them); its counts added to the step's.
  void micro_batch(const data::Batch& batch, int64_t micro);
  /// The step's end after micro-batch `micro` of `epoch`: the means, the guarded optimizer step, the state, the
  /// callbacks, and logging, evaluation and saving as they ask.
  void finish_step(int64_t epoch, int64_t micro);
  /// Data parallel: one reduction of the step's scalars (each micro-batch's global mean loss, then the global
  /// batch's samples, tokens and label counts).
  void reduce_over_ranks(int64_t in_step);
  /// Clips and applies the step unless its loss or gradient norm is not finite; the reason it did not, if so.
  std::string optimizer_step(double grad_scale);
  /// The non-finite guard: counts a skipped step, and stops the run after too many in a row.
  void skip_nonfinite_step(const std::string& reason);
  /// Evaluates and tracks the best metric (early stopping); whether it improved.
  bool evaluate_and_track();
  /// Logs, evaluates and saves as control_ asks, then clears the requests: transformers' _maybe_log_save_evaluate.
  void log_evaluate_save();
  /// The positions a micro-batch's mean loss is over (a causal LM predicts positions 1..T-1) and its labels that are
  /// not ignored (every position): what transformers' num_items_in_batch counts, shifted or not.
  std::pair<int64_t, int64_t> label_counts(const data::Batch& b) const;
  /// The learning rate of the schedule's current step. As in transformers, the schedule advances only after an
  /// optimizer step that ran: fp16 steps skipped for overflow and steps the non-finite guard skipped hold it.
  double current_lr() const;

  Trainer& t_;
  const TrainingArguments& a_;
  comm::Communicator& comm_;
  const int64_t world_, rank_, accum_;
  std::unique_ptr<data::DataLoader> loader_;
  std::unique_ptr<Progress> progress_;
  std::chrono::steady_clock::time_point started_;
  StepTotals step_;
  double loss_since_log_ = 0, total_loss_ = 0, last_norm_ = 0, step_lr_ = 0;
  int64_t steps_since_log_ = 0, steps_this_run_ = 0, steps_in_loss_ = 0, samples_this_run_ = 0;
  // The non-finite guard's streak.
  int64_t nonfinite_in_a_row_ = 0, first_nonfinite_step_ = 0;
  std::string checkpoint_before_streak_;
};

std::map<std::string, double> Trainer::train() { return Run(*this).go(); }

Trainer::Run::Run(Trainer& trainer)
    : t_(trainer),
      a_(trainer.args_),
      comm_(*trainer.comm_),
      world_(trainer.comm_->size()),
      rank_(trainer.comm_->rank()),
      accum_(trainer.args_.gradient_accumulation_steps) {
  Trainer& t = t_;
  const TrainingArguments& a = a_;
  FT_CHECK(t.train_ != nullptr && t.train_->size() > 0, "train() needs a non-empty training dataset");
  FT_CHECK(t.task_ != Head::QuestionAnswering || t.collate_ ||
               dynamic_cast<const data::QuestionAnsweringDataset*>(t.train_),
           "question answering trains on a QuestionAnsweringDataset, or with a collator that gives start and end "
           "positions");
  // Data parallel: the loader walks global batches of per_device x world examples, in the order one process with
  // that batch size would, and each rank collates its slice (empty on some ranks in a short last batch).
  data::LoaderOptions loader_options;
  loader_options.batch_size = a.per_device_train_batch_size * world_;
  loader_options.shuffle = a.train_sampling_strategy != "sequential";
  loader_options.seed = static_cast<uint64_t>(a.seed);
  loader_options.drop_last = a.dataloader_drop_last;
  if (a.train_sampling_strategy == "group_by_length") {
    // Grouped in megabatches of whole steps (batch x accumulation), as transformers' LengthGroupedSampler is.
    loader_options.group_batch_size = loader_options.batch_size * accum_;
    if (t.train_lengths_.empty()) {
      loader_options.lengths.reserve(static_cast<size_t>(t.train_->size()));
      for (int64_t i = 0; i < t.train_->size(); ++i) loader_options.lengths.push_back(t.train_->length(i));
    } else {
      FT_CHECK(static_cast<int64_t>(t.train_lengths_.size()) == t.train_->size(), "set_train_lengths gave ",
               t.train_lengths_.size(), " lengths for a training dataset of ", t.train_->size(), " examples");
      loader_options.lengths = t.train_lengths_;
    }
  }
  data::CollateFn collate = t.collate_for(*t.train_, a.seed, /*training=*/true);
  if (world_ > 1)
    collate = [collate, rank = rank_, per = a.per_device_train_batch_size](std::span<const int64_t> indices,
                                                                          uint64_t number) {
      const size_t begin = std::min(indices.size(), static_cast<size_t>(rank * per));
      const size_t end = std::min(indices.size(), begin + static_cast<size_t>(per));
      return begin == end ? data::Batch{} : collate(indices.subspan(begin, end - begin), number);
    };
  loader_ = std::make_unique<data::DataLoader>(t.train_->size(), loader_options, collate);
  Impl& impl = *t.impl_;
  impl.batches_per_epoch = loader_->batches_per_epoch();
  FT_CHECK(impl.batches_per_epoch > 0, "the training dataset (", t.train_->size(), " examples) gives no batch of ",
           a.per_device_train_batch_size, " with dataloader_drop_last");
  // The last micro-batches of an epoch make a step of their own when the epoch does not divide by accum, as in
  // transformers.
  impl.updates_per_epoch = std::max<int64_t>((impl.batches_per_epoch + accum_ - 1) / accum_, 1);
  t.state_ = TrainerState{};
  t.state_.max_steps =
      a.max_steps > 0
          ? a.max_steps
          : static_cast<int64_t>(std::ceil(a.num_train_epochs * static_cast<double>(impl.updates_per_epoch)));
  impl.warmup = warmup_steps_for(a.warmup_steps, a.warmup_ratio, t.state_.max_steps);
  impl.nonfinite_skipped_steps = 0;
  impl.last_checkpoint.clear();
  if (rank_ == 0) remove_unfinished_saves(a.output_dir);
  runtime::ParameterStore& store = t.model_.params();
  if (world_ > 1) {
    t.check_same_configuration();
    impl.sync = std::make_unique<GradientSync>(comm_, store, a.ddp_bucket_cap_mb << 20, static_cast<int>(a.zero_stage));
    if (a.zero_stage > 0) t.make_optimizer(impl.sync->optimizer_shard());  // the moments of its shard only
  }
  const bool sharded = world_ > 1 && a.zero_stage > 0;
  if (!impl.optimizer || (!sharded && impl.optimizer->shard_numel() != store.flat_numel())) t.make_optimizer({});
  if (a.resume_from_checkpoint) t.load_checkpoint(*a.resume_from_checkpoint);
  if (t.start_step_) {
    FT_CHECK(*t.start_step_ <= t.state_.max_steps, "the run resumes at step ", *t.start_step_, " but ends at step ",
             t.state_.max_steps);
    t.state_.global_step = *t.start_step_;
    t.state_.epoch = static_cast<double>(*t.start_step_) / static_cast<double>(impl.updates_per_epoch);
    t.model_.set_rng_step(static_cast<uint64_t>(impl.resume_dropout_step));
    impl.nonfinite_skipped_steps = impl.resume_nonfinite_skipped;
    t.start_step_.reset();
  }
  t.model_.params().zero_grads();
  if (world_ > 1)  // every rank starts from rank 0's weights
    comm_.broadcast(store.params_data(), store.flat_numel() * static_cast<int64_t>(sizeof(float)), 0);
}

std::map<std::string, double> Trainer::Run::go() {
  Trainer& t = t_;
  TrainerState& state = t.state_;
  Impl& impl = *t.impl_;
  const int64_t start_epoch = state.global_step / impl.updates_per_epoch;
  const int64_t skip_batches = (state.global_step % impl.updates_per_epoch) * accum_;
  t.control_ = TrainerControl{};
  for (const auto& c : t.callbacks_) c->on_train_begin(state, t.control_);
  progress_ = std::make_unique<Progress>(state.max_steps, !a_.disable_tqdm && rank_ == 0);
  progress_->update(state.global_step, {});
  started_ = std::chrono::steady_clock::now();
  for (int64_t epoch = start_epoch; state.global_step < state.max_steps && !t.control_.should_training_stop; ++epoch) {
    loader_->start_epoch(epoch);
    int64_t micro = 0;
    if (epoch == start_epoch && skip_batches > 0) {
      loader_->skip(skip_batches);
      micro = skip_batches;
    }
    t.control_.should_epoch_stop = false;
    for (const auto& c : t.callbacks_) c->on_epoch_begin(state, t.control_);
    while (std::optional<data::Batch> batch = loader_->next()) {
      if (micro % accum_ == 0)
        for (const auto& c : t.callbacks_) c->on_step_begin(state, t.control_);
      micro_batch(*batch, micro);
      ++micro;
      const bool last_in_epoch = micro == impl.batches_per_epoch;
      if (micro % accum_ != 0 && !last_in_epoch) continue;
      finish_step(epoch, micro);
      if (t.control_.should_training_stop || t.control_.should_epoch_stop) break;
    }
    t.control_.should_evaluate = a_.eval_strategy == "epoch";
    t.control_.should_save = a_.save_strategy == "epoch";
    for (const auto& c : t.callbacks_) c->on_epoch_end(state, t.control_);
    log_evaluate_save();
  }
  progress_->finish();
  total_loss_ += loss_since_log_;
  double runtime = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  if (a_.load_best_model_at_end && state.best_model_checkpoint)
    load_checkpoint_weights(t.model_, *state.best_model_checkpoint);
  std::map<std::string, double> metrics{
      {"train_runtime", runtime},
      {"train_samples_per_second", static_cast<double>(samples_this_run_) / std::max(runtime, 1e-9)},
      {"train_steps_per_second", static_cast<double>(steps_this_run_) / std::max(runtime, 1e-9)},
      {"train_loss", steps_in_loss_ ? total_loss_ / static_cast<double>(steps_in_loss_) : 0.0},
      {"epoch", state.epoch}};
  // Data parallel: the seconds this rank spent in the gradient collectives (waiting for the others included).
  if (impl.sync) metrics["train_communication_seconds"] = impl.sync->communication_seconds();
  if (!t.delegated_) {
    nlohmann::json entry = nlohmann::json::object();
    for (const auto& [k, v] : metrics) entry[k] = v;
    t.log(entry);
  }
  for (const auto& c : t.callbacks_) c->on_train_end(state, t.control_);
  return metrics;
}

std::pair<int64_t, int64_t> Trainer::Run::label_counts(const data::Batch& b) const {
  const int64_t B = b.batch_size, T = b.label_seq_len > 0 ? b.label_seq_len : b.seq_len;
  if (static_cast<int64_t>(b.labels.size()) != B * T || t_.task_ == Head::SequenceClassification) return {B, B};
  int64_t predicted = 0, labelled = 0;
  // Packed rows (position ids without a mask): the first token of each example is not predicted either.
  const bool packed = b.attention_mask.empty() && static_cast<int64_t>(b.position_ids.size()) == B * T;
  for (int64_t i = 0; i < B * T; ++i) {
    if (b.labels[static_cast<size_t>(i)] == data::kIgnoreIndex) continue;
    ++labelled;
    const bool starts = i % T == 0 || (packed && b.position_ids[size_t(i)] != b.position_ids[size_t(i - 1)] + 1);
    predicted += t_.task_ != Head::CausalLM || !starts;
  }
  return {predicted, labelled};
}

double Trainer::Run::current_lr() const {
  const Impl& impl = *t_.impl_;
  const int64_t step = t_.state_.global_step - (a_.fp16 ? impl.scaler.skipped_steps() : 0) -
                       impl.nonfinite_skipped_steps;
  return a_.learning_rate * lr_lambda(impl.schedule, step, impl.warmup, t_.state_.max_steps, a_.learning_rate);
}

void Trainer::Run::micro_batch(const data::Batch& batch, int64_t micro) {
  Trainer& t = t_;
  Impl& impl = *t.impl_;
  if (a_.fp16) t.model_.set_loss_scale(impl.scaler.scale());
  double loss;
  if (world_ == 1) {
    loss = t.model_.accumulate_grads(t.view_of(batch), /*training=*/true);
  } else {
    // This micro-batch's share of the step, over all ranks: its mean over the global micro-batch (this rank's
    // mean weighted by its labelled positions over the global count), weighted 1 / (micro-batches in the step)
    // as one process weights its micro-batches. The gradient sync applies the weight to each bucket as backward
    // finishes it and communicates the buckets; the micro-batch's global mean loss is summed over ranks at the
    // step's end.
    const int64_t first_of_step = micro - micro % accum_;
    const int64_t in_this_step = std::min(accum_, impl.batches_per_epoch - first_of_step);
    const int64_t mine = batch.batch_size > 0 ? label_counts(batch).first : 0;
    const double global = comm_.sum(static_cast<double>(mine));
    FT_CHECK(global > 0, "a micro-batch of step ", t.state_.global_step + 1, " has no labelled position on any rank");
    // The weight relative to an even split, mine / global x world: exactly 1 when every rank has the same count
    // (the gradients then need no scaling pass; the optimizer applies 1 / (world x micro-batches)).
    impl.sync->start_micro_batch(micro % accum_, in_this_step,
                                 static_cast<double>(mine) * static_cast<double>(world_) / global);
    double local_loss = 0;
    if (mine > 0)
      local_loss = t.model_.accumulate_grads(t.view_of(batch), /*training=*/true, impl.sync.get());
    else
      impl.sync->skip_backward();
    // Summed over ranks at the step's end: the global micro-batch mean, times in_this_step so that the step's
    // division gives the same mean of means.
    step_.terms.push_back(local_loss * static_cast<double>(mine) / global);
    loss = 0;
  }
  if (!std::isfinite(loss) && std::isfinite(step_.loss)) step_.nonfinite_loss = loss;
  step_.loss += loss;
  samples_this_run_ += batch.batch_size;
  step_.samples += batch.batch_size;
  step_.tokens += batch.batch_size * batch.seq_len;
  step_.counted += std::max<int64_t>(batch.counted_tokens, 0);
  if (const std::optional<models::TokenStats>& stats = t.model_.last_token_stats(); stats && stats->counted > 0) {
    step_.entropy += stats->entropy_sum / stats->counted;
    step_.accuracy += stats->top1 / stats->counted;
  }
  if (t.model_.preference() && t.model_.last_preference_stats())
    step_.preference.push_back(*t.model_.last_preference_stats());
  const auto [predicted, labelled] = label_counts(batch);
  step_.predicted += predicted;
  step_.labelled += labelled;
  step_.loss_sum += loss * static_cast<double>(predicted);
}

void Trainer::Run::reduce_over_ranks(int64_t in_step) {
  std::vector<double>& terms = step_.terms;
  const size_t k = terms.size();
  terms.insert(terms.end(), {static_cast<double>(step_.samples), static_cast<double>(step_.tokens),
                             static_cast<double>(step_.predicted), static_cast<double>(step_.labelled),
                             static_cast<double>(step_.counted)});
  comm_.all_reduce_sum(terms.data(), static_cast<int64_t>(terms.size()));
  step_.loss = 0;
  step_.loss_sum = 0;
  for (size_t j = 0; j < k; ++j) {
    if (!std::isfinite(terms[j]) && std::isfinite(step_.loss)) step_.nonfinite_loss = terms[j];
    step_.loss += terms[j];
  }
  samples_this_run_ += static_cast<int64_t>(terms[k]) - step_.samples;
  step_.samples = static_cast<int64_t>(terms[k]);
  step_.tokens = static_cast<int64_t>(terms[k + 1]);
  step_.predicted = static_cast<int64_t>(terms[k + 2]);
  step_.labelled = static_cast<int64_t>(terms[k + 3]);
  step_.counted = static_cast<int64_t>(terms[k + 4]);
  // The step's summed token losses over its predicted positions, as one process reports them.
  step_.loss_sum = step_.loss / static_cast<double>(in_step) * static_cast<double>(step_.predicted);
  terms.clear();
}

std::string Trainer::Run::optimizer_step(double grad_scale) {
  Impl& impl = *t_.impl_;
  auto nonfinite_name = [](double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; };
  // The non-finite guard: a step whose loss (any micro-batch's) or gradient norm is inf or NaN is not applied; the
  // norm is the one the clip pass computes anyway, so the guard costs no pass over the gradients. (An fp16 step
  // whose loss is finite but whose scaled gradients overflowed is the loss scaler's to skip, as before.)
  if (!std::isfinite(step_.loss)) return str("the loss is ", nonfinite_name(step_.nonfinite_loss));
  std::string skipped;
  // The global norm: data parallel summed it bucket by bucket during communication (under ZeRO over the ranks'
  // shards).
  const double unscaled_norm = std::sqrt(impl.sync ? impl.sync->global_grad_sum_of_squares()
                                                   : impl.optimizer->grad_sum_of_squares());
  if (a_.fp16) {  // unscale in the fused pass; an overflowed step changes nothing but the scale
    const double norm = impl.optimizer->clip_and_step_with_norm(unscaled_norm, a_.max_grad_norm, current_lr(),
                                                               grad_scale / impl.scaler.scale());
    impl.scaler.update(!std::isfinite(norm));
    last_norm_ = norm;
  } else {
    const double norm =
        impl.optimizer->clip_and_step_with_norm(unscaled_norm, a_.max_grad_norm, current_lr(), grad_scale);
    if (std::isfinite(norm))
      last_norm_ = norm;
    else
      skipped = str("the gradient norm is ", nonfinite_name(norm));
  }
  if (impl.sync && std::isfinite(last_norm_) && skipped.empty()) impl.sync->gather_parameters();
  return skipped;
}

void Trainer::Run::finish_step(int64_t epoch, int64_t micro) {
  Trainer& t = t_;
  TrainerState& state = t.state_;
  Impl& impl = *t.impl_;
  // The step's loss and gradients are means over its micro-batches (fewer than accum at an epoch's end).
  const int64_t in_step = micro % accum_ == 0 ? accum_ : micro % accum_;
  double grad_scale = 1.0 / static_cast<double>(in_step);
  if (world_ > 1) {
    // The gradient buckets were summed over ranks during backward.
    grad_scale = 1.0 / static_cast<double>(world_ * in_step);
    reduce_over_ranks(in_step);
  }
  step_.loss /= static_cast<double>(in_step);
  step_lr_ = current_lr();  // logged with the step, as transformers logs the rate its optimizer step used
  const std::string skipped = optimizer_step(grad_scale);
  const bool updated = std::isfinite(step_.loss) && std::isfinite(last_norm_) && skipped.empty();
  // The update zeroed the gradients it read (ZeRO: the sync zeroed each bucket once sent); a step that did not
  // run leaves them to clear.
  if (!updated) t.model_.params().zero_grads();
  ++state.global_step;
  ++steps_this_run_;
  state.epoch = static_cast<double>(epoch) + static_cast<double>(micro) / static_cast<double>(impl.batches_per_epoch);
  state.last_step = StepReport{step_.loss,
                               last_norm_,
                               step_lr_,
                               step_.tokens,
                               step_.samples,
                               step_.loss_sum,
                               step_.predicted,
                               step_.labelled,
                               in_step,
                               !skipped.empty() || (a_.fp16 && !std::isfinite(last_norm_)),
                               step_.counted,
                               step_.entropy / static_cast<double>(in_step),
                               step_.accuracy / static_cast<double>(in_step),
                               std::move(step_.preference)};
  const double step_loss = step_.loss;
  step_ = StepTotals{};
  if (!skipped.empty()) {
    skip_nonfinite_step(skipped);
  } else {
    nonfinite_in_a_row_ = 0;
    loss_since_log_ += step_loss;
    ++steps_since_log_;
    ++steps_in_loss_;
  }
  const double mean_loss = loss_since_log_ / static_cast<double>(std::max<int64_t>(steps_since_log_, 1));
  progress_->update(state.global_step, {{"loss", mean_loss}, {"lr", current_lr()}});
  t.control_.should_log = state.global_step % a_.logging_steps == 0;
  t.control_.should_evaluate = a_.eval_strategy == "steps" && state.global_step % a_.effective_eval_steps() == 0;
  t.control_.should_save = a_.save_strategy == "steps" && state.global_step % a_.save_steps == 0;
  if (state.global_step >= state.max_steps) t.control_.should_training_stop = true;
  for (const auto& c : t.callbacks_) c->on_step_end(state, t.control_);
  log_evaluate_save();
}

void Trainer::Run::skip_nonfinite_step(const std::string& reason) {
  Trainer& t = t_;
  ++t.impl_->nonfinite_skipped_steps;
  if (nonfinite_in_a_row_++ == 0) {
    first_nonfinite_step_ = t.state_.global_step;
    checkpoint_before_streak_ = t.impl_->last_checkpoint;
  }
  t.log({{"skipped_step", reason}, {"epoch", t.state_.epoch}});
  if (nonfinite_in_a_row_ < a_.fusetrain_max_nonfinite_steps) return;
  throw Error(str("training stopped at step ", t.state_.global_step, ": ", nonfinite_in_a_row_,
                  " steps in a row (", first_nonfinite_step_, " to ", t.state_.global_step,
                  ") had a non-finite loss or gradient norm and were skipped (the last: ", reason, "); ",
                  checkpoint_before_streak_.empty() ? "no checkpoint was saved before them"
                                                    : "the last good checkpoint is " + checkpoint_before_streak_,
                  ". Try a lower learning_rate (it is ", a_.learning_rate, "), max_grad_norm or warmup"));
}

bool Trainer::Run::evaluate_and_track() {
  Trainer& t = t_;
  std::map<std::string, double> metrics = t.evaluate();
  const std::string key = a_.effective_metric();
  auto it = metrics.find(key);
  FT_CHECK(it != metrics.end(), "metric_for_best_model \"", key, "\" is not among the evaluation metrics");
  const bool greater = a_.effective_greater_is_better();
  const std::optional<double>& best = t.state_.best_metric;
  const bool improved = !best || (greater ? it->second > *best + a_.early_stopping_threshold
                                          : it->second < *best - a_.early_stopping_threshold);
  if (improved) {
    t.state_.best_metric = it->second;
    t.impl_->evaluations_without_improvement = 0;
  } else if (a_.early_stopping_patience > 0 &&
             ++t.impl_->evaluations_without_improvement >= a_.early_stopping_patience) {
    t.control_.should_training_stop = true;
  }
  return improved;
}

void Trainer::Run::log_evaluate_save() {
  Trainer& t = t_;
  TrainerControl& control = t.control_;
  if (t.delegated_) {
    control.should_log = control.should_evaluate = control.should_save = false;
    return;
  }
  if (control.should_log && steps_since_log_ > 0) {
    double mean = loss_since_log_ / static_cast<double>(steps_since_log_);
    total_loss_ += loss_since_log_;
    loss_since_log_ = 0;
    steps_since_log_ = 0;
    t.log({{"loss", mean}, {"grad_norm", last_norm_}, {"learning_rate", step_lr_}, {"epoch", t.state_.epoch}});
  }
  bool improved = false;
  if (control.should_evaluate && t.eval_ != nullptr) improved = evaluate_and_track();
  if (control.should_save || (a_.save_strategy == "best" && improved)) {
    std::string dir = t.save_checkpoint();
    t.impl_->last_checkpoint = dir;
    if (improved) t.state_.best_model_checkpoint = dir;
    t.rotate_checkpoints();
  }
  control.should_log = control.should_evaluate = control.should_save = false;
}

std::map<std::string, double> Trainer::evaluate(const data::TokenizedDataset* dataset) {
  const data::TokenizedDataset* d = dataset ? dataset : eval_;
  FT_CHECK(d != nullptr && d->size() > 0, "evaluate() needs a non-empty evaluation dataset");
  auto started = std::chrono::steady_clock::now();
  Predictions p = predict(*d);
  double runtime = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::map<std::string, double> metrics;
  for (const auto& [k, v] : p.metrics) metrics["eval_" + k] = v;
  metrics["eval_runtime"] = runtime;
  metrics["eval_samples_per_second"] = static_cast<double>(d->size()) / std::max(runtime, 1e-9);
  nlohmann::json entry = nlohmann::json::object();
  for (const auto& [k, v] : metrics) entry[k] = v;
  entry["epoch"] = state_.epoch;
  log(entry);
  for (const auto& c : callbacks_) c->on_evaluate(state_, control_, metrics);
  return metrics;
}

namespace {

// Data parallel evaluation: rank r's run of whole eval batches, batches [first_batch, first_batch + batches) of the
// one-process order, examples [first_example, first_example + examples). The batches are split as evenly as they go
// (the first ranks take one more), so a rank has none when there are more ranks than batches.
struct EvalShard {
  int64_t first_batch = 0;
  int64_t first_example = 0;
  int64_t examples = 0;
};

EvalShard eval_shard(int64_t dataset_size, int64_t batch_size, int64_t rank, int64_t world) {
  const int64_t batches = (dataset_size + batch_size - 1) / batch_size;
  const int64_t each = batches / world, extra = batches % world;
  EvalShard shard;
  shard.first_batch = rank * each + std::min(rank, extra);
  const int64_t mine = each + (rank < extra ? 1 : 0);
  shard.first_example = std::min(dataset_size, shard.first_batch * batch_size);
  shard.examples = std::min(dataset_size, (shard.first_batch + mine) * batch_size) - shard.first_example;
  return shard;
}

// Point to point in pieces that fit MPI's int counts; nothing is sent for no values.
constexpr int64_t kPieceBytes = int64_t{1} << 30;

template <class T>
void send_values(comm::Communicator& comm, const T* values, int64_t n, int dest) {
  const auto* bytes = reinterpret_cast<const char*>(values);
  const int64_t total = n * static_cast<int64_t>(sizeof(T));
  for (int64_t done = 0; done < total; done += kPieceBytes)
    comm.send(bytes + done, std::min(kPieceBytes, total - done), dest);
}

template <class T>
void recv_values(comm::Communicator& comm, T* values, int64_t n, int source) {
  auto* bytes = reinterpret_cast<char*>(values);
  const int64_t total = n * static_cast<int64_t>(sizeof(T));
  for (int64_t done = 0; done < total; done += kPieceBytes)
    comm.recv(bytes + done, std::min(kPieceBytes, total - done), source);
}

// Appends n values received from `source` to `values`.
template <class T>
void recv_append(comm::Communicator& comm, std::vector<T>& values, int64_t n, int source) {
  const size_t old = values.size();
  values.resize(old + static_cast<size_t>(n));
  recv_values(comm, values.data() + old, n, source);
}

// Appends every other rank's part of the predictions to rank 0's, in rank order: sizes first, then the buffers.
// Question answering's feature offsets are shifted past the logits gathered before them. `batch_losses` (each
// batch's loss times its size) travel too, so that rank 0 sums them in one process's order. Returns, on rank 0,
// which rank's dataset size differs from rank 0's ("" when none).
std::string gather_predictions(comm::Communicator& comm, int64_t dataset_size, Predictions& p,
                               std::vector<double>& batch_losses, int64_t& loss_weight) {
  enum { kDataset, kRows, kClasses, kLogits, kEndLogits, kLabels, kFloatLabels, kOffsets, kLosses, kWeight, kFrames,
         kFrameOffsets, kSizes };
  if (comm.rank() != 0) {
    const int64_t offsets = std::max<int64_t>(static_cast<int64_t>(p.feature_offsets.size()) - 1, 0);
    const int64_t frame_offsets = std::max<int64_t>(static_cast<int64_t>(p.frame_offsets.size()) - 1, 0);
    const int64_t sizes[kSizes] = {dataset_size,
                                   p.rows,
                                   p.classes,
                                   static_cast<int64_t>(p.logits.size()),
                                   static_cast<int64_t>(p.end_logits.size()),
                                   static_cast<int64_t>(p.labels.size()),
                                   static_cast<int64_t>(p.float_labels.size()),
                                   offsets,
                                   static_cast<int64_t>(batch_losses.size()),
                                   loss_weight,
                                   static_cast<int64_t>(p.frame_ids.size()),
                                   frame_offsets};
    send_values(comm, sizes, kSizes, 0);
    send_values(comm, p.logits.data(), sizes[kLogits], 0);
    send_values(comm, p.end_logits.data(), sizes[kEndLogits], 0);
    send_values(comm, p.labels.data(), sizes[kLabels], 0);
    send_values(comm, p.float_labels.data(), sizes[kFloatLabels], 0);
    if (offsets > 0) send_values(comm, p.feature_offsets.data() + 1, offsets, 0);
    send_values(comm, batch_losses.data(), sizes[kLosses], 0);
    send_values(comm, p.frame_ids.data(), sizes[kFrames], 0);
    if (frame_offsets > 0) send_values(comm, p.frame_offsets.data() + 1, frame_offsets, 0);
    return "";
  }
  std::string mismatch;
  for (int source = 1; source < comm.size(); ++source) {
    int64_t sizes[kSizes];
    recv_values(comm, sizes, kSizes, source);
    if (sizes[kDataset] != dataset_size && mismatch.empty())
      mismatch = str("rank ", source, " evaluates ", sizes[kDataset], " examples and rank 0 ", dataset_size,
                     "; every rank must read the same evaluation data");
    const auto base = static_cast<int64_t>(p.logits.size());
    p.rows += sizes[kRows];
    p.classes = std::max(p.classes, sizes[kClasses]);
    recv_append(comm, p.logits, sizes[kLogits], source);
    recv_append(comm, p.end_logits, sizes[kEndLogits], source);
    recv_append(comm, p.labels, sizes[kLabels], source);
    recv_append(comm, p.float_labels, sizes[kFloatLabels], source);
    const size_t first_offset = p.feature_offsets.size();
    recv_append(comm, p.feature_offsets, sizes[kOffsets], source);
    for (size_t i = first_offset; i < p.feature_offsets.size(); ++i) p.feature_offsets[i] += base;
    recv_append(comm, batch_losses, sizes[kLosses], source);
    loss_weight += sizes[kWeight];
    const auto frames_before = static_cast<int64_t>(p.frame_ids.size());
    recv_append(comm, p.frame_ids, sizes[kFrames], source);
    if (p.frame_offsets.empty() && sizes[kFrameOffsets] > 0) p.frame_offsets.push_back(0);
    const size_t first_frame_offset = p.frame_offsets.size();
    recv_append(comm, p.frame_offsets, sizes[kFrameOffsets], source);
    for (size_t i = first_frame_offset; i < p.frame_offsets.size(); ++i) p.frame_offsets[i] += frames_before;
  }
  return mismatch;
}

// Rank 0's metrics, or the error that stopped it computing them, on every rank. The names travel as JSON and the
// values as raw doubles: JSON has no NaN or infinity, and a metric may be either.
void broadcast_metrics(comm::Communicator& comm, std::map<std::string, double>& metrics, std::string& error) {
  std::string text;
  std::vector<double> values;
  if (comm.rank() == 0) {
    nlohmann::json names = nlohmann::json::array();
    for (const auto& [name, value] : metrics) {
      names.push_back(name);
      values.push_back(value);
    }
    text = nlohmann::json{{"names", names}, {"error", error}}.dump();
  }
  int64_t sizes[2] = {static_cast<int64_t>(text.size()), static_cast<int64_t>(values.size())};
  comm.broadcast(sizes, sizeof sizes, 0);
  text.resize(static_cast<size_t>(sizes[0]));
  values.resize(static_cast<size_t>(sizes[1]));
  comm.broadcast(text.data(), sizes[0], 0);
  comm.broadcast(values.data(), sizes[1] * static_cast<int64_t>(sizeof(double)), 0);
  if (comm.rank() == 0) return;
  const nlohmann::json message = nlohmann::json::parse(text);
  error = message["error"].get<std::string>();
  metrics.clear();
  for (size_t i = 0; i < values.size(); ++i) metrics[message["names"][i].get<std::string>()] = values[i];
}

}  // namespace

Predictions Trainer::predict(const data::TokenizedDataset& dataset) {
  // Data parallel: each rank runs the forward on its own run of whole eval batches, the same batches one process
  // makes, so that the ranks' outputs concatenated in rank order are one process's. Rank 0 gathers them and computes
  // the metrics, then broadcasts them: one rank computing them keeps compute_metrics_ (user code) and the QA and NER
  // decoding to one run and makes every rank's metrics identical, and only the metrics travel back.
  comm::Communicator& comm = *comm_;
  const bool sharded = comm.size() > 1;
  const EvalShard shard = sharded ? eval_shard(dataset.size(), args_.per_device_eval_batch_size, comm.rank(),
                                               comm.size())
                                  : EvalShard{0, 0, dataset.size()};
  data::LoaderOptions options;
  options.batch_size = args_.per_device_eval_batch_size;
  options.shuffle = false;
  data::CollateFn collate = collate_for(dataset, args_.seed + 1, /*training=*/false);
  if (shard.first_example > 0)  // the loader counts from 0: shift to the shard's examples and batch numbers
    collate = [collate = std::move(collate), shard](std::span<const int64_t> indices, uint64_t batch_number) {
      std::vector<int64_t> examples(indices.begin(), indices.end());
      for (int64_t& i : examples) i += shard.first_example;
      return collate(examples, batch_number + static_cast<uint64_t>(shard.first_batch));  // the same MLM masks
    };
  data::DataLoader loader(shard.examples, options, std::move(collate));
  loader.start_epoch(0);
  Predictions p;
  double loss_sum = 0;
  int64_t loss_weight = 0;
  std::vector<double> batch_losses;  // data parallel: each batch's loss x size, summed on rank 0 in one pass
  const bool labelled = dataset.label_kind() != data::LabelKind::None;
  const auto* qa = dynamic_cast<const data::QuestionAnsweringDataset*>(&dataset);
  FT_CHECK(task_ != Head::QuestionAnswering || qa, "question answering needs a QuestionAnsweringDataset");
  int64_t feature = shard.first_example;
  if (qa) p.feature_offsets.push_back(0);
  while (std::optional<data::Batch> batch = loader.next()) {
    models::Batch view = view_of(*batch);
    if (!labelled) view.set("labels", Tensor());
    models::ModelOutput out = model_.forward(view, /*training=*/false);
    if (out.loss) {
      // Each batch weighs the eval batch size, a last smaller one too: transformers' evaluation loop repeats each
      // batch's loss per_device_eval_batch_size times, so its eval_loss is the mean of the batches' losses.
      const double weighted = *out.loss * static_cast<double>(options.batch_size);
      if (sharded)
        batch_losses.push_back(weighted);
      else
        loss_sum += weighted;
      loss_weight += options.batch_size;
    }
    const int64_t K = out.logits.shape()[-1];
    const float* logits = out.logits.data_as<float>();
    p.classes = K;
    if (task_ == Head::QuestionAnswering) {
      // (B, T) start and end logits; each feature keeps its own tokens, not the padding.
      const float* end_logits = out.end_logits.data_as<float>();
      const int64_t T = batch->seq_len;
      for (int64_t b = 0; b < batch->batch_size; ++b) {
        const int64_t length = dataset.length(feature + b);
        p.logits.insert(p.logits.end(), logits + b * T, logits + b * T + length);
        p.end_logits.insert(p.end_logits.end(), end_logits + b * T, end_logits + b * T + length);
        p.feature_offsets.push_back(static_cast<int64_t>(p.logits.size()));
      }
      p.rows += batch->batch_size;
    } else if (task_ == Head::SequenceClassification) {
      p.logits.insert(p.logits.end(), logits, logits + batch->batch_size * K);
      p.rows += batch->batch_size;
      if (labelled && batch->float_labels.empty())
        p.labels.insert(p.labels.end(), batch->labels.begin(), batch->labels.end());
      else if (labelled)
        p.float_labels.insert(p.float_labels.end(), batch->float_labels.begin(), batch->float_labels.end());
    } else if (!labelled && task_ == Head::TokenClassification) {
      // Unlabelled tokens: every token of every example, in order, padding dropped.
      const int64_t T = batch->seq_len;
      for (int64_t b = 0; b < batch->batch_size; ++b) {
        const int64_t length = dataset.length(feature + b);
        p.logits.insert(p.logits.end(), logits + b * T * K, logits + (b * T + length) * K);
        p.rows += length;
      }
    } else if (task_ == Head::Ctc) {
      // Each example's per-frame argmax: its greedy transcription, decoded in add_metrics.
      const int64_t B = batch->batch_size, F = out.logits.shape()[1];
      if (p.frame_offsets.empty()) p.frame_offsets.push_back(0);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < F; ++t) {
          const float* row = logits + (b * F + t) * K;
          p.frame_ids.push_back(std::max_element(row, row + K) - row);
        }
        p.frame_offsets.push_back(static_cast<int64_t>(p.frame_ids.size()));
      }
      p.rows += B;
    } else if (labelled) {
      // Token tasks: keep the labelled positions (causal LM: position t predicts t + 1; an encoder-decoder's labels
      // span the target sequence).
      const int64_t B = batch->batch_size, T = batch->label_seq_len > 0 ? batch->label_seq_len : batch->seq_len;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
          int64_t target_t = task_ == Head::CausalLM ? t + 1 : t;
          if (target_t >= T) continue;
          int64_t label = batch->labels[b * T + target_t];
          if (label == data::kIgnoreIndex) continue;
          if (task_ == Head::TokenClassification)
            p.logits.insert(p.logits.end(), logits + (b * T + t) * K, logits + (b * T + t + 1) * K);
          p.labels.push_back(label);
          ++p.rows;
        }
    }
    feature += batch->batch_size;
  }
  std::string error;
  if (sharded) {
    error = gather_predictions(comm, dataset.size(), p, batch_losses, loss_weight);
    if (comm.rank() != 0) {
      p = Predictions{};
      broadcast_metrics(comm, p.metrics, error);
      FT_CHECK(error.empty(), "the evaluation on rank 0 failed: ", error);
      return p;
    }
    for (double weighted : batch_losses) loss_sum += weighted;  // in one process's order: the same sum
  }
  if (loss_weight > 0) p.metrics["loss"] = loss_sum / static_cast<double>(loss_weight);
  if (!sharded) {
    add_metrics(p, dataset);
    return p;
  }
  if (error.empty()) {
    try {
      add_metrics(p, dataset);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  broadcast_metrics(comm, p.metrics, error);  // the other ranks wait for the metrics or the error
  FT_CHECK(error.empty(), error);
  return p;
}

void Trainer::add_metrics(Predictions& p, const data::TokenizedDataset& dataset) const {
  if (compute_metrics_) {
    for (const auto& [k, v] : compute_metrics_(p)) p.metrics[k] = v;
    return;
  }
  if (models::head_info(task_).language_model) {
    if (p.metrics.count("loss")) p.metrics["perplexity"] = std::exp(p.metrics["loss"]);
  } else if (task_ == Head::Ctc) {
    // Greedy transcriptions against the references, both decoded with the tokenizer's vocabulary the feature file
    // carries (without one, the loss alone).
    const auto* features = dynamic_cast<const data::FeatureDataset*>(&dataset);
    if (!features || !features->has_vocabulary() || dataset.label_kind() != data::LabelKind::Targets) return;
    std::vector<std::string> predicted, reference;
    for (size_t i = 0; i + 1 < p.frame_offsets.size(); ++i) {
      const int64_t begin = p.frame_offsets[i], end = p.frame_offsets[i + 1];
      const std::span<const int64_t> frames(p.frame_ids.data() + begin, static_cast<size_t>(end - begin));
      predicted.push_back(features->transcription(frames, true));
      reference.push_back(features->transcription(dataset.target(static_cast<int64_t>(i)), false));
    }
    for (const auto& [k, v] : transcription_metrics(predicted, reference)) p.metrics[k] = v;
  } else if (const auto* qa = dynamic_cast<const data::QuestionAnsweringDataset*>(&dataset)) {
    p.classes = 0;
    p.answers = data::decode_answers(*qa, p.logits, p.end_logits, p.feature_offsets);
    if (dataset.label_kind() != data::LabelKind::None)
      for (const auto& [k, v] : data::squad_metrics(p.answers, *qa)) p.metrics[k] = v;
  } else if (!p.labels.empty()) {
    for (const auto& [k, v] : classification_metrics(p)) p.metrics[k] = v;
    const auto* tagged = dynamic_cast<const data::TokenClassificationDataset*>(&dataset);
    if (task_ == Head::TokenClassification && tagged && is_bio(tagged->label_names())) {
      // NER: precision, recall and F1 over whole entities, as run_ner reports them (seqeval).
      std::vector<std::vector<std::string>> predicted, reference;
      int64_t row = 0;
      for (int64_t i = 0; i < dataset.size(); ++i) {
        predicted.emplace_back();
        reference.emplace_back();
        for (int64_t label : tagged->token_labels(i)) {
          if (label == data::kIgnoreIndex) continue;
          const float* logits = p.logits.data() + row++ * p.classes;
          const auto best = static_cast<size_t>(std::max_element(logits, logits + p.classes) - logits);
          predicted.back().push_back(best < tagged->label_names().size() ? tagged->label_names()[best] : "O");
          reference.back().push_back(tagged->label_names()[static_cast<size_t>(label)]);
        }
      }
      for (const auto& [k, v] : entity_metrics(predicted, reference)) p.metrics[k] = v;
    }
  }
}

void Trainer::save_model(const std::string& dir) { model_.save_pretrained(dir.empty() ? args_.output_dir : dir); }

}  // namespace fusetrain::train
