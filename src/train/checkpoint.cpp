// Checkpoints: output_dir/checkpoint-N/ holds config.json + model.safetensors
// (transformers' layout), optimizer.safetensors (the optimizer's states), scheduler.json,
// rng_state.json, trainer_state.json (transformers' format), training_args.json and,
// for fp16 runs, scaler.json (the loss scale). Everything is written into a staging directory that is
// renamed into place, so an interrupted save never damages an earlier checkpoint.
#include "train/checkpoint.h"

#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "fusetrain/core/error.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/json_fields.h"
#include "fusetrain/io/safetensors.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/train/trainer.h"
#include "train/trainer_impl.h"

namespace fusetrain::train {

namespace fs = std::filesystem;

void load_checkpoint_weights(models::Model& model, const std::string& dir) {
  if (model.lora()) {  // a LoRA run's checkpoints hold its adapters (PEFT's format)
    model.load_adapter(dir);
    return;
  }
  io::HfModelDir hf = io::read_hf_dir(dir);
  std::map<std::string, Tensor> tensors;
  for (const std::string& name : hf.tensor_names()) tensors[name] = hf.tensor(name);
  try {
    model.load_state_dict(tensors, /*strict=*/true);
  } catch (const Error& e) {
    throw Error(str(dir, ": ", e.what()));
  }
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

TrainerState TrainerState::from_json(const nlohmann::json& j, const std::string& file) {
  TrainerState s;
  io::JsonFields fields(j, file);
  s.global_step = fields.integer("global_step", 0);
  s.epoch = fields.optional_number("epoch", 0.0).value_or(0.0);
  s.max_steps = fields.optional_integer("max_steps", 0).value_or(0);
  s.best_metric = fields.optional_number("best_metric");
  s.best_model_checkpoint = fields.optional_string("best_model_checkpoint");
  if (fields.has("log_history")) {
    FT_CHECK(j["log_history"].is_array(), file, ": \"log_history\" should be an array, found a JSON ",
             j["log_history"].type_name());
    s.log_history = j["log_history"];
  }
  return s;
}

void remove_unfinished_saves(const std::string& output_dir) {
  std::error_code error;
  if (!fs::is_directory(output_dir, error)) return;
  // A staging directory ".checkpoint-N.tmp-PID", or a file "NAME.tmp-PID" of write_file_atomic, whose process is gone.
  const std::regex staged(R"((\.checkpoint-[0-9]+|.+)\.tmp-([0-9]+))");
  const std::regex replaced(R"((checkpoint-[0-9]+)\.old)");
  std::vector<std::string> removed;
  for (const auto& entry : fs::directory_iterator(output_dir, error)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (std::regex_match(name, m, staged)) {
      const pid_t pid = static_cast<pid_t>(std::stoll(m[2]));
      if (pid == getpid() || ::kill(pid, 0) == 0 || errno == EPERM) continue;  // its writer may still be running
      fs::remove_all(entry.path(), error);
      removed.push_back(name);
    } else if (std::regex_match(name, m, replaced)) {
      // commit_directory stopped between its two renames: the older checkpoint goes back under its name unless the
      // newer one is already there.
      const fs::path final_dir = fs::path(output_dir) / m[1].str();
      if (fs::exists(final_dir, error))
        fs::remove_all(entry.path(), error);
      else
        fs::rename(entry.path(), final_dir, error);
      removed.push_back(name);
    }
  }
  if (!removed.empty())
    std::fprintf(stderr, "fusetrain: %s: cleaned up after an interrupted save: %s\n", output_dir.c_str(),
                 join(removed).c_str());
}

std::string Trainer::save_checkpoint() {
  if (comm_->rank() != 0) {
    if (impl_->sync && impl_->sync->zero_stage() > 0)  // rank 0 writes this rank's shard of the states
      for (const optim::StateBuffer& b : impl_->optimizer->states())
        if (b.per_slot.empty())  // a per-parameter state is whole on every rank: rank 0 writes its own
          comm_->send(b.data, b.numel * static_cast<int64_t>(dtype_size(b.dtype)), 0);
    return (fs::path(args_.output_dir) / ("checkpoint-" + std::to_string(state_.global_step))).string();
  }
  fs::create_directories(args_.output_dir);
  const std::string name = "checkpoint-" + std::to_string(state_.global_step);
  const fs::path final_dir = fs::path(args_.output_dir) / name;
  const fs::path staged = fs::path(args_.output_dir) / ("." + name + ".tmp-" + std::to_string(getpid()));
  fs::remove_all(staged);
  fs::create_directories(staged);
  try {
    write_checkpoint(staged);
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(staged, ignored);  // a failed save leaves nothing behind; earlier checkpoints are untouched
    throw Error(str(final_dir.string(), " was not saved (earlier checkpoints are intact): ", e.what()));
  }
  commit_directory(staged.string(), final_dir.string());
  for (const auto& c : callbacks_) c->on_save(state_, control_, final_dir.string());
  return final_dir.string();
}

void Trainer::write_checkpoint(const std::filesystem::path& staged) {
  model_.save_pretrained(staged.string());
  maybe_fault_during_save(state_.global_step);
  write_optimizer_state(staged);
  write_json(staged / "scheduler.json", nlohmann::json{{"last_epoch", state_.global_step},
                                                       {"nonfinite_skipped_steps", impl_->nonfinite_skipped_steps},
                                                       {"type", args_.lr_scheduler_type},
                                                       {"warmup_steps", impl_->warmup}});
  // world_size: the global batch a resume must keep (per_device_train_batch_size x ranks) to continue the data order.
  write_json(staged / "rng_state.json", nlohmann::json{{"dropout_step", model_.rng_step()},
                                                       {"seed", args_.seed},
                                                       {"world_size", comm_->size()}});
  if (args_.fp16) write_json(staged / "scaler.json", impl_->scaler.to_json());
  TrainerState saved = state_;
  write_json(staged / "trainer_state.json", saved.to_json(args_));
  write_json(staged / "training_args.json", args_.to_json());
  for (const std::string& file : checkpoint_files_)
    io::copy_file_atomic(file, (staged / fs::path(file).filename()).string());
}

namespace {

// ZeRO checkpoints hold the AdamW moments by shard: optimizer-shard-R-of-N.safetensors, elements [begin, end) of the
// flat buffers (metadata), instead of one optimizer.safetensors.
std::string shard_file_name(int rank, int world) {
  return str("optimizer-shard-", rank, "-of-", world, ".safetensors");
}

// The optimizer files of a checkpoint: optimizer.safetensors, or every shard file of one world size.
std::vector<fs::path> optimizer_files(const fs::path& dir) {
  if (fs::exists(dir / "optimizer.safetensors")) return {dir / "optimizer.safetensors"};
  const std::regex pattern("optimizer-shard-([0-9]+)-of-([0-9]+)\\.safetensors");
  int world = -1;
  std::vector<int> ranks;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, pattern)) continue;
    const int w = std::stoi(m[2]);
    FT_CHECK(world < 0 || world == w, dir.string(), " holds optimizer shards of ", world, " and of ", w,
             " ranks; a checkpoint has the shards of one job");
    world = w;
    ranks.push_back(std::stoi(m[1]));
  }
  FT_CHECK(world > 0, "resume_from_checkpoint: \"", dir.string(),
           "\" has no optimizer.safetensors and no optimizer-shard-*-of-*.safetensors (not a fusetrain checkpoint)");
  std::sort(ranks.begin(), ranks.end());
  std::vector<fs::path> files;
  for (int r = 0; r < world; ++r) {
    FT_CHECK(std::binary_search(ranks.begin(), ranks.end(), r), dir.string(), " lacks ", shard_file_name(r, world),
             ": the optimizer state of ", world, " ranks is incomplete");
    files.push_back(dir / shard_file_name(r, world));
  }
  return files;
}

// The integer metadata `key` of `file`, which must lie in [low, high]; `meaning` says what it counts.
int64_t metadata_integer(const io::SafetensorsFile& file, const char* key, const char* meaning, int64_t low,
                         int64_t high) {
  const auto it = file.metadata().find(key);
  int64_t value = -1;
  bool ok = it != file.metadata().end();
  if (ok) {
    const std::string& text = it->second;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    ok = ec == std::errc() && end == text.data() + text.size() && value >= low && value <= high;
  }
  FT_CHECK(ok, file.path(), ": the metadata \"", key, "\" (", meaning, ") should be an integer in [", low, ", ", high,
           "], found ",
           it == file.metadata().end() ? std::string("none") : "\"" + it->second + "\"");
  return value;
}

// A shard file's "segments" metadata: [[begin, end], ...] within the model's n elements.
std::vector<optim::Segment> metadata_segments(const io::SafetensorsFile& file, int64_t n) {
  const auto it = file.metadata().find("segments");
  std::vector<optim::Segment> segments;
  bool ok = it != file.metadata().end();
  if (ok) {
    const nlohmann::json json = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
    ok = json.is_array();
    for (const auto& pair : ok ? json : nlohmann::json::array()) {
      ok = ok && pair.is_array() && pair.size() == 2 && pair[0].is_number_integer() && pair[1].is_number_integer();
      if (!ok) break;
      const optim::Segment s{pair[0].get<int64_t>(), pair[1].get<int64_t>()};
      ok = s.begin >= 0 && s.begin <= s.end && s.end <= n;
      segments.push_back(s);
    }
  }
  FT_CHECK(ok, file.path(), ": the metadata \"segments\" should be a JSON list of [begin, end] element ranges within ",
           "the model's ", n, ", found ", it == file.metadata().end() ? std::string("none") : it->second);
  return segments;
}

}  // namespace

void Trainer::write_optimizer_state(const fs::path& staged) {
  const optim::Optimizer& opt = *impl_->optimizer;
  const std::map<std::string, std::string> metadata{{"step", std::to_string(opt.step_count())},
                                                    {"optimizer", opt.name()},
                                                    {"run", impl_->run_id}};
  const std::vector<optim::StateBuffer> states = opt.states();
  // This rank's states in host memory: views on a host-visible device, downloaded copies elsewhere.
  const kernels::Device& device = model_.params().device();
  std::vector<std::vector<uint8_t>> copies;
  auto host_data = [&](const optim::StateBuffer& b) -> void* {
    if (device.host_visible()) return b.data;
    copies.emplace_back(static_cast<size_t>(b.numel) * dtype_size(b.dtype));
    device.download(copies.back().data(), b.data, copies.back().size());
    return copies.back().data();
  };
  if (!impl_->sync || impl_->sync->zero_stage() == 0) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const optim::StateBuffer& b : states)
      tensors.emplace_back(b.name, Tensor::view(host_data(b), Shape{b.numel}, b.dtype));
    io::save_safetensors((staged / "optimizer.safetensors").string(), tensors, metadata);
    return;
  }
  // Rank 0 receives the other ranks' shards one at a time (no rank ever holds more than two shards).
  const int world = comm_->size();
  std::vector<std::vector<uint8_t>> received(states.size());
  for (int r = 0; r < world; ++r) {
    const std::vector<optim::Segment> segments = shard_segments(impl_->sync->buckets(), r, world);
    int64_t numel = 0;
    nlohmann::json ranges = nlohmann::json::array();
    for (const optim::Segment& s : segments) {
      numel += s.end - s.begin;
      ranges.push_back({s.begin, s.end});
    }
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (size_t k = 0; k < states.size(); ++k) {
      void* data = r == 0 ? host_data(states[k]) : nullptr;
      if (!states[k].per_slot.empty()) {  // whole on every rank (Adafactor's factored moments): in shard 0 only
        if (r == 0) tensors.emplace_back(states[k].name, Tensor::view(data, Shape{states[k].numel}, states[k].dtype));
        continue;
      }
      if (r > 0) {
        received[k].resize(static_cast<size_t>(numel) * dtype_size(states[k].dtype));
        comm_->recv(received[k].data(), static_cast<int64_t>(received[k].size()), r);
        data = received[k].data();
      }
      tensors.emplace_back(states[k].name, Tensor::view(data, Shape{numel}, states[k].dtype));
    }
    std::map<std::string, std::string> shard_metadata = metadata;
    shard_metadata["segments"] = ranges.dump();
    io::save_safetensors((staged / shard_file_name(r, world)).string(), tensors, shard_metadata);
  }
}

void Trainer::load_checkpoint(const std::string& dir) {
  FT_CHECK(fs::is_directory(dir), "resume_from_checkpoint: \"", dir, "\" is not a directory");
  const bool adapters = model_.lora() != nullptr;
  for (const char* file : {adapters ? "adapter_config.json" : "config.json",
                           adapters ? "adapter_model.safetensors" : "model.safetensors", "trainer_state.json",
                           "rng_state.json"})
    FT_CHECK(fs::exists(fs::path(dir) / file), "resume_from_checkpoint: \"", dir, "\" has no ", file,
             " (not a fusetrain checkpoint)");
  // Every field is read and checked against this run before anything is loaded.
  const std::string state_file = (fs::path(dir) / "trainer_state.json").string();
  TrainerState resumed = TrainerState::from_json(io::read_json_object(state_file), state_file);
  const int64_t step = resumed.global_step;
  // A checkpoint at the run's last step resumes to an immediate end, as in transformers (rerunning a finished
  // script with resume_from_checkpoint=True); one past it belongs to a different run.
  FT_CHECK(step <= state_.max_steps, state_file, ": \"global_step\" is ", step, " but this run ends at step ",
           state_.max_steps, ", so the checkpoint is from a longer run (raise --max-steps or --num-train-epochs to ",
           "continue it)");
  FT_CHECK(resumed.epoch <= static_cast<double>(step), state_file, ": \"epoch\" is ", resumed.epoch,
           ", more than its \"global_step\" ", step, " allows (every epoch has at least one step)");
  const std::string rng_file = (fs::path(dir) / "rng_state.json").string();
  const nlohmann::json rng = io::read_json_file(rng_file);
  const int64_t dropout_step = io::JsonFields(rng, rng_file).integer("dropout_step", 0);
  // The checkpoint's position in the data is in global batches: a resume on another number of ranks must keep the
  // global batch (a 2-rank run with 6 per device resumes on 1 rank with 12 or on 3 with 4).
  const int64_t saved_world = io::JsonFields(rng, rng_file).optional_integer("world_size", 1, 1 << 20).value_or(1);
  const std::string saved_args_file = (fs::path(dir) / "training_args.json").string();
  if (fs::exists(saved_args_file)) {
    const nlohmann::json saved_args = io::read_json_file(saved_args_file);
    const int64_t saved_per_device =
        io::JsonFields(saved_args, saved_args_file).optional_integer("per_device_train_batch_size", 1, 1 << 30)
            .value_or(args_.per_device_train_batch_size);
    const int64_t world = comm_->size();
    FT_CHECK(saved_per_device * saved_world == args_.per_device_train_batch_size * world,
             "resume_from_checkpoint: \"", dir, "\" was trained with a global batch of ", saved_per_device * saved_world,
             " (", saved_per_device, " per device x ", saved_world, " rank", saved_world > 1 ? "s" : "",
             ") but this run's is ", args_.per_device_train_batch_size * world, " (",
             args_.per_device_train_batch_size, " x ", world, "); resume with per_device_train_batch_size x ranks = ",
             saved_per_device * saved_world, " to continue its data order");
  }
  int64_t nonfinite_skipped = 0;
  if (const fs::path scheduler = fs::path(dir) / "scheduler.json"; fs::exists(scheduler)) {
    const nlohmann::json json = io::read_json_file(scheduler.string());
    nonfinite_skipped =
        io::JsonFields(json, scheduler.string()).optional_integer("nonfinite_skipped_steps", 0, step).value_or(0);
  }
  LossScaler scaler = impl_->scaler;
  if (args_.fp16 && fs::exists(fs::path(dir) / "scaler.json")) {
    const std::string scaler_file = (fs::path(dir) / "scaler.json").string();
    scaler.load_json(io::read_json_file(scaler_file), scaler_file, step);
  }
  // The optimizer's states, from one file or from the shards of any world size: each of this optimizer's segments
  // is copied from the file segments that overlap it (ZeRO resumed on a different number of ranks re-shards).
  optim::Optimizer& opt = *impl_->optimizer;
  const std::vector<optim::StateBuffer> buffers = opt.states();
  const int64_t n = model_.params().flat_numel();
  // Each state's bytes as loaded: the shard's elements (elementwise states) or the whole buffer (per parameter).
  std::vector<std::vector<uint8_t>> loaded(buffers.size());
  for (size_t k = 0; k < buffers.size(); ++k)
    loaded[k].resize(static_cast<size_t>(buffers[k].per_slot.empty() ? opt.shard_numel() : buffers[k].numel) *
                     dtype_size(buffers[k].dtype));
  int64_t optimizer_steps = -1;
  std::vector<optim::Segment> all_segments;
  std::string first_file, first_run;  // the run that wrote the first shard: every other shard must name it too
  for (const fs::path& path : optimizer_files(dir)) {
    io::SafetensorsFile optimizer = io::SafetensorsFile::open(path.string());
    const auto saved_by = optimizer.metadata().find("optimizer");
    // Checkpoints from before optimizers had transformers' names say "AdamW".
    const std::string saved = saved_by == optimizer.metadata().end() ? std::string("(none)")
                              : saved_by->second == "AdamW"         ? std::string("adamw_torch")
                                                                    : saved_by->second;
    FT_CHECK(saved == opt.name(), path.string(), ": the optimizer state is ", saved, "'s but this run's optimizer is ",
             opt.name(), "; resume with --optim ", saved, " (or start the optimizer afresh from the weights alone)");
    const int64_t steps = metadata_integer(optimizer, "step", "the optimizer's update count", 0, step);
    FT_CHECK(optimizer_steps < 0 || optimizer_steps == steps, path.string(), ": \"step\" is ", steps,
             " but the other shards have ", optimizer_steps);
    optimizer_steps = steps;
    const auto run = optimizer.metadata().find("run");
    const std::string run_id = run == optimizer.metadata().end() ? std::string("(none)") : run->second;
    if (first_file.empty()) {
      first_file = path.filename().string();
      first_run = run_id;
    }
    FT_CHECK(run_id == first_run, path.string(), ": this shard was written by run ", run_id, " but ", first_file,
             " by run ", first_run, "; the shards of a checkpoint come from one save (this set mixes two runs)");
    const bool sharded = path.filename() != "optimizer.safetensors";
    const std::vector<optim::Segment> segments = sharded ? metadata_segments(optimizer, n)
                                                         : std::vector<optim::Segment>{{0, n}};
    int64_t numel = 0;
    for (const optim::Segment& s : segments) numel += s.end - s.begin;
    all_segments.insert(all_segments.end(), segments.begin(), segments.end());
    for (size_t k = 0; k < buffers.size(); ++k) {
      const char* name = buffers[k].name.c_str();
      // A per-parameter state (Adafactor's factored moments) is saved whole, in the first shard under ZeRO.
      const bool per_slot = !buffers[k].per_slot.empty();
      if (per_slot && sharded && path.filename().string().rfind("optimizer-shard-0-of-", 0) != 0) continue;
      FT_CHECK(optimizer.contains(name), optimizer.path(), ": no \"", name, "\", which ", opt.name(), " keeps");
      Tensor t = optimizer.tensor(name);
      const int64_t want = per_slot ? buffers[k].numel : numel;
      const DType dtype = buffers[k].dtype;
      FT_CHECK(t.dtype() == dtype && t.numel() == want, optimizer.path(), ": \"", name, "\" has ", t.numel(), " ",
               dtype_name(t.dtype()), " elements, ", per_slot ? "the optimizer keeps" : sharded ? "its segments need"
               : "the model needs", " ", want, " ", dtype_name(dtype));
      const int64_t bad = find_nonfinite(t.data(), t.dtype(), t.numel());
      FT_CHECK(bad < 0, optimizer.path(), ": \"", name, "\" holds a non-finite value at element ", bad,
               "; the optimizer state of a diverged run cannot be resumed");
      const uint8_t* bytes = static_cast<const uint8_t*>(t.data());
      const size_t size = dtype_size(dtype);
      std::vector<uint8_t>& into = loaded[k];
      if (per_slot) {
        std::copy_n(bytes, into.size(), into.begin());
        continue;
      }
      int64_t from = 0;
      for (const optim::Segment& s : segments) {
        int64_t to = 0;
        for (const optim::Segment& mine : opt.segments()) {
          const int64_t lo = std::max(s.begin, mine.begin), hi = std::min(s.end, mine.end);
          if (lo < hi)
            std::copy(bytes + (from + (lo - s.begin)) * size, bytes + (from + (hi - s.begin)) * size,
                      into.begin() + (to + (lo - mine.begin)) * size);
          to += mine.end - mine.begin;
        }
        from += s.end - s.begin;
      }
    }
  }
  // The files' segments must tile the parameters exactly once.
  std::sort(all_segments.begin(), all_segments.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
  int64_t covered = 0;
  for (const optim::Segment& s : all_segments) {
    FT_CHECK(s.begin == covered, "resume_from_checkpoint: the optimizer state in \"", dir, "\" ",
             s.begin > covered ? "lacks" : "repeats", " parameter elements at ", std::min(s.begin, covered));
    covered = s.end;
  }
  FT_CHECK(covered == n, "resume_from_checkpoint: the optimizer state in \"", dir, "\" covers ", covered, " of the ",
           n, " parameter elements");

  load_checkpoint_weights(model_, dir);
  for (size_t k = 0; k < buffers.size(); ++k)  // into the Device's memory
    model_.params().device().upload(buffers[k].data, loaded[k].data(), loaded[k].size());
  opt.set_step_count(optimizer_steps);
  resumed.max_steps = state_.max_steps;
  state_ = std::move(resumed);
  model_.set_rng_step(static_cast<uint64_t>(dropout_step));
  impl_->scaler = scaler;
  impl_->nonfinite_skipped_steps = nonfinite_skipped;
  impl_->last_checkpoint = dir;
}

void Trainer::rotate_checkpoints() {
  if (!args_.save_total_limit || comm_->rank() != 0) return;
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
