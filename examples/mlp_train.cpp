// Trains a 2-layer MLP (Linear, LayerNorm, GELU, Linear) on a synthetic
// 4-class task whose labels need the hidden layer (an XOR of two half-spaces,
// combined with a third), then reports loss and held-out accuracy.
//
//   mlp_train [--steps N] [--threads N] [--min-accuracy A]
//
// With --min-accuracy the exit status is 1 when held-out accuracy is below A.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/fusetrain.h"

namespace {

constexpr int64_t kFeatures = 8, kHidden = 64, kClasses = 4, kBatch = 128;

struct Task {
  std::vector<float> u1, u2, u3;  // three random directions
  explicit Task(std::mt19937& rng) {
    std::normal_distribution<float> normal;
    for (auto* u : {&u1, &u2, &u3})
      for (int64_t i = 0; i < kFeatures; ++i) u->push_back(normal(rng));
  }
  // Fills one batch: x (B, F) ~ N(0, 1), label = 2·[(x·u1 > 0) xor (x·u2 > 0)] + [x·u3 > 0].
  void sample(std::mt19937& rng, float* x, int64_t* labels) const {
    std::normal_distribution<float> normal;
    for (int64_t b = 0; b < kBatch; ++b) {
      float d1 = 0, d2 = 0, d3 = 0;
      for (int64_t i = 0; i < kFeatures; ++i) {
        float v = normal(rng);
        x[b * kFeatures + i] = v;
        d1 += v * u1[i];
        d2 += v * u2[i];
        d3 += v * u3[i];
      }
      labels[b] = 2 * ((d1 > 0) != (d2 > 0)) + (d3 > 0);
    }
  }
};

// x (B, F), labels (B) -> logits (B, K) and the mean cross-entropy loss.
ft::ir::ValueId build_mlp(ft::ir::GraphBuilder& b, ft::ir::ValueId* logits_out) {
  using ft::ir::ValueId;
  ValueId x = b.input("x", {kBatch, kFeatures});
  ValueId labels = b.input("labels", {kBatch}, ft::DType::i64);
  ValueId h = b.linear(x, b.param("fc1.weight", {kHidden, kFeatures}), b.param("fc1.bias", {kHidden}));
  h = b.gelu(b.layer_norm(h, b.param("norm.weight", {kHidden}), b.param("norm.bias", {kHidden})));
  ValueId logits = b.linear(h, b.param("fc2.weight", {kClasses, kHidden}), b.param("fc2.bias", {kClasses}));
  *logits_out = logits;
  return b.softmax_cross_entropy(logits, labels);
}

// PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); LayerNorm weight 1, bias 0.
void init_params(ft::runtime::ParameterStore& params, std::mt19937& rng) {
  for (size_t i = 0; i < params.slots().size(); ++i) {
    const ft::runtime::ParamSlot& slot = params.slots()[i];
    ft::Tensor t = params.param(i);
    float* p = t.data_as<float>();
    if (slot.name.rfind("norm.", 0) == 0) {
      for (int64_t k = 0; k < slot.numel; ++k) p[k] = slot.name == "norm.weight" ? 1.0f : 0.0f;
      params.set_weight_decay(i, false);
      continue;
    }
    int64_t fan_in = slot.name.rfind("fc1", 0) == 0 ? kFeatures : kHidden;
    float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    for (int64_t k = 0; k < slot.numel; ++k) p[k] = uniform(rng);
    if (slot.name.find(".bias") != std::string::npos) params.set_weight_decay(i, false);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 600, threads = 0;
  double min_accuracy = -1;
  for (int i = 1; i < argc; ++i) {
    auto value = [&](const char* flag) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mlp_train: %s needs a value\n", flag);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--steps"))
      steps = std::atoi(value("--steps"));
    else if (!std::strcmp(argv[i], "--threads"))
      threads = std::atoi(value("--threads"));
    else if (!std::strcmp(argv[i], "--min-accuracy"))
      min_accuracy = std::atof(value("--min-accuracy"));
    else {
      std::fprintf(stderr, "mlp_train: unknown argument \"%s\" (expected --steps, --threads, --min-accuracy)\n",
                   argv[i]);
      return 2;
    }
  }
  try {
    std::mt19937 rng(42);
    Task task(rng);

    // Training graph: forward, then the backward pass appended by autodiff.
    ft::ir::Graph train_graph;
    ft::ir::GraphBuilder builder(train_graph);
    ft::ir::ValueId logits;
    ft::ir::ValueId loss = build_mlp(builder, &logits);
    train_graph.mark_output(loss);
    ft::autodiff::build_backward(train_graph, loss, train_graph.params());

    // Evaluation graph: the same forward, reading the same parameter store.
    ft::ir::Graph eval_graph;
    ft::ir::GraphBuilder eval_builder(eval_graph);
    ft::ir::ValueId eval_logits;
    build_mlp(eval_builder, &eval_logits);
    eval_graph.mark_output(eval_logits);

    ft::runtime::ParameterStore params(train_graph);
    init_params(params, rng);
    ft::runtime::PlanOptions options;
    options.num_threads = threads;
    auto train = ft::compile::compile_plan(train_graph, params, options);
    auto eval = ft::compile::compile_plan(eval_graph, params, options);
    ft::optim::AdamW optimizer(params, {.lr = 1e-2, .weight_decay = 0.01});
    train->set_optimizer_state_bytes(optimizer.state_bytes());

    // Each batch is made in host memory and uploaded into the plan's inputs (the Device's memory).
    std::vector<float> x(static_cast<size_t>(train->input("x").numel()));
    std::vector<int64_t> labels(static_cast<size_t>(train->input("labels").numel()));
    double loss_value = 0;
    for (int step = 0; step < steps; ++step) {
      task.sample(rng, x.data(), labels.data());
      train->upload_input("x", x.data());
      train->upload_input("labels", labels.data());
      double lr = 1e-2 * 0.5 * (1.0 + std::cos(M_PI * step / steps));  // cosine decay
      params.zero_grads();
      train->run();
      optimizer.clip_and_step(1.0, lr);
      loss_value = train->output(loss).item();
      if (step % 100 == 0) std::printf("step %4d  loss %.4f\n", step, loss_value);
    }

    // Held-out accuracy on fresh samples.
    std::mt19937 test_rng(2024);
    int64_t correct = 0, total = 0;
    std::vector<float> ex(x.size());
    std::vector<int64_t> elabels(labels.size());
    for (int batch = 0; batch < 16; ++batch) {
      task.sample(test_rng, ex.data(), elabels.data());
      eval->upload_input("x", ex.data());
      eval->upload_input("labels", elabels.data());
      eval->run();
      const float* out = eval->output(eval_logits).data_as<float>();
      for (int64_t b = 0; b < kBatch; ++b) {
        int64_t best = 0;
        for (int64_t k = 1; k < kClasses; ++k)
          if (out[b * kClasses + k] > out[b * kClasses + best]) best = k;
        correct += best == elabels[b];
        ++total;
      }
    }
    double accuracy = static_cast<double>(correct) / static_cast<double>(total);
    std::printf("final loss %.4f  held-out accuracy %.2f%% (%lld/%lld)\n", loss_value, 100 * accuracy,
                static_cast<long long>(correct), static_cast<long long>(total));
    std::printf("memory plan:\n%s", train->memory_report().to_string().c_str());
    if (min_accuracy >= 0 && accuracy < min_accuracy) {
      std::fprintf(stderr, "mlp_train: accuracy %.4f is below the required %.4f\n", accuracy, min_accuracy);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_train: %s\n", e.what());
    return 1;
  }
}
