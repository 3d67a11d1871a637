// The Trainer: the training loop with gradient accumulation, schedules,
// evaluation and metrics, logging, checkpoints and resume, early stopping.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fusetrain/comm/communicator.h"
#include "fusetrain/data/collator.h"
#include "fusetrain/data/dataset.h"
#include "fusetrain/data/loader.h"
#include "fusetrain/models/model.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/train/loss_scaler.h"
#include "fusetrain/train/training_args.h"

namespace fusetrain::train {

/// The optimizer step just taken, for callbacks (not saved).
struct StepReport {
  double loss = 0;           ///< mean of the step's micro-batch losses; not finite for a skipped step
  double grad_norm = 0;      ///< the gradient norm before clipping (the last applied step's, for a skipped one)
  double learning_rate = 0;  ///< the learning rate the step applied (transformers logs this one)
  int64_t tokens = 0;        ///< input positions of the step's micro-batches, padding included
  int64_t samples = 0;       ///< examples of the step's micro-batches
  double loss_sum = 0;       ///< the micro-batch losses times the positions each is a mean over (token losses summed)
  int64_t predicted = 0;     ///< those positions: labelled tokens predicted (examples for sequence-level heads)
  int64_t labelled = 0;      ///< labels that are not ignored, at every position (a causal LM's first included)
  int64_t micro_batches = 0;  ///< micro-batches the step accumulated (fewer than accum at an epoch's end)
  bool skipped = false;      ///< not applied: a non-finite loss or gradient norm, or an fp16 overflow
  int64_t counted_tokens = 0;  ///< the tokens a Python collator counted (data::Batch::counted_tokens), summed
  /// With the model's token statistics on (Model::set_token_stats): the mean over the step's micro-batches of each
  /// one's mean token entropy and top-1 accuracy over its counted positions (0 for one without any), as TRL's
  /// trainers average them.
  double token_entropy = 0;
  double token_accuracy = 0;
  /// A preference model (Model::set_preference): each micro-batch's per-sequence figures, in order.
  std::vector<models::PreferenceStats> preference;
};

/// Progress of a run, saved as trainer_state.json in transformers' layout.
struct TrainerState {
  int64_t global_step = 0;
  double epoch = 0.0;
  int64_t max_steps = 0;
  std::optional<double> best_metric;
  std::optional<std::string> best_model_checkpoint;
  nlohmann::json log_history = nlohmann::json::array();
  StepReport last_step;  ///< the step on_step_end reports
  nlohmann::json to_json(const TrainingArguments& args) const;
  /// Reads trainer_state.json (`file` names it in errors): every field type- and range-checked (global_step and
  /// max_steps >= 0, epoch finite and >= 0, ...); a wrong one is an Error naming the file and the field.
  static TrainerState from_json(const nlohmann::json& json, const std::string& file = "trainer_state.json");
};

/// What the loop does after a step or an epoch, as transformers' TrainerControl: the loop sets should_log,
/// should_evaluate and should_save from the arguments before the callbacks of that point run, then honours whatever
/// the callbacks leave set. should_training_stop ends training (early stopping sets it too); should_epoch_stop ends
/// the epoch.
struct TrainerControl {
  bool should_training_stop = false;
  bool should_epoch_stop = false;
  bool should_save = false;
  bool should_evaluate = false;
  bool should_log = false;
};

/// Hooks called at the points transformers' TrainerCallback names; each may change `control`.
class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_begin(const TrainerState&, TrainerControl&) {}
  virtual void on_epoch_begin(const TrainerState&, TrainerControl&) {}
  virtual void on_step_begin(const TrainerState&, TrainerControl&) {}
  virtual void on_step_end(const TrainerState&, TrainerControl&) {}
  virtual void on_epoch_end(const TrainerState&, TrainerControl&) {}
  virtual void on_log(const TrainerState&, TrainerControl&, const nlohmann::json& logs) { (void)logs; }
  virtual void on_evaluate(const TrainerState&, TrainerControl&, const std::map<std::string, double>& metrics) {
    (void)metrics;
  }
  virtual void on_save(const TrainerState&, TrainerControl&, const std::string& checkpoint_dir) {
    (void)checkpoint_dir;
  }
  virtual void on_train_end(const TrainerState&, TrainerControl&) {}
};

/// Model outputs over a dataset: logits rows (N, K) for sequence classification, (N·T, K) token rows for token
/// tasks (ignored positions dropped), with labels. Question answering keeps every feature's start logits in
/// `logits` and end logits in `end_logits`, feature f at [feature_offsets[f], feature_offsets[f + 1]), and the
/// decoded answer of every example in `answers`.
struct Predictions {
  std::vector<float> logits;
  int64_t rows = 0;
  int64_t classes = 0;
  std::vector<int64_t> labels;  ///< one per row; empty without labels
  std::vector<float> float_labels;  ///< regression targets, one per row; empty otherwise
  std::vector<float> end_logits;
  std::vector<int64_t> feature_offsets;
  std::vector<int64_t> frame_ids;      ///< CTC: every example's per-frame argmax, one example after another
  std::vector<int64_t> frame_offsets;  ///< CTC: example i's frames at frame_ids[offsets[i], offsets[i + 1])
  std::vector<std::string> answers;
  std::map<std::string, double> metrics;
};

/// What the Trainer needs from the tokenizer for collation.
struct CollationIds {
  int64_t pad_id = 0;
  std::optional<data::MaskSpec> mlm;  ///< set for masked LM
  int64_t decoder_start_id = -1;      ///< sequence to sequence: the decoder's start token (decoder_start_token_id)
};

/// Makes a batch from example indices in place of the built-in padded collator (e.g. a transformers collator
/// called from Python). `training` is false for evaluation and prediction. Called on the loader's thread.
using CollateOverride = std::function<data::Batch(std::span<const int64_t> indices, uint64_t batch_number, bool training)>;

/// Metrics of predictions in place of the task's built-in ones (transformers' compute_metrics); the loss is kept.
using MetricsFn = std::function<std::map<std::string, double>(const Predictions& predictions)>;

/// Trains `model` on tokenized datasets. Datasets and the model are held by
/// reference and must outlive the Trainer. Question answering needs data::QuestionAnsweringDataset datasets.
class Trainer {
 public:
  Trainer(models::Model& model, TrainingArguments args, models::Head task, const data::TokenizedDataset* train_dataset,
          const data::TokenizedDataset* eval_dataset, CollationIds ids);
  ~Trainer();

  /// Runs training (resuming from args.resume_from_checkpoint when set); returns
  /// the final metrics ("train_loss", "train_runtime", "train_samples_per_second", ...).
  std::map<std::string, double> train();
  /// Loss and task metrics on the eval dataset (or `dataset`), keys prefixed "eval_".
  std::map<std::string, double> evaluate(const data::TokenizedDataset* dataset = nullptr);
  /// Logits (and metrics when the dataset has labels) over `dataset`. Data parallel (set_communicator): every rank
  /// must call it; each runs the forward on its contiguous share of the eval batches, rank 0 gathers the ranks'
  /// outputs and computes the metrics as one process would (same order, same values) and returns the whole
  /// dataset's predictions; every other rank returns the same metrics and no predictions.
  Predictions predict(const data::TokenizedDataset& dataset);
  /// Writes the model (config.json + model.safetensors) to `dir` (default output_dir).
  void save_model(const std::string& dir = "");

  const TrainerState& state() const { return state_; }
  /// The fp16 loss scaler (its scale and skipped steps); meaningful when args.fp16.
  const LossScaler& loss_scaler() const;
  LossScaler& loss_scaler();
  const TrainingArguments& args() const { return args_; }
  void add_callback(std::shared_ptr<Callback> callback) { callbacks_.push_back(std::move(callback)); }
  /// Files copied into every checkpoint (e.g. the tokenizer's), so each checkpoint
  /// is a complete model directory.
  void set_checkpoint_files(std::vector<std::string> paths) { checkpoint_files_ = std::move(paths); }
  /// Receives every log line (also written to output_dir/log.jsonl).
  void set_log_sink(std::function<void(const nlohmann::json&)> sink) { log_sink_ = std::move(sink); }
  /// Collates batches with `collate` instead of the built-in padded collator.
  void set_collate(CollateOverride collate) { collate_ = std::move(collate); }
  /// The lengths train_sampling_strategy="group_by_length" groups by, one per training example (transformers'
  /// length_column_name); by default each example's token count.
  void set_train_lengths(std::vector<int64_t> lengths) { train_lengths_ = std::move(lengths); }
  /// Computes evaluation and prediction metrics with `metrics` instead of the task's built-in ones.
  void set_compute_metrics(MetricsFn metrics) { compute_metrics_ = std::move(metrics); }
  /// Delegated mode (fusetrain.Trainer over transformers' Trainer): the loop runs the steps and the step and epoch
  /// callbacks, and leaves logging, evaluation, checkpoints and the final metrics to the callbacks, which read
  /// TrainerState::last_step. Nothing is written to output_dir and the arguments' strategies are not applied.
  void set_delegated(bool delegated) { delegated_ = delegated; }
  /// The next train() starts at `global_step` (a resumed run whose weights and optimizer state the caller loaded):
  /// it skips the batches before it, as a resume from a checkpoint does. `dropout_step` restores the dropout stream
  /// and `nonfinite_skipped_steps` the schedule's lag; 0 when unknown.
  void start_at(int64_t global_step, int64_t dropout_step, int64_t nonfinite_skipped_steps);
  /// Trains data-parallel over `comm`'s ranks (default: one process): every rank runs this Trainer on the same
  /// dataset and arguments; each collates its slice of every global batch of per_device_train_batch_size x ranks
  /// examples, gradients are summed over ranks weighted by their labelled positions (the global batch's mean), and
  /// rank 0 alone writes logs and checkpoints.
  void set_communicator(std::shared_ptr<comm::Communicator> comm) { comm_ = std::move(comm); }
  /// The optimizer args.optim names (made on first use): its state buffers (ParameterStore layout) and update count.
  optim::Optimizer& optimizer();
  /// Steps the non-finite guard skipped so far (saved beside a checkpoint so the schedule resumes in place).
  int64_t nonfinite_skipped_steps() const;

 private:
  struct Impl;
  class Run;  // one call of train(): its loop's state and parts (trainer.cpp)
  std::unique_ptr<Impl> impl_;
  models::Model& model_;
  TrainingArguments args_;
  models::Head task_;
  const data::TokenizedDataset* train_;
  const data::TokenizedDataset* eval_;
  CollationIds ids_;
  TrainerState state_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::function<void(const nlohmann::json&)> log_sink_;
  std::vector<std::string> checkpoint_files_;
  CollateOverride collate_;
  std::vector<int64_t> train_lengths_;
  MetricsFn compute_metrics_;
  TrainerControl control_;
  bool delegated_ = false;
  std::shared_ptr<comm::Communicator> comm_ = comm::single_process();
  std::optional<int64_t> start_step_;

  void log(nlohmann::json entry);
  /// (Re)makes AdamW over the whole parameters or over a ZeRO shard.
  void make_optimizer(optim::Shard shard);
  /// Data parallel: throws Error on every rank when any rank's model, data (sizes and content) or arguments differ
  /// from rank 0's.
  void check_same_configuration();
  /// Throws Error when `dataset` holds a token id outside the model's config.json vocab_size.
  void check_vocabulary(const data::TokenizedDataset* dataset, const char* which) const;
  std::string save_checkpoint();
  void write_checkpoint(const std::filesystem::path& staged);
  /// optimizer.safetensors, or under ZeRO one file per shard (rank 0 receives the others' shards).
  void write_optimizer_state(const std::filesystem::path& staged);
  void load_checkpoint(const std::string& dir);
  void rotate_checkpoints();
  /// The metrics of complete predictions over `dataset` into p.metrics (the loss already there): compute_metrics_
  /// or the task's; question answering also decodes p.answers.
  void add_metrics(Predictions& p, const data::TokenizedDataset& dataset) const;
  data::CollateFn collate_for(const data::TokenizedDataset& dataset, uint64_t seed, bool training) const;
  models::Batch view_of(const data::Batch& batch) const;
};

/// Accuracy and F1 (binary F1 of class 1 for two classes, macro F1 otherwise)
/// of argmax(logits) against labels.
std::map<std::string, double> classification_metrics(const Predictions& predictions);

/// True when `label_names` are BIO tags ("O", "B-PER", "I-PER", ...) with at least one entity type.
bool is_bio(const std::vector<std::string>& label_names);

/// Entity-level "precision", "recall" and "f1" of BIO-tagged sequences, as transformers' run_ner reports them
/// (seqeval's default: an entity starts at B-X, or at an I-X that does not continue an X; it is right when its
/// type, first and last token all match), and token "accuracy". Throws Error if the sequences differ in count or
/// length.
std::map<std::string, double> entity_metrics(const std::vector<std::vector<std::string>>& predicted,
                                             const std::vector<std::vector<std::string>>& reference);

/// Word and character error rates of transcriptions against references, as transformers' speech scripts report
/// them (jiwer's corpus rates): "wer" = word edits (substitutions, deletions, insertions) over all references'
/// words (split on whitespace), "cer" = character edits over all references' characters (spaces included, ends
/// stripped). A rate whose references hold no word (character) is left out. Throws Error if the counts differ.
std::map<std::string, double> transcription_metrics(const std::vector<std::string>& predictions,
                                                    const std::vector<std::string>& references);

/// The optimizer `args` choose: optim, optim_args, the learning rate, weight decay and Adam arguments.
optim::OptimizerSpec optimizer_spec(const TrainingArguments& args);

}  // namespace fusetrain::train
