// Checkpoints: output_dir/checkpoint-N/ holds config.json + model.safetensors
// (transformers' layout), optimizer.safetensors (AdamW moments), scheduler.json,
// rng_state.json, trainer_state.json (transformers' format), training_args.json and,
// for fp16 runs, scaler.json (the loss scale). Everything is written into a staging directory that is
// renamed into place, so an interrupted save never damages an earlier checkpoint.
#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "fusetrain/core/error.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/train/trainer.h"
#include "train/trainer_impl.h"

namespace fusetrain::train {

namespace fs = std::filesystem;

void load_checkpoint_weights(models::Model& model, const std::string& dir) {
  io::HfModelDir hf = io::read_hf_dir(dir);
  std::map<std::string, Tensor> tensors;
  for (const std::string& name : hf.tensor_names()) tensors[name] = hf.tensor(name);
  model.load_state_dict(tensors, /*strict=*/true);
}

void commit_directory(const std::string& staged_dir, const std::string& final_dir) {
  fs::path old = fs::path(final_dir).string() + ".old";
  if (fs::exists(final_dir)) {
    fs::remove_all(old);
    fs::rename(final_dir, old);
  }
  fs::rename(staged_dir, final_dir);
  fs::remove_all(old);
}

void maybe_fault_during_save(int64_t step) {
  const char* fault = std::getenv("FUSETRAIN_FAULT_DURING_SAVE");
  if (fault != nullptr && std::atoll(fault) == step) std::_Exit(86);
}

namespace {

void write_json(const fs::path& path, const nlohmann::json& json) {
  std::ofstream out(path);
  FT_CHECK(out.good(), "cannot write ", path.string());
  out << json.dump(2) << '\n';
  FT_CHECK(out.good(), "cannot write ", path.string());
}

}  // namespace

nlohmann::json TrainerState::to_json(const TrainingArguments& args) const {
  return {{"best_metric", best_metric ? nlohmann::json(*best_metric) : nlohmann::json(nullptr)},
          {"best_model_checkpoint",
           best_model_checkpoint ? nlohmann::json(*best_model_checkpoint) : nlohmann::json(nullptr)},
          {"epoch", epoch},
          {"eval_steps", args.effective_eval_steps()},
          {"global_step", global_step},
          {"is_hyper_param_search", false},
          {"is_local_process_zero", true},
          {"is_world_process_zero", true},
          {"log_history", log_history},
          {"logging_steps", args.logging_steps},
          {"max_steps", max_steps},
          {"num_input_tokens_seen", 0},
          {"num_train_epochs", args.num_train_epochs},
          {"save_steps", args.save_steps},
          {"total_flos", 0},
          {"train_batch_size", args.per_device_train_batch_size},
          {"trial_name", nullptr},
          {"trial_params", nullptr}};
}

TrainerState TrainerState::from_json(const nlohmann::json& j) {
  TrainerState s;
  FT_CHECK(j.is_object() && j.contains("global_step"), "trainer_state.json: expected an object with global_step");
  s.global_step = j.at("global_step").get<int64_t>();
  s.epoch = j.value("epoch", 0.0);
  s.max_steps = j.value("max_steps", int64_t{0});
  if (j.contains("best_metric") && !j["best_metric"].is_null()) s.best_metric = j["best_metric"].get<double>();
  if (j.contains("best_model_checkpoint") && !j["best_model_checkpoint"].is_null())
    s.best_model_checkpoint = j["best_model_checkpoint"].get<std::string>();
  if (j.contains("log_history")) s.log_history = j["log_history"];
  return s;
}

std::string Trainer::save_checkpoint() {
  fs::create_directories(args_.output_dir);
  const std::string name = "checkpoint-" + std::to_string(state_.global_step);
  const fs::path final_dir = fs::path(args_.output_dir) / name;
  const fs::path staged = fs::path(args_.output_dir) / ("." + name + ".tmp-" + std::to_string(getpid()));
  fs::remove_all(staged);
  fs::create_directories(staged);
  model_.save_pretrained(staged.string());
  maybe_fault_during_save(state_.global_step);
  const runtime::ParameterStore& params = model_.params();
  const Shape flat{params.flat_numel()};
  std::vector<std::pair<std::string, Tensor>> moments{
      {"exp_avg", Tensor::view(impl_->optimizer->exp_avg(), flat, DType::f32)},
      {"exp_avg_sq", Tensor::view(impl_->optimizer->exp_avg_sq(), flat, DType::f32)}};
  io::save_safetensors((staged / "optimizer.safetensors").string(), moments,
                       {{"step", std::to_string(impl_->optimizer->step_count())}, {"optimizer", "AdamW"}});
  write_json(staged / "scheduler.json", nlohmann::json{{"last_epoch", state_.global_step},
                                                       {"type", args_.lr_scheduler_type},
                                                       {"warmup_steps", impl_->warmup}});
  write_json(staged / "rng_state.json", nlohmann::json{{"dropout_step", model_.rng_step()}, {"seed", args_.seed}});
  if (args_.fp16) write_json(staged / "scaler.json", impl_->scaler.to_json());
  TrainerState saved = state_;
  write_json(staged / "trainer_state.json", saved.to_json(args_));
  write_json(staged / "training_args.json", args_.to_json());
  for (const std::string& file : checkpoint_files_)
    fs::copy_file(file, staged / fs::path(file).filename(), fs::copy_options::overwrite_existing);
  commit_directory(staged.string(), final_dir.string());
  for (const auto& c : callbacks_) c->on_save(state_, control_, final_dir.string());
  return final_dir.string();
}

void Trainer::load_checkpoint(const std::string& dir) {
  FT_CHECK(fs::is_directory(dir), "resume_from_checkpoint: \"", dir, "\" is not a directory");
  for (const char* file :
       {"config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json", "rng_state.json"})
    FT_CHECK(fs::exists(fs::path(dir) / file), "resume_from_checkpoint: \"", dir, "\" has no ", file,
             " (not a fusetrain checkpoint)");
  load_checkpoint_weights(model_, dir);
  io::SafetensorsFile optimizer = io::SafetensorsFile::open((fs::path(dir) / "optimizer.safetensors").string());
  const int64_t n = model_.params().flat_numel();
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    Tensor t = optimizer.tensor(name);
    FT_CHECK(t.dtype() == DType::f32 && t.numel() == n, optimizer.path(), ": \"", name, "\" has ", t.numel(),
             " elements, the model has ", n);
    float* dest = std::string(name) == "exp_avg" ? impl_->optimizer->exp_avg() : impl_->optimizer->exp_avg_sq();
    std::copy_n(t.data_as<float>(), n, dest);
  }
  impl_->optimizer->set_step_count(std::stoll(optimizer.metadata().at("step")));
  int64_t max_steps = state_.max_steps;
  state_ = TrainerState::from_json(io::read_json_file((fs::path(dir) / "trainer_state.json").string()));
  state_.max_steps = max_steps;
  nlohmann::json rng = io::read_json_file((fs::path(dir) / "rng_state.json").string());
  model_.set_rng_step(rng.at("dropout_step").get<uint64_t>());
  if (args_.fp16 && fs::exists(fs::path(dir) / "scaler.json"))
    impl_->scaler.load_json(io::read_json_file((fs::path(dir) / "scaler.json").string()));
}

void Trainer::rotate_checkpoints() {
  if (!args_.save_total_limit) return;
  std::vector<std::pair<int64_t, fs::path>> checkpoints;
  const std::regex pattern("checkpoint-([0-9]+)");
  for (const auto& entry : fs::directory_iterator(args_.output_dir)) {
    std::smatch m;
    std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, pattern))
      checkpoints.emplace_back(std::stoll(m[1]), entry.path());
  }
  std::sort(checkpoints.begin(), checkpoints.end());
  int64_t excess = static_cast<int64_t>(checkpoints.size()) - *args_.save_total_limit;
  for (const auto& [step, path] : checkpoints) {
    if (excess <= 0) break;
    if (state_.best_model_checkpoint && fs::path(*state_.best_model_checkpoint) == path) continue;
    fs::remove_all(path);
    --excess;
  }
}

}  // namespace fusetrain::train
