// An ONNX graph: onnx_import::import_model (the validator, the importer's value lookup, the host evaluator, the op
// mapping, the compile pipeline), then one training step (forward, backward) on a small padded batch with labels.
//
// Input: see onnx_import_case.h; the ModelProto is written as model.onnx into a scratch directory with no
// config.json.
// The seeds (fuzz/make_seeds.py) are real exports of every architecture the import tests cover, by both of torch's
// exporters and by fusetrain's own, plus the malformed graphs of tests/python/test_onnx_validation.py.
//
// Sizes: ASan refuses any single allocation over max_allocation_size_mb (fuzz_support.cpp), which the allocators
// report as fusetrain::Error, so a graph whose shapes ask for gigabytes is refused rather than allocated.
#include "fuzz_support.h"
#include "fusetrain/models/model.h"
#include "fusetrain/onnx/import.h"
#include "onnx_import_case.h"

namespace fuzz = fusetrain::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const std::filesystem::path dir = fuzz::scratch_dir() / "onnx";
  static const bool made = std::filesystem::create_directories(dir);
  (void)made;
  fuzz::OnnxImportCase input(data[0]);
  fuzz::write_file(dir / "model.onnx", fuzz::as_text(data + 1, size - 1));
  const fusetrain::models::Batch batch = input.batch();
  fuzz::parses("onnx_import::import_model", [&] {
    std::unique_ptr<fusetrain::models::Model> model = fusetrain::onnx_import::import_model((dir / "model.onnx").string(),
                                                                                          input.task());
    const double loss = model->loss_and_grads(batch, /*training=*/true);
    fuzz::sink = fuzz::sink + static_cast<uint64_t>(loss == loss);
    for (const std::string& name : model->trainable_names()) fuzz::sink = fuzz::sink + fuzz::touch(model->gradient(name));
  });
  return 0;
}
