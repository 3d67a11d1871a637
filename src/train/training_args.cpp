#include "fusetrain/train/training_args.h"

#include <algorithm>
#include <set>

#include "fusetrain/core/error.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/train/schedule.h"

namespace fusetrain::train {
namespace {

template <typename T>
void write(nlohmann::json& j, const char* name, const T& v) {
  j[name] = v;
}
template <typename T>
void write(nlohmann::json& j, const char* name, const std::optional<T>& v) {
  if (v)
    j[name] = *v;
  else
    j[name] = nullptr;
}

template <typename T>
void read(const nlohmann::json& j, const char* name, T& out) {
  if (!j.contains(name)) return;
  const nlohmann::json& v = j[name];
  try {
    if constexpr (std::is_same_v<T, bool>) {
      FT_CHECK(v.is_boolean(), "expected true or false");
      out = v.get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
      FT_CHECK(v.is_number_integer(), "expected an integer");
      out = v.get<T>();
    } else if constexpr (std::is_floating_point_v<T>) {
      FT_CHECK(v.is_number(), "expected a number");
      out = v.get<T>();
    } else {
      FT_CHECK(v.is_string(), "expected a string");
      out = v.get<T>();
    }
  } catch (const Error& e) {
    throw Error(str("TrainingArguments.", name, ": ", e.what(), ", found ", v.dump()));
  }
}
template <typename T>
void read(const nlohmann::json& j, const char* name, std::optional<T>& out) {
  if (!j.contains(name)) return;
  if (j[name].is_null()) {
    out.reset();
    return;
  }
  T value{};
  read(j, name, value);
  out = value;
}

}  // namespace

void TrainingArguments::validate() const {
  auto positive = [](const char* name, int64_t v) {
    FT_CHECK(v > 0, "TrainingArguments.", name, " must be > 0, found ", v);
  };
  FT_CHECK(!output_dir.empty(), "TrainingArguments.output_dir is empty");
  positive("per_device_train_batch_size", per_device_train_batch_size);
  positive("per_device_eval_batch_size", per_device_eval_batch_size);
  positive("gradient_accumulation_steps", gradient_accumulation_steps);
  positive("logging_steps", logging_steps);
  FT_CHECK(learning_rate >= 0, "TrainingArguments.learning_rate must be >= 0, found ", learning_rate);
  FT_CHECK(weight_decay >= 0, "TrainingArguments.weight_decay must be >= 0, found ", weight_decay);
  FT_CHECK(adam_beta1 >= 0 && adam_beta1 < 1, "TrainingArguments.adam_beta1 must be in [0, 1), found ", adam_beta1);
  FT_CHECK(adam_beta2 >= 0 && adam_beta2 < 1, "TrainingArguments.adam_beta2 must be in [0, 1), found ", adam_beta2);
  FT_CHECK(adam_epsilon >= 0, "TrainingArguments.adam_epsilon must be >= 0, found ", adam_epsilon);
  FT_CHECK(max_grad_norm >= 0, "TrainingArguments.max_grad_norm must be >= 0, found ", max_grad_norm);
  optim::check_optimizer({optim, learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon,
                          optim::parse_optim_args(optim_args)});
  FT_CHECK(num_train_epochs > 0 || max_steps > 0, "TrainingArguments: num_train_epochs must be > 0 (found ",
           num_train_epochs, ") unless max_steps > 0");
  FT_CHECK(warmup_steps >= 0, "TrainingArguments.warmup_steps must be >= 0, found ", warmup_steps);
  FT_CHECK(warmup_ratio >= 0 && warmup_ratio <= 1, "TrainingArguments.warmup_ratio must be in [0, 1], found ",
           warmup_ratio);
  parse_lr_schedule(lr_scheduler_type);
  FT_CHECK(train_sampling_strategy == "random" || train_sampling_strategy == "sequential" ||
               train_sampling_strategy == "group_by_length",
           "train_sampling_strategy must be \"random\", \"sequential\" or \"group_by_length\", got \"",
           train_sampling_strategy, "\"");
  FT_CHECK(eval_strategy == "no" || eval_strategy == "steps" || eval_strategy == "epoch",
           "TrainingArguments.eval_strategy must be no, steps or epoch, found \"", eval_strategy, "\"");
  FT_CHECK(save_strategy == "no" || save_strategy == "steps" || save_strategy == "epoch" || save_strategy == "best",
           "TrainingArguments.save_strategy must be no, steps, epoch or best, found \"", save_strategy, "\"");
  if (eval_steps) positive("eval_steps", *eval_steps);
  if (save_strategy == "steps") positive("save_steps", save_steps);
  if (save_total_limit) positive("save_total_limit", *save_total_limit);
  if (load_best_model_at_end)
    FT_CHECK(eval_strategy != "no" && (save_strategy == eval_strategy || save_strategy == "best"),
             "TrainingArguments.load_best_model_at_end needs eval_strategy and save_strategy to match (found \"",
             eval_strategy, "\" and \"", save_strategy, "\")");
  FT_CHECK(!(bf16 && fp16), "TrainingArguments: bf16 and fp16 are both set; choose one");
  FT_CHECK(early_stopping_patience >= 0, "TrainingArguments.early_stopping_patience must be >= 0");
  FT_CHECK(early_stopping_patience == 0 || eval_strategy != "no",
           "TrainingArguments.early_stopping_patience needs an eval_strategy other than \"no\"");
  FT_CHECK(fusetrain_threads >= 0, "TrainingArguments.fusetrain_threads must be >= 0");
  positive("fusetrain_max_nonfinite_steps", fusetrain_max_nonfinite_steps);
  positive("ddp_bucket_cap_mb", ddp_bucket_cap_mb);
  FT_CHECK(zero_stage >= 0 && zero_stage <= 2, "TrainingArguments.zero_stage is ", zero_stage,
           "; expected 0 (DDP), 1 or 2 (ZeRO stage 3, sharded parameters, is not supported)");
}

std::string TrainingArguments::effective_metric() const {
  std::string m = metric_for_best_model.value_or("loss");
  return m.rfind("eval_", 0) == 0 ? m : "eval_" + m;
}

bool TrainingArguments::effective_greater_is_better() const {
  if (greater_is_better) return *greater_is_better;
  std::string m = effective_metric();
  return !(m == "eval_loss" || m.find("loss") != std::string::npos || m.find("perplexity") != std::string::npos);
}

nlohmann::json TrainingArguments::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for_each_field(*this, [&](const char* name, const auto& field, const char*) { write(j, name, field); });
  return j;
}

TrainingArguments TrainingArguments::from_json(const nlohmann::json& json) {
  FT_CHECK(json.is_object(), "TrainingArguments: expected a JSON object");
  TrainingArguments args;
  std::set<std::string> known;
  for_each_field(args, [&](const char* name, auto& field, const char*) {
    known.insert(name);
    read(json, name, field);
  });
  std::string unknown;
  for (auto it = json.begin(); it != json.end(); ++it)
    if (!known.count(it.key())) unknown += (unknown.empty() ? "" : ", ") + it.key();
  FT_CHECK(unknown.empty(), "TrainingArguments: unsupported fields: ", unknown);
  return args;
}

}  // namespace fusetrain::train
