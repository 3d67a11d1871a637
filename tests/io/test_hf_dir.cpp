// Hugging Face model directories: write then read, sharded weights, and one clear error per broken directory.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "fusetrain/core/error.h"
#include "fusetrain/io/hf_dir.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Tensor ramp(Shape shape, DType dtype, double start) {
  Tensor t = Tensor::zeros(std::move(shape), dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, start + 0.5 * static_cast<double>(i));
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

const json kConfig = {{"model_type", "bert"},
                      {"architectures", {"BertForMaskedLM"}},
                      {"hidden_size", 8},
                      {"layer_norm_eps", 1e-12},
                      {"name", "caf\u00e9"}};

TEST(HfDir, WriteThenReadRoundTrip) {
  TempDir tmp;
  std::string dir = tmp.file("model");  // created by write_hf_dir
  std::vector<std::pair<std::string, Tensor>> tensors = {{"bert.embeddings.weight", ramp({4, 8}, DType::f32, 0)},
                                                         {"cls.bias", ramp({4}, DType::bf16, 1)}};
  json generation = {{"max_length", 20}};
  io::write_hf_dir(dir, kConfig, tensors, generation);

  // config.json exactly as transformers writes it: json.dumps(config, indent=2, sort_keys=True) + "\n".
  EXPECT_EQ(read_file(dir + "/config.json"),
            "{\n  \"architectures\": [\n    \"BertForMaskedLM\"\n  ],\n  \"hidden_size\": 8,\n"
            "  \"layer_norm_eps\": 1e-12,\n  \"model_type\": \"bert\",\n  \"name\": \"caf\\u00e9\"\n}\n");

  io::HfModelDir model = io::read_hf_dir(dir);
  EXPECT_EQ(model.path, dir);
  EXPECT_EQ(model.config, kConfig);
  ASSERT_TRUE(model.generation_config.has_value());
  EXPECT_EQ(*model.generation_config, generation);
  ASSERT_EQ(model.files.size(), 1u);
  EXPECT_EQ(model.files[0].metadata().at("format"), "pt");
  EXPECT_EQ(model.tensor_names(), (std::vector<std::string>{"bert.embeddings.weight", "cls.bias"}));
  for (const auto& [name, original] : tensors) EXPECT_TRUE(same_bytes(model.tensor(name), original)) << name;
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << "temporary file left behind";
}

TEST(HfDir, NoGenerationConfigIsOptional) {
  TempDir tmp;
  io::write_hf_dir(tmp.path.string(), kConfig, {{"w", ramp({2}, DType::f32, 0)}});
  io::HfModelDir model = io::read_hf_dir(tmp.path.string());
  EXPECT_FALSE(model.generation_config.has_value());
  EXPECT_FALSE(fs::exists(tmp.file("generation_config.json")));
}

// A directory with config.json and two shards listed by model.safetensors.index.json.
void write_sharded(const TempDir& tmp, const json& weight_map) {
  write_file(tmp.file("config.json"), kConfig.dump());
  io::save_safetensors(tmp.file("model-00001-of-00002.safetensors"),
                       {{"a.weight", ramp({3}, DType::f32, 1)}, {"a.bias", ramp({3}, DType::f32, 2)}});
  io::save_safetensors(tmp.file("model-00002-of-00002.safetensors"), {{"b.weight", ramp({2, 2}, DType::f16, 3)}});
  json index = {{"metadata", {{"total_size", 32}}}, {"weight_map", weight_map}};
  write_file(tmp.file("model.safetensors.index.json"), index.dump(2));
}

TEST(HfDir, ReadsShardedWeights) {
  TempDir tmp;
  write_sharded(tmp, {{"a.weight", "model-00001-of-00002.safetensors"},
                      {"a.bias", "model-00001-of-00002.safetensors"},
                      {"b.weight", "model-00002-of-00002.safetensors"}});
  io::HfModelDir model = io::read_hf_dir(tmp.path.string());
  ASSERT_EQ(model.files.size(), 2u);
  EXPECT_EQ(model.files[0].path(), tmp.file("model-00001-of-00002.safetensors"));
  EXPECT_EQ(model.tensor_file.at("a.weight"), 0u);
  EXPECT_EQ(model.tensor_file.at("a.bias"), 0u);
  EXPECT_EQ(model.tensor_file.at("b.weight"), 1u);
  EXPECT_TRUE(same_bytes(model.tensor("b.weight"), ramp({2, 2}, DType::f16, 3)));
  EXPECT_TRUE(same_bytes(model.tensor("a.bias"), ramp({3}, DType::f32, 2)));
}

TEST(HfDir, IndexNamingAMissingShard) {
  TempDir tmp;
  write_sharded(tmp,
                {{"a.weight", "model-00001-of-00002.safetensors"}, {"c.weight", "model-00003-of-00003.safetensors"}});
  std::string message = error_of([&] { io::read_hf_dir(tmp.path.string()); });
  EXPECT_CONTAINS(message,
                  tmp.file("model.safetensors.index.json") + ": names shard \"model-00003-of-00003.safetensors\"");
  EXPECT_CONTAINS(message, "\"c.weight\"");
  EXPECT_CONTAINS(message, "does not exist");
}

TEST(HfDir, IndexListingATensorItsShardLacks) {
  TempDir tmp;
  write_sharded(tmp,
                {{"a.weight", "model-00001-of-00002.safetensors"}, {"b.weight", "model-00001-of-00002.safetensors"}});
  std::string message = error_of([&] { io::read_hf_dir(tmp.path.string()); });
  EXPECT_CONTAINS(message, "lists tensor \"b.weight\" in shard \"model-00001-of-00002.safetensors\"");
  EXPECT_CONTAINS(message, "has no such tensor");
}

TEST(HfDir, IndexEscapingTheDirectoryIsRejected) {
  TempDir tmp;
  write_sharded(tmp, {{"a.weight", "../model-00001-of-00002.safetensors"}});
  std::string message = error_of([&] { io::read_hf_dir(tmp.path.string()); });
  EXPECT_CONTAINS(message, "is not a file name inside the model directory");
}

TEST(HfDir, MalformedIndex) {
  TempDir tmp;
  write_sharded(tmp, {});
  write_file(tmp.file("model.safetensors.index.json"), "{\"weight_map\": {\"a\": }}");
  std::string message = error_of([&] { io::read_hf_dir(tmp.path.string()); });
  EXPECT_CONTAINS(message, tmp.file("model.safetensors.index.json") + ": invalid JSON: parse error at line 1, column");
  write_file(tmp.file("model.safetensors.index.json"), "{\"metadata\": {}}");
  message = error_of([&] { io::read_hf_dir(tmp.path.string()); });
  EXPECT_CONTAINS(message, "no \"weight_map\" object");
  write_file(tmp.file("model.safetensors.index.json"), "{\"weight_map\": {\"a\": 3}}");
  message = error_of([&] { io::read_hf_dir(tmp.path.string()); });
  EXPECT_CONTAINS(message, "weight_map entry for tensor \"a\" is a JSON number, expected a shard file name");
}

TEST(HfDir, PytorchBinOnlyPointsAtConversion) {
  for (const char* pickle : {"pytorch_model.bin", "pytorch_model.bin.index.json"}) {
    TempDir tmp;
    write_file(tmp.file("config.json"), kConfig.dump());
    write_file(tmp.file(pickle), "not read");
    std::string dir = tmp.path.string();
    std::string message = error_of([&] { io::read_hf_dir(dir); });
    EXPECT_CONTAINS(message, dir + ": the weights are in " + pickle);
    EXPECT_CONTAINS(message, "python -c \"from transformers import AutoModel; AutoModel.from_pretrained('" + dir +
                                 "').save_pretrained('" + dir + "', safe_serialization=True)\"");
  }
}

TEST(HfDir, EveryBrokenDirectoryGivesOneClearError) {
  TempDir tmp;
  std::string dir = tmp.path.string();
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir + "/missing"); }), dir + "/missing: no such directory");
  write_file(tmp.file("plain"), "x");
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(tmp.file("plain")); }), "plain: is not a directory");

  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }), dir + ": no config.json");
  write_file(tmp.file("config.json"), "{\n  \"model_type\": \"bert\",\n  \"hidden_size\": 8,,\n}");
  std::string message = error_of([&] { io::read_hf_dir(dir); });
  EXPECT_CONTAINS(message, tmp.file("config.json") + ": invalid JSON: parse error at line 3, column 20");
  write_file(tmp.file("config.json"), "[1]");
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }),
                  tmp.file("config.json") + ": expected a JSON object, found a JSON array");
  write_file(tmp.file("config.json"), "{\"hidden_size\": 8}");
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }), tmp.file("config.json") + ": no \"model_type\"");
  write_file(tmp.file("config.json"), "{\"model_type\": 8}");
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }), "\"model_type\" is a JSON number, expected a string");

  write_file(tmp.file("config.json"), kConfig.dump());
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }),
                  dir + ": no model.safetensors or model.safetensors.index.json");
  write_file(tmp.file("model.safetensors"), "short");
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }), tmp.file("model.safetensors") + ": not a safetensors file");
  write_file(tmp.file("generation_config.json"), "{");
  EXPECT_CONTAINS(error_of([&] { io::read_hf_dir(dir); }), tmp.file("generation_config.json") + ": invalid JSON");
}

TEST(HfDir, MissingTensorNamesDirectoryAndTensor) {
  TempDir tmp;
  io::write_hf_dir(tmp.path.string(), kConfig, {{"bert.pooler.weight", ramp({2}, DType::f32, 0)}});
  io::HfModelDir model = io::read_hf_dir(tmp.path.string());
  std::string message = error_of([&] { model.tensor("pooler.weight"); });
  EXPECT_CONTAINS(message, tmp.path.string() + ": no tensor \"pooler.weight\" among the model's 1 weights");
  EXPECT_CONTAINS(message, "did you mean \"bert.pooler.weight\"");
}

TEST(HfDir, WriteIntoAFileIsAnError) {
  TempDir tmp;
  write_file(tmp.file("taken"), "keep me");
  std::string message = error_of([&] { io::write_hf_dir(tmp.file("taken"), kConfig, {}); });
  EXPECT_CONTAINS(message, tmp.file("taken") + ": exists and is not a directory");
  EXPECT_EQ(read_file(tmp.file("taken")), "keep me");
}

TEST(HfDir, InterruptedWriteLeavesOldFilesIntact) {
  TempDir tmp;
  std::string dir = tmp.path.string();
  io::write_hf_dir(dir, kConfig, {{"w", ramp({2}, DType::f32, 0)}});
  const std::string old_config = read_file(tmp.file("config.json"));
  const std::string old_weights = read_file(tmp.file("model.safetensors"));
  // The config's temporary name is taken by a directory, so writing config.json fails.
  fs::create_directory(str(tmp.file("config.json"), ".tmp-", ::getpid()));
  json new_config = kConfig;
  new_config["hidden_size"] = 16;
  std::string message = error_of([&] { io::write_hf_dir(dir, new_config, {{"w", ramp({4}, DType::f32, 5)}}); });
  EXPECT_CONTAINS(message, tmp.file("config.json"));
  EXPECT_EQ(read_file(tmp.file("config.json")), old_config);
  EXPECT_NE(read_file(tmp.file("model.safetensors")), old_weights);  // replaced whole, never half-written
  io::HfModelDir model = io::read_hf_dir(dir);
  EXPECT_EQ(model.config["hidden_size"], 8);
  EXPECT_EQ(model.tensor("w").shape(), Shape{4});
}

TEST(HfDir, ReadJsonFileNamesTheFile) {
  TempDir tmp;
  EXPECT_CONTAINS(error_of([&] { io::read_json_file(tmp.file("x.json")); }), tmp.file("x.json") + ": no such file");
  write_file(tmp.file("empty.json"), "");
  EXPECT_CONTAINS(error_of([&] { io::read_json_file(tmp.file("empty.json")); }),
                  tmp.file("empty.json") + ": invalid JSON: parse error at line 1, column 1");
  write_file(tmp.file("ok.json"), "{\"a\": [1, 2.5, \"s\"]}");
  EXPECT_EQ(io::read_json_file(tmp.file("ok.json")), json::parse("{\"a\": [1, 2.5, \"s\"]}"));
}

}  // namespace
}  // namespace fusetrain::testing
