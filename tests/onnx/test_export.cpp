// ONNX export's refusals (the exported graphs themselves are checked in ONNX Runtime by
// tests/python/test_onnx_export.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "fusetrain/core/error.h"
#include "fusetrain/models/model.h"
#include "fusetrain/onnx/export.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

std::unique_ptr<models::Model> tiny_bert() {
  const nlohmann::json config = {{"model_type", "bert"},        {"vocab_size", 50},          {"hidden_size", 8},
                                 {"num_hidden_layers", 1},      {"num_attention_heads", 2},  {"intermediate_size", 16},
                                 {"max_position_embeddings", 16}, {"num_labels", 2}};
  return models::Model::from_config(config, 1, "BertForSequenceClassification");
}

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

TEST(OnnxExport, ANonFiniteWeightIsRefusedAndTheFileAlreadyThereIsKept) {
  TempDir dir;
  auto model = tiny_bert();
  const std::string path = dir.file("model.onnx");
  const onnx_export::ExportReport report = onnx_export::export_onnx(*model, path);
  EXPECT_GT(report.nodes, 0);
  EXPECT_EQ(report.initializers, static_cast<int64_t>(model->state_dict_names().size()));
  const std::string before = read(path);
  ASSERT_FALSE(before.empty());

  model->parameter("classifier.bias").data_as<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  try {
    onnx_export::export_onnx(*model, path);
    FAIL() << "a NaN weight was exported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter classifier.bias holds a non-finite value at element 1"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read(path), before);
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path)) ++files;
  EXPECT_EQ(files, 1);  // no temporary left behind
}

TEST(OnnxExport, AnOpsetOutsideSeventeenToTwentyIsRefused) {
  TempDir dir;
  auto model = tiny_bert();
  onnx_export::ExportOptions options;
  options.opset = 13;
  EXPECT_THROW(
      {
        try {
          onnx_export::export_onnx(*model, dir.file("model.onnx"), options);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("opset 13 is not supported; expected 17 to 20"), std::string::npos);
          throw;
        }
      },
      Error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("model.onnx")));
}

}  // namespace
}  // namespace fusetrain::testing
