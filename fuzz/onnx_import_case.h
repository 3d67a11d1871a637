// What one input of the onnx_import fuzz target asks for, shared by the target (fuzz/onnx_import.cpp) and the C++
// test that replays its seeds and reproducers (tests/onnx/test_import.cpp), so both run an input alike.
//
// Byte 0 picks the task (its low 3 bits % 5: seq-cls, token-cls, qa, mlm, clm) and, in bit 3, whether the batch
// carries an attention mask; the rest is the ModelProto. The batch: 2 rows of 8 token ids from 1 to 4 (inside every
// seed's vocabulary), the second row padded after 5 tokens, with the task's labels.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "fusetrain/models/model.h"

namespace fusetrain::fuzz {

class OnnxImportCase {
 public:
  static constexpr int64_t B = 2, T = 8;

  explicit OnnxImportCase(uint8_t first) : task_(kTasks[(first & 7) % kTasks.size()]), masked_((first & 8) != 0) {
    for (int64_t k = 0; k < B * T; ++k) {
      const bool pad = k >= T && k % T >= 5;
      ids_[size_t(k)] = pad ? 0 : 1 + (k * 7) % 4;
      mask_[size_t(k)] = pad ? 0 : 1;
      token_labels_[size_t(k)] = pad ? -100 : k % 2;
    }
  }
  OnnxImportCase(const OnnxImportCase&) = delete;  // the batch views this object's arrays
  OnnxImportCase& operator=(const OnnxImportCase&) = delete;

  const std::string& task() const { return task_; }

  /// The batch, as views of this object's arrays.
  models::Batch batch() {
    models::Batch batch;
    batch.set("input_ids", Tensor::view(ids_.data(), Shape{B, T}, DType::i64));
    if (masked_) batch.set("attention_mask", Tensor::view(mask_.data(), Shape{B, T}, DType::i64));
    if (task_ == "seq-cls") {
      batch.set("labels", Tensor::view(classes_.data(), Shape{B}, DType::i64));
    } else if (task_ == "qa") {
      batch.set("start_positions", Tensor::view(start_.data(), Shape{B}, DType::i64));
      batch.set("end_positions", Tensor::view(end_.data(), Shape{B}, DType::i64));
    } else {
      batch.set("labels", Tensor::view(token_labels_.data(), Shape{B, T}, DType::i64));
    }
    return batch;
  }

 private:
  static constexpr std::array<const char*, 5> kTasks = {"seq-cls", "token-cls", "qa", "mlm", "clm"};

  std::string task_;
  bool masked_;
  std::array<int64_t, B * T> ids_{}, mask_{}, token_labels_{};
  std::array<int64_t, B> classes_ = {1, 0}, start_ = {1, 2}, end_ = {3, 4};
};

}  // namespace fusetrain::fuzz
