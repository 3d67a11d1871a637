// An ONNX graph: models::Model::from_onnx (the validator, the importer's value lookup, the host evaluator, the op
// mapping, the compile pipeline), then one training step (forward, backward) on a small padded batch with labels.
//
// Input: byte 0 picks the task (its low 3 bits % 5: seq-cls, token-cls, qa, mlm, clm) and, in bit 3, whether the
// batch carries an attention mask; the rest is the ModelProto, written as model.onnx into a scratch directory with no config.json.
// The seeds (fuzz/make_seeds.py) are real exports of every architecture the import tests cover, by both of torch's
// exporters and by fusetrain's own, plus the malformed graphs of tests/python/test_onnx_validation.py.
//
// Sizes: ASan refuses any single allocation over max_allocation_size_mb (fuzz_support.cpp), which the allocators
// report as fusetrain::Error, so a graph whose shapes ask for gigabytes is refused rather than allocated.
#include <array>

#include "fuzz_support.h"
#include "fusetrain/models/model.h"

namespace {

namespace fuzz = fusetrain::fuzz;
using fusetrain::DType;
using fusetrain::Shape;
using fusetrain::Tensor;

constexpr std::array<const char*, 5> kTasks = {"seq-cls", "token-cls", "qa", "mlm", "clm"};
constexpr int64_t B = 2, T = 8;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const std::filesystem::path dir = fuzz::scratch_dir() / "onnx";
  static const bool made = std::filesystem::create_directories(dir);
  (void)made;
  const std::string task = kTasks[(data[0] & 7) % kTasks.size()];
  const bool masked = (data[0] & 8) != 0;
  fuzz::write_file(dir / "model.onnx", fuzz::as_text(data + 1, size - 1));

  // Token ids 1 to 4 (inside every seed's vocabulary), the second row padded after 5 tokens.
  std::array<int64_t, B * T> ids{}, mask{}, token_labels{};
  std::array<int64_t, B> class_labels = {1, 0}, start = {1, 2}, end = {3, 4};
  for (int64_t k = 0; k < B * T; ++k) {
    const bool pad = k >= T && k % T >= 5;
    ids[size_t(k)] = pad ? 0 : 1 + (k * 7) % 4;
    mask[size_t(k)] = pad ? 0 : 1;
    token_labels[size_t(k)] = pad ? -100 : k % 2;
  }
  fusetrain::models::Batch batch;
  batch.input_ids = Tensor::view(ids.data(), Shape{B, T}, DType::i64);
  if (masked) batch.attention_mask = Tensor::view(mask.data(), Shape{B, T}, DType::i64);
  if (task == "seq-cls") {
    batch.labels = Tensor::view(class_labels.data(), Shape{B}, DType::i64);
  } else if (task == "qa") {
    batch.start_positions = Tensor::view(start.data(), Shape{B}, DType::i64);
    batch.end_positions = Tensor::view(end.data(), Shape{B}, DType::i64);
  } else {
    batch.labels = Tensor::view(token_labels.data(), Shape{B, T}, DType::i64);
  }
  fuzz::parses("Model::from_onnx", [&] {
    std::unique_ptr<fusetrain::models::Model> model = fusetrain::models::Model::from_onnx((dir / "model.onnx").string(),
                                                                                          task);
    const double loss = model->loss_and_grads(batch, /*training=*/true);
    fuzz::sink = fuzz::sink + static_cast<uint64_t>(loss == loss);
    for (const std::string& name : model->trainable_names()) fuzz::sink = fuzz::sink + fuzz::touch(model->gradient(name));
  });
  return 0;
}
