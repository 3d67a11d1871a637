// The fusetrain command line: train, evaluate, predict, inspect (the `fusetrain` binary and `python -m fusetrain`).
//
//   fusetrain train                      the embedded default job (SST-2 fine-tune of MiniLM)
//   fusetrain train --model DIR --task seq-cls --train-file train.tsv --eval-file dev.tsv ...
//   fusetrain evaluate --model DIR --task seq-cls --eval-file dev.tsv
//   fusetrain predict --model DIR --task seq-cls --test-file test.tsv --output predictions.tsv
//   fusetrain inspect --model DIR [--max-seq-length 128 --per-device-train-batch-size 8]
//   fusetrain export --model DIR --output DIR [--task seq-cls] [--opset 17]
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "cli/app.h"
#include "cli/commands.h"
#include "fusetrain/core/cpu.h"
#include "fusetrain/core/error.h"
#include "fusetrain/kernels/device.h"


namespace fusetrain::cli {

int main(int argc, char** argv) {
  CLI::App app{"fusetrain: train transformer models on the CPU, Hugging Face model directories in and out"};
  app.set_version_flag("--version", std::string("fusetrain ") + FUSETRAIN_VERSION);
  app.require_subcommand(0, 1);
  cli::Options options;
  CLI::App* train = app.add_subcommand("train", "train a model (no arguments: the embedded SST-2 default job)");
  CLI::App* evaluate = app.add_subcommand("evaluate", "loss and metrics of a model on --eval-file");
  CLI::App* predict = app.add_subcommand("predict", "write predictions for --test-file to --output");
  CLI::App* inspect = app.add_subcommand("inspect", "print the model, its parameter count and the plan's memory");
  CLI::App* exporter = app.add_subcommand(
      "export", "write a model's inference graph as ONNX (model.onnx, config.json and the tokenizer in --output)");
  CLI::App* info = app.add_subcommand("info", "print the version and the CPU features the kernels use");
  for (CLI::App* command : {train, evaluate, predict, inspect}) cli::add_options(*command, options);
  cli::add_export_options(*exporter, options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "fusetrain: error: %s (see --help)\n", e.what());
    return 2;
  }
  for (CLI::App* command : {train, evaluate, predict, inspect})
    if (command->parsed()) options.max_seq_length_given = command->count("--max-seq-length") > 0;
  try {
    if (train->parsed()) return cli::run_train(options, argc == 2);
    if (evaluate->parsed()) return cli::run_evaluate(options);
    if (predict->parsed()) return cli::run_predict(options);
    if (inspect->parsed()) return cli::run_inspect(options);
    if (exporter->parsed()) {
      options.task_given = exporter->count("--task") > 0;
      return cli::run_export(options);
    }
    (void)info;
    std::printf("fusetrain %s\ncpu: %s\nfeatures: %s\nbf16 matmuls: %s\n", FUSETRAIN_VERSION, cpu_model_name().c_str(),
                cpu_features().to_string().c_str(),
                cpu_features().avx512_bf16 ? "bf16 dot products (AVX512-BF16)"
                                           : "bf16 operands widened to f32 in the GEMM (no AVX512-BF16: f32 speed)");
    const char* cap = std::getenv("FUSETRAIN_KERNELS");
    const std::string why = cap && *cap ? str("FUSETRAIN_KERNELS=", cap)
                                        : "the widest this CPU has; FUSETRAIN_KERNELS=avx2 or portable caps it";
    std::printf("kernels: %s (%s)\n", kernels::cpu_kernel_path(), why.c_str());
    if (!info->parsed()) std::printf("\n%s", app.help().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusetrain: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace fusetrain::cli
