// TrainingArguments: the subset of transformers' fields fusetrain supports,
// with transformers' names and defaults.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace fusetrain::train {

/// Training configuration. Field names and defaults follow
/// transformers.TrainingArguments; the fusetrain_* fields are engine-specific.
struct TrainingArguments {
  std::string output_dir = "trainer_output";
  double num_train_epochs = 3.0;
  int64_t max_steps = -1;  ///< > 0 overrides num_train_epochs
  int64_t per_device_train_batch_size = 8;
  int64_t per_device_eval_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;
  /// The optimizer, by transformers' `optim` name (optim::optimizer_names), and its options ("key=value,...").
  std::string optim = "adamw_torch";
  std::string optim_args;
  std::string lr_scheduler_type = "linear";
  double warmup_steps = 0;  ///< steps when >= 1; a ratio of the total steps when in (0, 1), as in transformers 5
  double warmup_ratio = 0.0;
  int64_t logging_steps = 500;
  /// "random" (shuffled each epoch), "sequential", or "group_by_length" (shuffled, then examples of similar length
  /// batched together, as transformers' LengthGroupedSampler: data::length_grouped_order)
  std::string train_sampling_strategy = "random";
  std::string eval_strategy = "no";     ///< "no", "steps", "epoch"
  std::optional<int64_t> eval_steps;    ///< defaults to logging_steps
  std::string save_strategy = "steps";  ///< "no", "steps", "epoch", "best"
  int64_t save_steps = 500;
  std::optional<int64_t> save_total_limit;
  bool load_best_model_at_end = false;
  std::optional<std::string> metric_for_best_model;  ///< defaults to "loss" when load_best_model_at_end
  std::optional<bool> greater_is_better;             ///< defaults to false for losses, true otherwise
  int64_t seed = 42;
  bool dataloader_drop_last = false;
  std::optional<std::string> resume_from_checkpoint;
  bool bf16 = false;
  bool fp16 = false;
  /// Early stopping: evaluations without improvement before stopping (0: off).
  int64_t early_stopping_patience = 0;
  double early_stopping_threshold = 0.0;
  /// Activation checkpointing: recompute each transformer layer's activations in
  /// backward (transformers' gradient_checkpointing; either field turns it on).
  bool gradient_checkpointing = false;
  bool fusetrain_recompute = false;
  /// Kernel threads (0: all cores).
  int64_t fusetrain_threads = 0;
  /// Steps in a row whose loss or gradient norm is inf or NaN (each skipped, not applied) before training stops.
  int64_t fusetrain_max_nonfinite_steps = 3;
  /// Show a progress bar on the terminal.
  bool disable_tqdm = false;
  /// Data parallel: the size of the gradient buckets communicated while backward runs, in MiB (transformers'
  /// ddp_bucket_cap_mb; its default there is PyTorch DDP's 25).
  int64_t ddp_bucket_cap_mb = 25;
  /// ZeRO stage (DeepSpeed's numbering): 0 replicates the optimizer state on every rank; 1 shards the AdamW moments
  /// across ranks (gradients reduce-scattered at the step's end, parameters all-gathered after the update); 2 also
  /// reduce-scatters the gradients of every micro-batch as backward finishes each bucket.
  int64_t zero_stage = 0;

  /// Throws Error naming the first invalid field (a batch size of 0, a negative
  /// learning rate, an unknown strategy, ...).
  void validate() const;
  /// The effective eval_steps, metric and direction.
  int64_t effective_eval_steps() const { return eval_steps.value_or(logging_steps); }
  std::string effective_metric() const;
  bool effective_greater_is_better() const;

  /// transformers-style JSON (what training_args.json holds).
  nlohmann::json to_json() const;
  /// Reads the fields present in `json`; unknown keys are an Error listing them.
  static TrainingArguments from_json(const nlohmann::json& json);
};

/// Calls visit(name, field, help) for every field, in declaration order: the
/// CLI builds its flags and the JSON conversion from this one list.
template <typename Args, typename Visit>
void for_each_field(Args& a, Visit&& visit) {
  visit("output_dir", a.output_dir, "where checkpoints, logs and the final model are written");
  visit("num_train_epochs", a.num_train_epochs, "passes over the training data");
  visit("max_steps", a.max_steps, "optimizer steps to run; > 0 overrides num_train_epochs");
  visit("per_device_train_batch_size", a.per_device_train_batch_size, "examples per training micro-batch");
  visit("per_device_eval_batch_size", a.per_device_eval_batch_size, "examples per evaluation batch");
  visit("gradient_accumulation_steps", a.gradient_accumulation_steps, "micro-batches per optimizer step");
  visit("learning_rate", a.learning_rate, "peak learning rate");
  visit("weight_decay", a.weight_decay,
        "weight decay of the decayed group (not biases and norm weights), as the optimizer applies it");
  visit("adam_beta1", a.adam_beta1, "AdamW beta1 (and Lion's)");
  visit("adam_beta2", a.adam_beta2, "AdamW beta2 (and Lion's)");
  visit("adam_epsilon", a.adam_epsilon, "AdamW epsilon");
  visit("max_grad_norm", a.max_grad_norm, "global gradient-norm clipping (0: off)");
  visit("optim", a.optim,
        "optimizer, by transformers' name: adamw_torch, sgd, rmsprop, adagrad, lion_32bit, rmsprop_bnb, ...");
  visit("optim_args", a.optim_args, "the optimizer's options, \"key=value,...\" (sgd: momentum=0.9,nesterov=true)");
  visit("lr_scheduler_type", a.lr_scheduler_type,
        "linear, cosine, cosine_with_restarts, polynomial, constant or constant_with_warmup");
  visit("warmup_steps", a.warmup_steps,
        "linear warmup steps, or a ratio of the total steps when below 1 (overrides warmup_ratio)");
  visit("warmup_ratio", a.warmup_ratio, "warmup as a fraction of the total steps");
  visit("logging_steps", a.logging_steps, "log every N optimizer steps");
  visit("train_sampling_strategy", a.train_sampling_strategy,
        "order of the training examples: random (shuffled each epoch), sequential, or group_by_length (shuffled, "
        "then batched with examples of similar length: less padding)");
  visit("eval_strategy", a.eval_strategy, "when to evaluate: no, steps or epoch");
  visit("eval_steps", a.eval_steps, "evaluate every N steps (default: logging_steps)");
  visit("save_strategy", a.save_strategy, "when to save checkpoints: no, steps, epoch or best");
  visit("save_steps", a.save_steps, "save every N steps");
  visit("save_total_limit", a.save_total_limit, "keep at most N checkpoints (the best one is kept)");
  visit("load_best_model_at_end", a.load_best_model_at_end, "restore the best checkpoint when training ends");
  visit("metric_for_best_model", a.metric_for_best_model, "metric that decides the best model (default: loss)");
  visit("greater_is_better", a.greater_is_better, "whether a larger metric is better");
  visit("seed", a.seed, "seed for initialisation, shuffling, masking and dropout");
  visit("dataloader_drop_last", a.dataloader_drop_last, "drop the last incomplete batch");
  visit("resume_from_checkpoint", a.resume_from_checkpoint, "checkpoint directory to continue from");
  visit("bf16", a.bf16,
        "bf16 mixed precision (bf16 dot products with AVX512-BF16 or AMX; elsewhere bf16 operands are widened "
        "to f32 in the GEMM: f32 speed, half the activation memory)");
  visit("fp16", a.fp16,
        "fp16 mixed precision with dynamic loss scaling, as on GPUs (f16 operands, f32 accumulation; on CPUs "
        "without fp16 arithmetic it runs at f32 speed: --bf16 is the fast path)");
  visit("early_stopping_patience", a.early_stopping_patience, "stop after N evaluations without improvement");
  visit("early_stopping_threshold", a.early_stopping_threshold, "minimum improvement that counts");
  visit("gradient_checkpointing", a.gradient_checkpointing,
        "recompute each layer's activations in backward: a smaller activation peak for one extra forward");
  visit("fusetrain_recompute", a.fusetrain_recompute, "same as gradient_checkpointing");
  visit("fusetrain_threads", a.fusetrain_threads, "kernel threads (0: all cores)");
  visit("fusetrain_max_nonfinite_steps", a.fusetrain_max_nonfinite_steps,
        "a step whose loss or gradient norm is inf or NaN is skipped; this many in a row stop training");
  visit("disable_tqdm", a.disable_tqdm, "no progress bar");
  visit("ddp_bucket_cap_mb", a.ddp_bucket_cap_mb,
        "data parallel: MiB of gradients per all-reduce, each sent as soon as backward has finished it");
  visit("zero_stage", a.zero_stage,
        "data parallel: 0 (DDP), 1 (ZeRO-1: AdamW moments sharded across ranks) or 2 (ZeRO-2: gradients also "
        "reduce-scattered per micro-batch)");
}

}  // namespace fusetrain::train
