// The optimizers besides AdamW, and the choice of one by transformers' `optim` name. Each update follows the order of
// operations of the implementation it reproduces (torch.optim's single-tensor loops, bitsandbytes' CPU kernels), in
// f32, one pass over each run of the flat buffers.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <functional>
#include <cmath>
#include <set>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/optim/optimizer.h"
#include "optim/loops.h"

namespace fusetrain::optim {
namespace {

const std::vector<std::string> kAdamW = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla",
                                         "adamw_apex_fused"};
const std::vector<std::string> kLion = {"lion_32bit", "paged_lion_32bit"};
const std::vector<std::string> kBnbRmsprop = {"rmsprop_bnb", "rmsprop_32bit", "paged_rmsprop_32bit"};

bool one_of(const std::string& name, const std::vector<std::string>& names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

float sign(float u) { return static_cast<float>((u > 0.0f) - (u < 0.0f)); }

void check_range(bool ok, const char* optimizer, const char* what, double value, const char* range) {
  FT_CHECK(ok, optimizer, ": ", what, " must be ", range, ", found ", value);
}

}  // namespace

Sgd::Sgd(runtime::ParameterStore& params, SgdConfig config, Shard shard)
    : Optimizer(params, std::move(shard), config.lr), config_(config) {
  check_range(config.momentum >= 0, "SGD", "momentum", config.momentum, ">= 0");
  check_range(config.weight_decay >= 0, "SGD", "weight_decay", config.weight_decay, ">= 0");
  FT_CHECK(!config.nesterov || (config.momentum > 0 && config.dampening == 0),
           "SGD: nesterov needs momentum > 0 and dampening == 0");
  if (config.momentum != 0) b_ = allocate_state();
}

std::vector<StateBuffer> Sgd::states() const {
  if (!b_) return {};
  return {{"momentum_buffer", DType::f32, momentum_buffer(), shard_numel()}};
}

void Sgd::update(double grad_scale, double lr) {
  const float lr_f = static_cast<float>(lr), mu = static_cast<float>(config_.momentum);
  const float damp = static_cast<float>(1.0 - config_.dampening), wd = static_cast<float>(config_.weight_decay);
  const float scale = static_cast<float>(grad_scale);
  const bool first = step_count() == 1, use_momentum = config_.momentum != 0, nesterov = config_.nesterov;
  float* b = momentum_buffer();
  const int n = threads();
  for_each_run([&](const Run& r) {
    const float run_wd = r.decay ? wd : 0.0f;
    float* p = r.p;
    float* g = r.g;
    const bool zero = r.zero;
    for_range(r.begin, r.end, n, [&](int64_t i) {
      float grad = g[i] * scale + run_wd * p[i];
      if (zero) g[i] = 0.0f;
      if (use_momentum) {
        const float buf = first ? grad : mu * b[i] + damp * grad;
        b[i] = buf;
        grad = nesterov ? grad + mu * buf : buf;
      }
      p[i] -= lr_f * grad;
    });
  });
}

Rmsprop::Rmsprop(runtime::ParameterStore& params, RmspropConfig config, Shard shard, std::string name)
    : Optimizer(params, std::move(shard), config.lr), config_(config), name_(std::move(name)),
      square_avg_(allocate_state()) {
  check_range(config.alpha >= 0 && config.alpha <= 1, "RMSprop", "alpha", config.alpha, "in [0, 1]");
  check_range(config.eps >= 0, "RMSprop", "eps", config.eps, ">= 0");
  check_range(config.momentum >= 0, "RMSprop", "momentum", config.momentum, ">= 0");
  check_range(config.weight_decay >= 0, "RMSprop", "weight_decay", config.weight_decay, ">= 0");
  if (config.momentum > 0) momentum_ = allocate_state();
  if (config.centered) grad_avg_ = allocate_state();
}

std::vector<StateBuffer> Rmsprop::states() const {
  // bitsandbytes' RMSprop keeps its one state as state1.
  const bool bnb = one_of(name_, kBnbRmsprop);
  std::vector<StateBuffer> out{{bnb ? "state1" : "square_avg", DType::f32, square_avg_.get(), shard_numel()}};
  if (momentum_) out.push_back({"momentum_buffer", DType::f32, momentum_.get(), shard_numel()});
  if (grad_avg_) out.push_back({"grad_avg", DType::f32, grad_avg_.get(), shard_numel()});
  return out;
}

void Rmsprop::update(double grad_scale, double lr) {
  const float scale = static_cast<float>(grad_scale), wd = static_cast<float>(config_.weight_decay);
  const float alpha = static_cast<float>(config_.alpha), one_minus_alpha = static_cast<float>(1.0 - config_.alpha);
  const float eps = static_cast<float>(config_.eps), mu = static_cast<float>(config_.momentum);
  const float neg_lr = static_cast<float>(-lr);
  float* sq = static_cast<float*>(square_avg_.get());
  float* buf = static_cast<float*>(momentum_.get());
  float* ga = static_cast<float*>(grad_avg_.get());
  const bool centered = ga != nullptr, momentum = buf != nullptr;
  const int n = threads();
  for_each_run([&](const Run& r) {
    const float run_wd = r.decay ? wd : 0.0f;
    float* p = r.p;
    float* g = r.g;
    const bool zero = r.zero;
    for_range(r.begin, r.end, n, [&](int64_t i) {
      float grad = g[i] * scale;
      if (zero) g[i] = 0.0f;
      if (run_wd != 0.0f) grad = grad + run_wd * p[i];
      const float s = sq[i] * alpha + one_minus_alpha * grad * grad;
      sq[i] = s;
      float avg;
      if (centered) {
        const float m = ga[i] + one_minus_alpha * (grad - ga[i]);  // torch's lerp for a weight below 0.5
        ga[i] = m;
        avg = std::sqrt(s + -1.0f * m * m);
      } else {
        avg = std::sqrt(s);
      }
      avg = avg + eps;
      if (momentum) {
        const float bi = buf[i] * mu + grad / avg;
        buf[i] = bi;
        p[i] = p[i] + neg_lr * bi;
      } else {
        p[i] = p[i] + neg_lr * (grad / avg);
      }
    });
  });
}

Adagrad::Adagrad(runtime::ParameterStore& params, AdagradConfig config, Shard shard)
    : Optimizer(params, std::move(shard), config.lr), config_(config), sum_(allocate_state()) {
  check_range(config.lr_decay >= 0, "Adagrad", "lr_decay", config.lr_decay, ">= 0");
  check_range(config.eps >= 0, "Adagrad", "eps", config.eps, ">= 0");
  check_range(config.weight_decay >= 0, "Adagrad", "weight_decay", config.weight_decay, ">= 0");
  check_range(config.initial_accumulator_value >= 0, "Adagrad", "initial_accumulator_value",
              config.initial_accumulator_value, ">= 0");
  std::fill_n(static_cast<float*>(sum_.get()), shard_numel(), static_cast<float>(config.initial_accumulator_value));
}

std::vector<StateBuffer> Adagrad::states() const { return {{"sum", DType::f32, sum_.get(), shard_numel()}}; }

void Adagrad::update(double grad_scale, double lr) {
  const float scale = static_cast<float>(grad_scale), wd = static_cast<float>(config_.weight_decay);
  const float eps = static_cast<float>(config_.eps);
  const float neg_clr = static_cast<float>(-(lr / (1.0 + static_cast<double>(step_count() - 1) * config_.lr_decay)));
  float* sum = static_cast<float*>(sum_.get());
  const int n = threads();
  for_each_run([&](const Run& r) {
    const float run_wd = r.decay ? wd : 0.0f;
    float* p = r.p;
    float* g = r.g;
    const bool zero = r.zero;
    for_range(r.begin, r.end, n, [&](int64_t i) {
      float grad = g[i] * scale;
      if (zero) g[i] = 0.0f;
      if (run_wd != 0.0f) grad = grad + run_wd * p[i];
      const float s = sum[i] + grad * grad;
      sum[i] = s;
      p[i] = p[i] + neg_clr * (grad / (std::sqrt(s) + eps));
    });
  });
}

Lion::Lion(runtime::ParameterStore& params, LionConfig config, Shard shard, std::string name)
    : Optimizer(params, std::move(shard), config.lr), config_(config), name_(std::move(name)), m_(allocate_state()) {
  FT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "Lion: betas must be in [0, 1), found (", config.beta1, ", ", config.beta2, ")");
  check_range(config.weight_decay >= 0, "Lion", "weight_decay", config.weight_decay, ">= 0");
}

std::vector<StateBuffer> Lion::states() const { return {{"state1", DType::f32, m_.get(), shard_numel()}}; }

void Lion::update(double grad_scale, double lr) {
  const float scale = static_cast<float>(grad_scale), decay = static_cast<float>(1.0 - lr * config_.weight_decay);
  const float b1 = static_cast<float>(config_.beta1), one_minus_b1 = static_cast<float>(1.0 - config_.beta1);
  const float b2 = static_cast<float>(config_.beta2), one_minus_b2 = static_cast<float>(1.0 - config_.beta2);
  const float neg_lr = static_cast<float>(-lr);
  const bool decays = config_.weight_decay > 0;
  float* m = static_cast<float*>(m_.get());
  const int n = threads();
  for_each_run([&](const Run& r) {
    const float run_decay = r.decay && decays ? decay : 1.0f;
    float* p = r.p;
    float* g = r.g;
    const bool zero = r.zero;
    for_range(r.begin, r.end, n, [&](int64_t i) {
      const float grad = g[i] * scale;
      if (zero) g[i] = 0.0f;
      const float u = m[i] * b1 + one_minus_b1 * grad;
      p[i] = p[i] * run_decay + neg_lr * sign(u);
      m[i] = m[i] * b2 + one_minus_b2 * grad;
    });
  });
}

// ------------------------------------------------------------------ choosing one by transformers' name

namespace {

// One optimizer's optim_args, read as transformers' handlers read them; every key must be taken.
class Options {
 public:
  Options(const std::string& optimizer, const std::map<std::string, std::string>& options)
      : optimizer_(optimizer), options_(options) {}

  double number(const std::string& key, double fallback) {
    const auto it = take(key);
    if (it == options_.end()) return fallback;
    const std::string& text = it->second;
    double value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    FT_CHECK(ec == std::errc() && end == text.data() + text.size() && std::isfinite(value), "optim_args: ", key,
             "=", text, " is not a finite number (optim ", optimizer_, ")");
    return value;
  }
  // transformers reads "true", "1" and "yes" (any case) as true, anything else as false.
  bool flag(const std::string& key, bool fallback) {
    const auto it = take(key);
    if (it == options_.end()) return fallback;
    std::string text = it->second;
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return text == "true" || text == "1" || text == "yes";
  }
  // A key transformers accepts but the parameter groups override (weight_decay: the groups carry their own).
  void ignore(const std::string& key) { take(key); }
  void check_all_taken() const {
    std::string left;
    for (const auto& [key, value] : options_)
      if (!taken_.count(key)) left += (left.empty() ? "" : ", ") + key;
    std::string known;
    for (const std::string& key : taken_keys_) known += (known.empty() ? "" : ", ") + key;
    FT_CHECK(left.empty(), "optim_args: optim ", optimizer_, " takes ", known.empty() ? "no options" : known,
             ", found ", left);
  }

 private:
  std::map<std::string, std::string>::const_iterator take(const std::string& key) {
    taken_keys_.push_back(key);
    taken_.insert(key);
    return options_.find(key);
  }
  std::string optimizer_;
  const std::map<std::string, std::string>& options_;
  std::set<std::string> taken_;
  std::vector<std::string> taken_keys_;
};


}  // namespace

std::vector<std::string> optimizer_names() {
  std::vector<std::string> names = kAdamW;
  for (const char* name : {"sgd", "rmsprop", "adagrad"}) names.push_back(name);
  names.insert(names.end(), kLion.begin(), kLion.end());
  names.insert(names.end(), kBnbRmsprop.begin(), kBnbRmsprop.end());
  return names;
}

std::map<std::string, std::string> parse_optim_args(const std::string& text) {
  std::map<std::string, std::string> out;
  std::string compact;
  for (char c : text)
    if (c != ' ') compact += c;
  if (compact.empty()) return out;
  size_t at = 0;
  while (at <= compact.size()) {
    const size_t comma = std::min(compact.find(',', at), compact.size());
    const std::string entry = compact.substr(at, comma - at);
    const size_t eq = entry.find('=');
    FT_CHECK(eq != std::string::npos && eq > 0 && entry.find('=', eq + 1) == std::string::npos, "optim_args: \"",
             entry, "\" is not key=value (optim_args is \"key=value,key=value\", found \"", text, "\")");
    out[entry.substr(0, eq)] = entry.substr(eq + 1);
    at = comma + 1;
  }
  return out;
}

namespace {

// make_optimizer, or with no store only the checks of the name and options (check_optimizer).
std::unique_ptr<Optimizer> build(runtime::ParameterStore* params, const OptimizerSpec& spec, Shard shard) {
  const std::string& name = spec.name;
  Options options(name, spec.options);
  std::function<std::unique_ptr<Optimizer>()> make;
  if (one_of(name, kAdamW)) {
    const AdamWConfig c{spec.lr, spec.beta1, spec.beta2, spec.eps, spec.weight_decay};
    make = [&, c] { return std::make_unique<AdamW>(*params, c, std::move(shard)); };
  } else if (name == "sgd") {
    SgdConfig c{.lr = spec.lr, .weight_decay = spec.weight_decay};
    c.momentum = options.number("momentum", 0.0);
    c.dampening = options.number("dampening", 0.0);
    c.nesterov = options.flag("nesterov", false);
    options.ignore("weight_decay");
    make = [&, c] { return std::make_unique<Sgd>(*params, c, std::move(shard)); };
  } else if (name == "rmsprop") {
    RmspropConfig c{.lr = spec.lr, .weight_decay = spec.weight_decay};
    c.momentum = options.number("momentum", 0.0);
    c.alpha = options.number("alpha", 0.99);
    c.eps = options.number("eps", 1e-8);
    c.centered = options.flag("centered", false);
    options.ignore("weight_decay");
    make = [&, c] { return std::make_unique<Rmsprop>(*params, c, std::move(shard)); };
  } else if (one_of(name, kBnbRmsprop)) {
    const RmspropConfig c{.lr = spec.lr, .weight_decay = spec.weight_decay};
    make = [&, c] { return std::make_unique<Rmsprop>(*params, c, std::move(shard), name); };
  } else if (name == "adagrad") {
    AdagradConfig c{.lr = spec.lr, .weight_decay = spec.weight_decay};
    c.lr_decay = options.number("lr_decay", 0.0);
    c.eps = options.number("eps", 1e-10);
    options.ignore("weight_decay");
    make = [&, c] { return std::make_unique<Adagrad>(*params, c, std::move(shard)); };
  } else if (one_of(name, kLion)) {
    const LionConfig c{spec.lr, spec.beta1, spec.beta2, spec.weight_decay};
    make = [&, c] { return std::make_unique<Lion>(*params, c, std::move(shard), name); };
  } else {
    std::string known;
    for (const std::string& n : optimizer_names()) known += (known.empty() ? "" : ", ") + n;
    throw Error(str("optim: the engine runs ", known, "; found \"", name, "\""));
  }
  options.check_all_taken();
  return params ? make() : nullptr;
}

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(runtime::ParameterStore& params, const OptimizerSpec& spec, Shard shard) {
  return build(&params, spec, std::move(shard));
}

void check_optimizer(const OptimizerSpec& spec) { build(nullptr, spec, {}); }

}  // namespace fusetrain::optim
