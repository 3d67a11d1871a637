// The CLI's subcommands; each maps flags onto the library and returns an exit status.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include <CLI/CLI.hpp>
#include <string>

#include "fusetrain/train/training_args.h"

namespace fusetrain::cli {

/// Every flag of train/evaluate/predict/inspect.
struct Options {
  std::string model;
  std::string task = "seq-cls";
  std::string train_file, eval_file, test_file, output;
  /// Columns; empty means the task's default (see add_options).
  std::string text_column, text_pair_column, label_column;
  int64_t max_seq_length = 128;
  bool max_seq_length_given = false;  ///< --max-seq-length was on the command line (else the default, capped)
  int64_t max_target_length = 128;    ///< seq2seq: the target (decoder) sequence length (inspect's decoder inputs)
  int64_t num_labels = 0;
  int64_t doc_stride = 128;
  bool line_by_line = false;
  bool label_all_tokens = false;
  bool profile = false;
  bool profile_nodes = false;  // inspect --profile: also every node, in schedule order
  /// inspect: the number of data-parallel ranks to lay out buckets and ZeRO shards for (under mpirun: the job's).
  int64_t world_size = 1;
  /// export: the ONNX opset (17 to 20); the task's head comes from --task when given, else from config.json.
  int64_t opset = 17;
  bool task_given = false;
  /// "none", or "tensorboard": every log entry also goes to the sink set_report_sink installed.
  std::string report_to = "none";
  /// LoRA (train): rank (0: full fine-tuning), alpha, dropout, target modules (comma-separated; empty: PEFT's
  /// default for the model type), base weights' dtype ("f32" or "bf16"), and whether to also write the merged model.
  int64_t lora_r = 0;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  std::string lora_target_modules;
  std::string base_dtype = "f32";
  bool merge_lora = false;
  /// evaluate/predict: a PEFT adapter directory applied on top of --model.
  std::string adapter;
  train::TrainingArguments args;
};

/// Receives every training log entry and the run's output_dir (`--report-to tensorboard`). The `fusetrain` command
/// installed by pip sets one that writes TensorBoard event files; the C++ binary has none.
using ReportSink = std::function<void(const nlohmann::json& entry, const std::string& output_dir)>;
void set_report_sink(ReportSink sink);

/// Registers the data/model flags and one flag per TrainingArguments field
/// (spelled with dashes: --learning-rate, --per-device-train-batch-size, ...).
void add_options(CLI::App& app, Options& options);

int run_train(Options& options, bool default_job);
int run_evaluate(Options& options);
int run_predict(Options& options);
int run_inspect(Options& options);
/// Writes --output/model.onnx (the inference graph) with config.json and the tokenizer files beside it.
int run_export(Options& options);
/// Registers export's flags: --model, --output, --task, --opset.
void add_export_options(CLI::App& app, Options& options);

}  // namespace fusetrain::cli
