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
#include "core/loops.h"

namespace fusetrain::optim {
namespace {

const std::vector<std::string> kAdamW = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla",
                                         "adamw_apex_fused"};
const std::vector<std::string> kLion = {"lion_32bit", "paged_lion_32bit"};
const std::vector<std::string> kBnbRmsprop = {"rmsprop_bnb", "rmsprop_32bit", "paged_rmsprop_32bit"};
const std::vector<std::string> kAdamW8bit = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"};

bool one_of(const std::string& name, const std::vector<std::string>& names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

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
  return {elementwise_state("momentum_buffer", momentum_buffer())};
}

void Sgd::update(double grad_scale, double lr) {
  kernels::OptimizerUpdate u = step_update(kernels::OptimizerUpdate::Kind::Sgd, grad_scale, lr);
  u.momentum = static_cast<float>(config_.momentum);
  u.one_minus_dampening = static_cast<float>(1.0 - config_.dampening);
  u.weight_decay = static_cast<float>(config_.weight_decay);
  u.first_step = step_count() == 1;
  u.nesterov = config_.nesterov;
  u.state[0] = momentum_buffer();  // null without momentum
  run_update(u);
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
  std::vector<StateBuffer> out{elementwise_state(bnb ? "state1" : "square_avg", square_avg_.get())};
  if (momentum_) out.push_back(elementwise_state("momentum_buffer", momentum_.get()));
  if (grad_avg_) out.push_back(elementwise_state("grad_avg", grad_avg_.get()));
  return out;
}

void Rmsprop::update(double grad_scale, double lr) {
  kernels::OptimizerUpdate u = step_update(kernels::OptimizerUpdate::Kind::Rmsprop, grad_scale, lr);
  u.weight_decay = static_cast<float>(config_.weight_decay);
  u.beta2 = static_cast<float>(config_.alpha);
  u.one_minus_beta2 = static_cast<float>(1.0 - config_.alpha);
  u.eps = static_cast<float>(config_.eps);
  u.momentum = static_cast<float>(config_.momentum);
  u.state[0] = static_cast<float*>(square_avg_.get());
  u.state[1] = static_cast<float*>(momentum_.get());  // null without momentum
  u.state[2] = static_cast<float*>(grad_avg_.get());  // null unless centered
  run_update(u);
}

Adagrad::Adagrad(runtime::ParameterStore& params, AdagradConfig config, Shard shard)
    : Optimizer(params, std::move(shard), config.lr), config_(config), sum_(allocate_state()) {
  check_range(config.lr_decay >= 0, "Adagrad", "lr_decay", config.lr_decay, ">= 0");
  check_range(config.eps >= 0, "Adagrad", "eps", config.eps, ">= 0");
  check_range(config.weight_decay >= 0, "Adagrad", "weight_decay", config.weight_decay, ">= 0");
  check_range(config.initial_accumulator_value >= 0, "Adagrad", "initial_accumulator_value",
              config.initial_accumulator_value, ">= 0");
  if (config.initial_accumulator_value != 0)  // the buffer is zeroed (and its pages untouched) otherwise
    std::fill_n(static_cast<float*>(sum_.get()), shard_numel(), static_cast<float>(config.initial_accumulator_value));
}

std::vector<StateBuffer> Adagrad::states() const { return {elementwise_state("sum", sum_.get())}; }

void Adagrad::update(double grad_scale, double lr) {
  const double clr = lr / (1.0 + static_cast<double>(step_count() - 1) * config_.lr_decay);
  kernels::OptimizerUpdate u = step_update(kernels::OptimizerUpdate::Kind::Adagrad, grad_scale, clr);
  u.weight_decay = static_cast<float>(config_.weight_decay);
  u.eps = static_cast<float>(config_.eps);
  u.state[0] = static_cast<float*>(sum_.get());
  run_update(u);
}

Lion::Lion(runtime::ParameterStore& params, LionConfig config, Shard shard, std::string name)
    : Optimizer(params, std::move(shard), config.lr), config_(config), name_(std::move(name)), m_(allocate_state()) {
  FT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "Lion: betas must be in [0, 1), found (", config.beta1, ", ", config.beta2, ")");
  check_range(config.weight_decay >= 0, "Lion", "weight_decay", config.weight_decay, ">= 0");
}

std::vector<StateBuffer> Lion::states() const { return {elementwise_state("state1", m_.get())}; }

void Lion::update(double grad_scale, double lr) {
  kernels::OptimizerUpdate u = step_update(kernels::OptimizerUpdate::Kind::Lion, grad_scale, lr);
  u.decay_factor = config_.weight_decay > 0 ? static_cast<float>(1.0 - lr * config_.weight_decay) : 1.0f;
  u.beta1 = static_cast<float>(config_.beta1);
  u.one_minus_beta1 = static_cast<float>(1.0 - config_.beta1);
  u.beta2 = static_cast<float>(config_.beta2);
  u.one_minus_beta2 = static_cast<float>(1.0 - config_.beta2);
  u.state[0] = static_cast<float*>(m_.get());
  run_update(u);
}

namespace {

// A parameter of rank >= 2 as (batch, rows, cols) over its last two axes, as Adafactor factors it.
struct Factored {
  int64_t batch = 1, rows = 1, cols = 1;
};

Factored factored(const Shape& shape) {
  Factored f;
  const int r = static_cast<int>(shape.rank());
  for (int d = 0; d + 2 < r; ++d) f.batch *= shape[d];
  f.rows = shape[r - 2];
  f.cols = shape[r - 1];
  return f;
}

}  // namespace

Adafactor::Adafactor(runtime::ParameterStore& params, AdafactorConfig config, Shard shard)
    : Optimizer(params, std::move(shard), config.lr), config_(config) {
  check_range(config.eps >= 0, "Adafactor", "eps", config.eps, ">= 0");
  check_range(config.clip_threshold > 0, "Adafactor", "clip_threshold", config.clip_threshold, "> 0");
  check_range(config.decay_rate < 0, "Adafactor", "decay_rate", config.decay_rate, "< 0");
  check_range(config.weight_decay >= 0, "Adafactor", "weight_decay", config.weight_decay, ">= 0");
  for (const runtime::ParamSlot& slot : params.slots()) {
    if (slot.shape.rank() >= 2) {
      const Factored f = factored(slot.shape);
      row_at_.push_back(rows_);
      col_at_.push_back(cols_);
      sq_at_.push_back(-1);
      rows_ += f.batch * f.rows;
      cols_ += f.batch * f.cols;
    } else {
      row_at_.push_back(-1);
      col_at_.push_back(-1);
      sq_at_.push_back(squares_);
      squares_ += slot.numel;
    }
  }
  auto buffer = [&](int64_t n, size_t bytes) {  // zeroed, the store's device's memory
    return params.device().allocate(static_cast<size_t>(std::max<int64_t>(n, 1)) * bytes);
  };
  row_ = buffer(rows_, sizeof(float));
  col_ = buffer(cols_, sizeof(float));
  sq_ = buffer(squares_, sizeof(float));
  // The step's scratch, sized once.
  stats_ = buffer(rows_ + cols_ + squares_, sizeof(double));
  factor_rows_ = buffer(rows_, sizeof(float));
  update_squares_ = buffer(static_cast<int64_t>(params.slots().size()), sizeof(double));
}

std::vector<StateBuffer> Adafactor::states() const {
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  std::vector<StateBuffer> out{{"exp_avg_sq_row", DType::f32, row_.get(), rows_, {}, {}},
                               {"exp_avg_sq_col", DType::f32, col_.get(), cols_, {}, {}},
                               {"exp_avg_sq", DType::f32, sq_.get(), squares_, {}, {}}};
  for (size_t i = 0; i < slots.size(); ++i) {
    const Shape& shape = slots[i].shape;
    std::vector<int64_t> dims = shape.dims();
    if (sq_at_[i] >= 0) {
      out[0].per_slot.push_back({-1, Shape{}});
      out[1].per_slot.push_back({-1, Shape{}});
      out[2].per_slot.push_back({sq_at_[i], shape});
    } else {
      std::vector<int64_t> row(dims.begin(), dims.end() - 1), col(dims.begin(), dims.end() - 2);
      col.push_back(dims.back());
      out[0].per_slot.push_back({row_at_[i], Shape(row)});
      out[1].per_slot.push_back({col_at_[i], Shape(col)});
      out[2].per_slot.push_back({-1, Shape{}});
    }
  }
  return out;
}

kernels::AdafactorUpdate Adafactor::slot_update(size_t i, const kernels::AdafactorUpdate& step) const {
  kernels::AdafactorUpdate u = step;
  const runtime::ParamSlot& slot = params_.slots()[i];
  u.numel = slot.numel;
  double* stats = static_cast<double*>(stats_.get());
  u.update_squares = static_cast<double*>(update_squares_.get()) + i;
  if (sq_at_[i] >= 0) {
    u.square = static_cast<float*>(sq_.get()) + sq_at_[i];
    u.new_square = stats + rows_ + cols_ + sq_at_[i];
    return u;
  }
  const Factored f = factored(slot.shape);
  u.batch = f.batch;
  u.rows = f.rows;
  u.cols = f.cols;
  u.row = static_cast<float*>(row_.get()) + row_at_[i];
  u.col = static_cast<float*>(col_.get()) + col_at_[i];
  u.row_sums = stats + row_at_[i];
  u.col_sums = stats + rows_ + col_at_[i];
  u.row_factor = static_cast<float*>(factor_rows_.get()) + row_at_[i];
  return u;
}

void Adafactor::update(double grad_scale, double lr) {
  FT_CHECK(!sharded() || all_reduce_, "Adafactor over a ZeRO shard needs the ranks' sums (set_all_reduce)");
  using Phase = kernels::AdafactorUpdate::Phase;
  const kernels::Device& device = params_.device();
  kernels::StepContext ctx;
  ctx.num_threads = threads();
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  const bool zero = zero_grads_on();
  // The step's constants, the same for every parameter and phase.
  const double beta2t = 1.0 - std::pow(static_cast<double>(step_count()), config_.decay_rate);
  kernels::AdafactorUpdate step;
  step.grad_scale = static_cast<float>(grad_scale);
  step.eps = static_cast<float>(config_.eps);
  step.beta2t = static_cast<float>(beta2t);
  step.one_minus_beta2t = static_cast<float>(1.0 - beta2t);
  step.lr = static_cast<float>(lr);
  step.decay = static_cast<float>(-config_.weight_decay * lr);
  step.clip_threshold = static_cast<float>(config_.clip_threshold);
  // Runs `phase` over each part of every parameter this optimizer updates (once per parameter for States).
  auto run = [&](Phase phase) {
    for (size_t i = 0; i < slots.size(); ++i) {
      kernels::AdafactorUpdate u = slot_update(i, step);
      u.phase = phase;
      float* p = params_.params_data() + slots[i].offset;
      if (phase == Phase::States) {
        device.adafactor_update(u, {p, nullptr, 0, 0, slots[i].weight_decay, false}, ctx);
        continue;
      }
      for (const SlotPart& part : slot_parts(i))
        device.adafactor_update(u, {p, part.g, part.begin, part.end, slots[i].weight_decay, zero}, ctx);
    }
  };
  // 1. This optimizer's elements' share of each parameter's statistics (0 elsewhere), summed over ranks under ZeRO.
  const size_t stat_count = static_cast<size_t>(rows_ + cols_ + squares_);
  double* stats = static_cast<double*>(stats_.get());
  double* update_squares = static_cast<double*>(update_squares_.get());
  device.zero(stats, stat_count * sizeof(double), ctx);
  run(Phase::Statistics);
  if (all_reduce_) all_reduce_(stats, static_cast<int64_t>(stat_count));
  // 2. The states from the statistics (the same on every rank), and each factored row's factor.
  run(Phase::States);
  // 3. The sum of squares of each parameter's update before clipping over this optimizer's elements; summed over
  // ranks under ZeRO.
  device.zero(update_squares, slots.size() * sizeof(double), ctx);
  run(Phase::UpdateSquares);
  if (all_reduce_) all_reduce_(update_squares, static_cast<int64_t>(slots.size()));
  // 4. The clipped update of this optimizer's elements.
  run(Phase::Apply);
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
  for (const char* name : {"sgd", "rmsprop", "adagrad", "adafactor"}) names.push_back(name);
  names.insert(names.end(), kLion.begin(), kLion.end());
  names.insert(names.end(), kBnbRmsprop.begin(), kBnbRmsprop.end());
  names.insert(names.end(), kAdamW8bit.begin(), kAdamW8bit.end());
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
  } else if (one_of(name, kAdamW8bit)) {
    // transformers hands bitsandbytes' AdamW the Adam arguments and optim_bits=8 (paged memory is a CUDA matter).
    const AdamWConfig c{spec.lr, spec.beta1, spec.beta2, spec.eps, spec.weight_decay};
    make = [&, c] { return std::make_unique<AdamW8bit>(*params, c, std::move(shard), name); };
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
  } else if (name == "adafactor") {
    // transformers' Trainer makes Adafactor(lr, scale_parameter=False, relative_step=False) and reads no optim_args.
    const AdafactorConfig c{.lr = spec.lr, .weight_decay = spec.weight_decay};
    make = [&, c] { return std::make_unique<Adafactor>(*params, c, std::move(shard)); };
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
