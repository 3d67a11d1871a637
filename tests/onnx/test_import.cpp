// The ONNX importer on every graph its fuzz target was seeded with (real exports of each architecture by torch's two
// exporters and by fusetrain, and malformed graphs) and on every input the fuzzer found to crash it
// (fuzz/regressions/onnx_import/): each either imports and trains one step with a finite loss, or is refused with
// fusetrain::Error; nothing else escapes. Under scripts/sanitize.sh these run with ASan and UBSan.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fusetrain/core/error.h"
#include "fusetrain/models/model.h"
#include "fusetrain/onnx/import.h"
#include "../../fuzz/onnx_import_case.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

namespace fs = std::filesystem;

struct Outcome {
  bool trained = false;
  double loss = 0;
  std::string error;
};

// One input as the fuzz target runs it (fuzz/onnx_import_case.h): trains one step on its padded (2, 8) batch.
Outcome import_and_step(const fs::path& input, const fs::path& scratch) {
  std::ifstream in(input, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  const std::string data = bytes.str();
  Outcome out;
  if (data.empty()) return out;
  fuzz::OnnxImportCase input_case(static_cast<uint8_t>(data[0]));
  fs::create_directories(scratch);
  const fs::path path = scratch / "model.onnx";
  std::ofstream(path, std::ios::binary).write(data.data() + 1, std::streamsize(data.size() - 1));
  const models::Batch batch = input_case.batch();
  try {
    std::unique_ptr<models::Model> model = onnx_import::import_model(path.string(), input_case.task());
    out.loss = model->loss_and_grads(batch, /*training=*/true);
    out.trained = true;
  } catch (const Error& e) {
    out.error = e.what();
  }
  return out;
}

std::vector<fs::path> inputs(const char* folder) {
  std::vector<fs::path> out;
  const fs::path dir = fs::path(FUSETRAIN_SOURCE_DIR) / folder;
  if (fs::is_directory(dir))
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file() && entry.path().filename().string()[0] != '.') out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(OnnxImportSeeds, RealExportsTrainAndMalformedGraphsAreRefused) {
  const std::vector<fs::path> seeds = inputs("fuzz/corpus/onnx_import");
  ASSERT_GE(seeds.size(), 30u) << "the seed corpus is missing (fuzz/make_seeds.py writes it)";
  TempDir scratch;
  int trained = 0;
  for (const fs::path& seed : seeds) {
    SCOPED_TRACE(seed.filename().string());
    const Outcome outcome = import_and_step(seed, scratch.path);
    const bool malformed = seed.filename().string().rfind("bad-", 0) == 0;
    if (malformed) {
      EXPECT_FALSE(outcome.trained);
      EXPECT_NE(outcome.error.find("model.onnx: "), std::string::npos) << outcome.error;  // the validator's refusal
    } else {
      EXPECT_TRUE(outcome.trained) << outcome.error;
      EXPECT_TRUE(std::isfinite(outcome.loss));
      trained += outcome.trained;
    }
  }
  EXPECT_GE(trained, 30);
}

TEST(OnnxImportSeeds, FuzzReproducersAreRefusedOrTrainWithoutCrashing) {
  TempDir scratch;
  for (const fs::path& reproducer : inputs("fuzz/regressions/onnx_import")) {
    SCOPED_TRACE(reproducer.filename().string());
    const Outcome outcome = import_and_step(reproducer, scratch.path);  // only fusetrain::Error may escape
    EXPECT_TRUE(outcome.trained || !outcome.error.empty());
  }
}

}  // namespace
}  // namespace fusetrain::testing
