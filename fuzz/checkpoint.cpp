// A training checkpoint: train::Trainer resuming from it (resume_from_checkpoint), which reads and checks
// trainer_state.json, rng_state.json, scheduler.json, scaler.json (fp16), optimizer.safetensors and the model's
// weights before training; a callback stops the run at on_train_begin, right after the checkpoint is loaded.
//
// At start-up a tiny BERT classifier trains two fp16 steps and saves a real checkpoint; the first input byte
// chooses which of its files the rest of the input replaces (byte % 6):
//   0 trainer_state.json, 1 rng_state.json, 2 scheduler.json, 3 scaler.json, 4 optimizer.safetensors,
//   5 model.safetensors
// With FUSETRAIN_FUZZ_WRITE_SEEDS=<dir> set, start-up also writes each file of that checkpoint, prefixed with its
// role byte, into <dir> (how fuzz/corpus/checkpoint was made).
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "fusetrain/models/model.h"
#include "fusetrain/train/trainer.h"

namespace {

namespace fs = std::filesystem;
namespace fuzz = fusetrain::fuzz;
namespace train = fusetrain::train;
namespace data = fusetrain::data;

// Thrown by StopAfterResume; not an exception the library could throw.
struct Resumed {};

struct StopAfterResume : train::Callback {
  void on_train_begin(const train::TrainerState&, train::TrainerControl&) override { throw Resumed{}; }
};

struct Setup {
  std::unique_ptr<fusetrain::models::Model> model;
  data::TokenizedDataset dataset;
  std::vector<fuzz::RoleFile> roles;  // a copy of the checkpoint per role
};

train::TrainingArguments arguments(const fs::path& output_dir) {
  train::TrainingArguments args;
  args.output_dir = output_dir.string();
  args.max_steps = 4;
  args.save_steps = 2;
  args.per_device_train_batch_size = 2;
  args.logging_steps = 1;
  args.fp16 = true;
  args.fusetrain_threads = 1;
  args.disable_tqdm = true;
  return args;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

Setup make_setup() {
  Setup s;
  const nlohmann::json config = {{"model_type", "bert"}, {"vocab_size", 32}, {"hidden_size", 8},
                                 {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"intermediate_size", 16},
                                 {"max_position_embeddings", 16}, {"num_labels", 2}};
  s.model = fusetrain::models::Model::from_config(config, 0, "BertForSequenceClassification");
  s.dataset = data::TokenizedDataset::from_flat({.offsets = {0, 3, 7},
                                                 .ids = {2, 5, 3, 2, 6, 7, 3},
                                                 .label_kind = data::LabelKind::Class,
                                                 .labels = {0, 1},
                                                 .num_labels = 2,
                                                 .vocab_size = 32});
  train::TrainingArguments args = arguments(fuzz::scratch_dir() / "run");
  args.max_steps = 2;
  train::Trainer trainer(*s.model, args, fusetrain::models::Head::SequenceClassification, &s.dataset, nullptr, {});
  trainer.train();
  const fs::path saved = fuzz::scratch_dir() / "run" / "checkpoint-2";
  s.roles = fuzz::make_role_dirs({{"trainer_state", "trainer_state.json"},
                                  {"rng_state", "rng_state.json"},
                                  {"scheduler", "scheduler.json"},
                                  {"scaler", "scaler.json"},
                                  {"optimizer", "optimizer.safetensors"},
                                  {"model", "model.safetensors"}});
  const char* seeds = std::getenv("FUSETRAIN_FUZZ_WRITE_SEEDS");
  for (size_t i = 0; i < s.roles.size(); ++i) {
    const fuzz::RoleFile& role = s.roles[i];
    fs::copy(saved, role.dir, fs::copy_options::recursive);
    const std::string role_byte(1, static_cast<char>(i));
    if (seeds != nullptr) fuzz::write_file(fs::path(seeds) / role.file, role_byte + read_file(saved / role.file));
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Setup setup = make_setup();
  const fuzz::RoleFile* role = fuzz::replace_role_file(setup.roles, data, size);
  if (role == nullptr) return 0;
  train::TrainingArguments args = arguments(fuzz::scratch_dir() / "resumed");
  args.resume_from_checkpoint = role->dir.string();
  fuzz::parses("Trainer resuming from a checkpoint", [&] {
    train::Trainer trainer(*setup.model, args, fusetrain::models::Head::SequenceClassification, &setup.dataset, nullptr, {});
    trainer.add_callback(std::make_shared<StopAfterResume>());
    try {
      trainer.train();
      fuzz::fail("train() returned although the callback stops it at on_train_begin");
    } catch (const Resumed&) {
      fuzz::sink = fuzz::sink + static_cast<uint64_t>(trainer.state().global_step);
    }
  });
  return 0;
}
