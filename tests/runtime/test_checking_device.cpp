// The checking device itself, and its installation as the default device: with FUSETRAIN_TEST_DEVICE=checking the
// whole suite's parameter stores, optimizers and plans take their memory from it (ctest's
// fusetrain_tests_on_checking_device).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fusetrain/data/dataset.h"
#include "fusetrain/fusetrain.h"
#include "fusetrain/models/model.h"
#include "fusetrain/train/trainer.h"
#include "support/checking_device.h"
#include "support/test_util.h"

namespace fusetrain::testing {

namespace {

CheckingDevice* checking = nullptr;

// Installs the checking device before any test when asked; at the end, every allocation must have been freed.
class CheckingDeviceEnvironment final : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* device = std::getenv("FUSETRAIN_TEST_DEVICE");
    if (device == nullptr) return;
    const bool host_visible = std::strcmp(device, "checking") == 0;
    if (!host_visible && std::strcmp(device, "checking-not-host-visible") != 0) {
      std::fprintf(stderr, "FUSETRAIN_TEST_DEVICE must be checking or checking-not-host-visible, found %s\n", device);
      std::exit(2);
    }
    checking = new CheckingDevice(kernels::cpu_device(), host_visible ? HostAccess::Visible : HostAccess::Hidden);
    kernels::set_default_device(checking);
  }
  void TearDown() override {
    if (checking == nullptr) return;
    std::printf("checking device: %lld allocations, %lld kernel runs checked, %lld still live\n",
                static_cast<long long>(checking->allocations()), static_cast<long long>(checking->kernel_runs()),
                static_cast<long long>(checking->live_allocations()));
    kernels::set_default_device(nullptr);  // still-live objects (static caches) keep pointing at it: never freed
  }
};

const ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new CheckingDeviceEnvironment());

}  // namespace

const CheckingDevice* installed_checking_device() { return checking; }

TEST(CheckingDevice, RefusesAKernelOnMemoryItDidNotAllocate) {
  CheckingDevice device;
  runtime::ParameterStore params(std::vector<std::pair<std::string, Shape>>{{"w", {4}}}, device);
  ir::Graph g;
  ir::GraphBuilder b(g, 1);
  const ir::ValueId x = b.input("x", Shape{4});
  const ir::ValueId w = b.param("w", Shape{4});
  g.mark_output(b.add(x, w));
  auto plan = compile::compile_plan(g, params);
  EXPECT_NO_THROW(plan->run());  // the plan's own input buffer, the store's parameters: the device's memory
  std::vector<float> host(4, 1.0f);
  plan->bind_input("x", host.data());  // memory the device never handed out
  EXPECT_CONTAINS(error_of([&] { plan->run(); }), "input 0 (16 bytes) is not memory the device allocated");
  EXPECT_GE(device.kernel_runs(), 1);
}

TEST(CheckingDevice, CountsAllocationsAndPoisonsWhatItFrees) {
  CheckingDevice device;
  float* kept = nullptr;
  {
    kernels::DeviceBuffer buffer = device.allocate(64);
    kept = static_cast<float*>(buffer.get());
    EXPECT_EQ(kept[0], 0.0f);  // zero-filled, as every device's
    EXPECT_EQ(device.live_allocations(), 1);
    EXPECT_NO_THROW(device.check(kept, 64, "whole"));
    EXPECT_CONTAINS(error_of([&] { device.check(kept, 65, "past its end"); }), "past its end (65 bytes)");
  }
  EXPECT_EQ(device.allocations(), 1);
  EXPECT_EQ(device.live_allocations(), 0);
  EXPECT_CONTAINS(error_of([&] { device.check(kept, 4, "freed"); }), "freed (4 bytes) is not memory");
}

// A sealed device's memory faults when the host touches it outside the device's operations, and the fault names
// the allocation: the check below can fail.
TEST(CheckingDeviceDeathTest, SealedMemoryFaultsWhenTheHostReadsIt) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child re-runs the binary: no forked OpenMP state
  EXPECT_DEATH(
      {
        CheckingDevice device(kernels::cpu_device(), HostAccess::Sealed);
        kernels::DeviceBuffer buffer = device.allocate(64);
        std::printf("%f\n", static_cast<const volatile float*>(buffer.get())[3]);
      },
      "the host touched device memory outside a device operation, byte 12 of an allocation of 64 bytes");
  GTEST_FLAG_SET(death_test_style, style);
}

// Installs `device` as the default device for a scope (the previous one after).
class DefaultDevice {
 public:
  explicit DefaultDevice(const kernels::Device& device) : previous_(&kernels::default_device()) {
    kernels::set_default_device(&device);
  }
  ~DefaultDevice() { kernels::set_default_device(previous_); }

 private:
  const kernels::Device* previous_;
};

// Training end to end on a sealed device, whose memory the host cannot touch outside the device's own operations:
// a BERT classifier and a Llama LM, each with every kind of optimizer update (AdamW and SGD's elementwise passes,
// Adafactor's phases, 8-bit AdamW's blocks), with gradient accumulation and clipping, evaluated, checkpointed,
// resumed from the checkpoint and saved. A host
// read or write of parameters, gradients, optimizer states, gradient buffers or plan memory anywhere in that path
// faults (the test above).
TEST(CheckingDevice, TrainingTouchesDeviceMemoryOnlyThroughTheDevice) {
  // Feed-forward matrices of 32 x 128 = 4096 elements: 8-bit AdamW keeps their moments in 8-bit blocks.
  const nlohmann::json bert = {{"model_type", "bert"},      {"vocab_size", 37},       {"hidden_size", 32},
                               {"num_hidden_layers", 2},    {"num_attention_heads", 2}, {"intermediate_size", 128},
                               {"max_position_embeddings", 40}, {"type_vocab_size", 2}, {"num_labels", 2}};
  const nlohmann::json llama = {{"model_type", "llama"},       {"vocab_size", 37},         {"hidden_size", 32},
                                {"num_hidden_layers", 2},      {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                                {"intermediate_size", 128},    {"max_position_embeddings", 40}};
  data::FlatExamples examples;
  std::mt19937 rng(3);
  for (int i = 0; i < 8; ++i) {
    for (int t = 0; t < 5 + i % 3; ++t) examples.ids.push_back(2 + static_cast<int64_t>(rng() % 35));
    examples.offsets.push_back(static_cast<int64_t>(examples.ids.size()));
  }
  examples.label_kind = data::LabelKind::Tokens;  // causal LM: the ids are the labels
  const data::TokenizedDataset tokens = data::TokenizedDataset::from_flat(examples);
  examples.label_kind = data::LabelKind::Class;
  for (int i = 0; i < 8; ++i) examples.labels.push_back(i % 2);
  const data::TokenizedDataset classes = data::TokenizedDataset::from_flat(examples);
  struct Case {
    const nlohmann::json* config;
    std::string architecture;
    models::Head head;
    const data::TokenizedDataset* dataset;
  };
  const TempDir dir;
  for (const Case& c : {Case{&bert, "BertForSequenceClassification", models::Head::SequenceClassification, &classes},
                        Case{&llama, "LlamaForCausalLM", models::Head::CausalLM, &tokens}})
    for (const std::string optim : {"adamw_torch", "sgd", "adafactor", "adamw_8bit"}) {
      SCOPED_TRACE(c.architecture + " " + optim);
      CheckingDevice sealed(kernels::cpu_device(), HostAccess::Sealed);
      const DefaultDevice installed(sealed);
      const std::string out = (dir.path / (c.architecture + "-" + optim)).string();
      auto train = [&](int64_t steps, std::optional<std::string> resume) {
        auto model = models::Model::from_config(*c.config, 7, c.architecture);
        train::TrainingArguments args;
        args.output_dir = out;
        args.max_steps = steps;
        args.per_device_train_batch_size = 2;
        args.gradient_accumulation_steps = 2;
        args.optim = optim;
        args.learning_rate = 1e-3;
        args.weight_decay = 0.1;
        args.max_grad_norm = 1.0;
        args.logging_steps = 1;
        args.save_steps = 2;
        args.eval_strategy = "steps";
        args.eval_steps = 2;
        args.resume_from_checkpoint = std::move(resume);
        train::Trainer trainer(*model, args, c.head, c.dataset, c.dataset, {});
        const std::map<std::string, double> metrics = trainer.train();
        trainer.save_model();
        return metrics.at("train_loss");
      };
      const double whole = train(4, std::nullopt);
      const double resumed = train(4, out + "/checkpoint-2");
      EXPECT_TRUE(std::isfinite(whole));
      EXPECT_TRUE(std::isfinite(resumed));
      EXPECT_GT(sealed.kernel_runs(), 0);
      if (optim == "adamw_8bit") {  // the feed-forward matrices' moments were 8-bit codes
        std::ifstream file(out + "/checkpoint-2/optimizer.safetensors", std::ios::binary);
        const std::string head(std::istreambuf_iterator<char>(file), {});
        EXPECT_NE(head.find("\"U8\""), std::string::npos);
      }
    }
}

}  // namespace fusetrain::testing
