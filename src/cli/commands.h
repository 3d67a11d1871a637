// The CLI's subcommands; each maps flags onto the library and returns an exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "fusetrain/train/training_args.h"

namespace fusetrain::cli {

/// Every flag of train/evaluate/predict/inspect.
struct Options {
  std::string model;
  std::string task = "seq-cls";
  std::string train_file, eval_file, test_file, output;
  std::string text_column = "sentence", text_pair_column, label_column = "label";
  int64_t max_seq_length = 128;
  int64_t num_labels = 0;
  bool line_by_line = false;
  bool profile = false;
  train::TrainingArguments args;
};

/// Registers the data/model flags and one flag per TrainingArguments field
/// (spelled with dashes: --learning-rate, --per-device-train-batch-size, ...).
void add_options(CLI::App& app, Options& options);

int run_train(Options& options, bool default_job);
int run_evaluate(Options& options);
int run_predict(Options& options);
int run_inspect(Options& options);

}  // namespace fusetrain::cli
