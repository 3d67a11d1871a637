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
  // The step's scratch, sized once.
  stats_.resize(static_cast<size_t>(rows_ + cols_ + squares_));
  factor_rows_.resize(static_cast<size_t>(rows_));
  update_squares_.resize(params.slots().size());
  auto buffer = [&](int64_t n) {
    return params.device().allocate(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float));
  };
  row_ = buffer(rows_);
  col_ = buffer(cols_);
  sq_ = buffer(squares_);
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

namespace {

// Calls fn(start, stop, br, col0) for each row piece of a factored parameter's elements [begin, end): elements
// [start, stop) lie in row br (batch × rows index) from column col0 on.
template <typename Fn>
void for_each_row_piece(int64_t begin, int64_t end, int64_t cols, Fn&& fn) {
  for (int64_t start = begin; start < end;) {
    const int64_t br = start / cols;
    const int64_t stop = std::min(end, (br + 1) * cols);
    fn(start, stop, br, start - br * cols);
    start = stop;
  }
}

}  // namespace

void Adafactor::update(double grad_scale, double lr) {
  FT_CHECK(!sharded() || all_reduce_, "Adafactor over a ZeRO shard needs the ranks' sums (set_all_reduce)");
  const float scale = static_cast<float>(grad_scale), eps = static_cast<float>(config_.eps);
  const double beta2t_d = 1.0 - std::pow(static_cast<double>(step_count()), config_.decay_rate);
  const float beta2t = static_cast<float>(beta2t_d), one_minus = static_cast<float>(1.0 - beta2t_d);
  const float lr_f = static_cast<float>(lr), decay = static_cast<float>(-config_.weight_decay * lr);
  const float clip = static_cast<float>(config_.clip_threshold);
  const std::vector<runtime::ParamSlot>& slots = params_.slots();
  float* rows = static_cast<float*>(row_.get());
  float* cols = static_cast<float*>(col_.get());
  float* squares = static_cast<float*>(sq_.get());
  const int n = threads();
  const bool zero = zero_grads_on();
  // 1. This optimizer's elements' share of each parameter's statistics (0 elsewhere): a factored parameter's row and
  // column sums of u = g² + ε, a vector's new moving average of u. Summed over ranks under ZeRO.
  double* row_sums = stats_.data();
  double* col_sums = row_sums + rows_;
  double* new_squares = col_sums + cols_;
  std::fill(stats_.begin(), stats_.end(), 0.0);
  for (size_t i = 0; i < slots.size(); ++i) {
    for (const SlotPart& part : slot_parts(i)) {
      const float* g = part.g;
      if (sq_at_[i] >= 0) {
        const float* v = squares + sq_at_[i];
        double* out = new_squares + sq_at_[i];
#pragma omp parallel for num_threads(n) schedule(static) if (part.end - part.begin > 65536)
        for (int64_t k = part.begin; k < part.end; ++k) {
          const float grad = g[k] * scale;
          out[k] = v[k] * beta2t + one_minus * (grad * grad + eps);
        }
        continue;
      }
      const Factored f = factored(slots[i].shape);
      double* rs = row_sums + row_at_[i];
      double* cs = col_sums + col_at_[i];
      for_each_row_piece(part.begin, part.end, f.cols, [&](int64_t start, int64_t stop, int64_t br, int64_t col0) {
        double* c = cs + (br / f.rows) * f.cols + col0 - start;
        double sum = 0;
        for (int64_t k = start; k < stop; ++k) {
          const float grad = g[k] * scale;
          const float u = grad * grad + eps;
          sum += u;
          c[k] += u;
        }
        rs[br] += sum;
      });
    }
  }
  if (all_reduce_) all_reduce_(stats_.data(), static_cast<int64_t>(stats_.size()));
  // 2. The states from the statistics (the same on every rank), and each factored row's factor rsqrt(R / mean(R)).
  for (size_t i = 0; i < slots.size(); ++i) {
    if (sq_at_[i] >= 0) {
      float* v = squares + sq_at_[i];
      const double* from = new_squares + sq_at_[i];
      for (int64_t k = 0; k < slots[i].numel; ++k) v[k] = static_cast<float>(from[k]);
      continue;
    }
    const Factored f = factored(slots[i].shape);
    for (int64_t b = 0; b < f.batch; ++b) {
      float* rb = rows + row_at_[i] + b * f.rows;
      float* cb = cols + col_at_[i] + b * f.cols;
      const double* rs = row_sums + row_at_[i] + b * f.rows;
      const double* cs = col_sums + col_at_[i] + b * f.cols;
      for (int64_t row = 0; row < f.rows; ++row)
        rb[row] = rb[row] * beta2t + one_minus * static_cast<float>(rs[row] / static_cast<double>(f.cols));
      for (int64_t k = 0; k < f.cols; ++k)
        cb[k] = cb[k] * beta2t + one_minus * static_cast<float>(cs[k] / static_cast<double>(f.rows));
      double row_total = 0;
      for (int64_t row = 0; row < f.rows; ++row) row_total += rb[row];
      const float row_mean = static_cast<float>(row_total / static_cast<double>(f.rows));
      float* fr = factor_rows_.data() + row_at_[i] + b * f.rows;
      for (int64_t row = 0; row < f.rows; ++row) fr[row] = 1.0f / std::sqrt(rb[row] / row_mean);
    }
  }
  // 3. The sum of squares of each parameter's update before clipping, u_k = f_k · g_k (f: the inverse root of the
  // second-moment estimate), over this optimizer's elements; summed over ranks under ZeRO.
  std::fill(update_squares_.begin(), update_squares_.end(), 0.0);
  for (size_t i = 0; i < slots.size(); ++i) {
    double u_squares = 0;
    for (const SlotPart& part : slot_parts(i)) {
      const float* g = part.g;
      if (sq_at_[i] >= 0) {
        const float* v = squares + sq_at_[i];
#pragma omp parallel for num_threads(n) reduction(+ : u_squares) schedule(static) if (part.end - part.begin > 65536)
        for (int64_t k = part.begin; k < part.end; ++k) {
          const float u = 1.0f / std::sqrt(v[k]) * (g[k] * scale);
          u_squares += static_cast<double>(u) * u;
        }
        continue;
      }
      const Factored f = factored(slots[i].shape);
      const float* c = cols + col_at_[i];
      const float* fr = factor_rows_.data() + row_at_[i];
      for_each_row_piece(part.begin, part.end, f.cols, [&](int64_t start, int64_t stop, int64_t br, int64_t col0) {
        const float* cb = c + (br / f.rows) * f.cols + col0 - start;
        for (int64_t k = start; k < stop; ++k) {
          const float u = fr[br] * (1.0f / std::sqrt(cb[k])) * (g[k] * scale);
          u_squares += static_cast<double>(u) * u;
        }
      });
    }
    update_squares_[i] = u_squares;
  }
  if (all_reduce_) all_reduce_(update_squares_.data(), static_cast<int64_t>(update_squares_.size()));
  // 4. The clipped update of this optimizer's elements.
  for (size_t i = 0; i < slots.size(); ++i) {
    const runtime::ParamSlot& slot = slots[i];
    float* p = params_.params_data() + slot.offset;
    const float rms = static_cast<float>(std::sqrt(update_squares_[i]) / std::sqrt(static_cast<double>(slot.numel)));
    const float divisor = std::max(rms / clip, 1.0f);
    const bool decays = slot.weight_decay && config_.weight_decay != 0;
    for (const SlotPart& part : slot_parts(i)) {
      float* g = part.g;
      auto apply = [&](int64_t k, float factor) {
        const float grad = g[k] * scale;
        if (zero) g[k] = 0.0f;
        const float u = factor * grad / divisor * lr_f;
        float pk = p[k];
        if (decays) pk = pk + decay * pk;
        p[k] = pk - u;
      };
      if (sq_at_[i] >= 0) {
        const float* v = squares + sq_at_[i];
#pragma omp parallel for num_threads(n) schedule(static) if (part.end - part.begin > 65536)
        for (int64_t k = part.begin; k < part.end; ++k) apply(k, 1.0f / std::sqrt(v[k]));
        continue;
      }
      const Factored f = factored(slot.shape);
      const float* c = cols + col_at_[i];
      const float* fr = factor_rows_.data() + row_at_[i];
      const int64_t first_row = part.begin / f.cols, last_row = (part.end + f.cols - 1) / f.cols;
#pragma omp parallel for num_threads(n) schedule(static) if (last_row - first_row > 64)
      for (int64_t br = first_row; br < last_row; ++br) {
        const int64_t start = std::max(part.begin, br * f.cols), stop = std::min(part.end, (br + 1) * f.cols);
        const float* cb = c + (br / f.rows) * f.cols - br * f.cols;
        for (int64_t k = start; k < stop; ++k) apply(k, fr[br] * (1.0f / std::sqrt(cb[k])));
      }
    }
  }
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
