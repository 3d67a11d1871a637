// LoRA adapters (Hu et al. 2021) as PEFT defines them: a targeted Linear y = x·Wᵀ + b becomes
// y = x·Wᵀ + b + s·(dropout(x)·Aᵀ)·Bᵀ with A (r, in), B (out, r) and s = alpha / r (alpha / √r with rsLoRA);
// the base weights are frozen.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fusetrain/core/dtype.h"

namespace fusetrain::models {

/// One adapter of a LoRA model: module "<m>" with parameters "<m>.lora_A.weight" (r, in) and "<m>.lora_B.weight"
/// (out, r); `weight` is the base weight it adapts and `in_out` whether that weight is stored (in, out) (GPT-2's
/// Conv1D) rather than Linear's (out, in).
struct LoraAdapter {
  std::string module;
  std::string weight;
  int64_t in = 0, out = 0;
  bool in_out = false;
};

/// What PEFT's LoraConfig says, for the fields fusetrain reads.
struct LoraConfig {
  int64_t r = 8;                ///< adapter rank, > 0
  double alpha = 8.0;           ///< lora_alpha
  double dropout = 0.0;         ///< lora_dropout on the adapter's input, in [0, 1)
  /// Modules whose Linear gets an adapter, by name or name suffix as PEFT matches them ("q_proj" matches
  /// "model.layers.0.self_attn.q_proj"); ["all-linear"]: every Linear but the output layer.
  std::vector<std::string> target_modules;
  /// Modules trained in full next to the adapters (PEFT's modules_to_save, e.g. "score" for classification).
  std::vector<std::string> modules_to_save;
  bool use_rslora = false;          ///< s = alpha / √r instead of alpha / r
  DType base_dtype = DType::f32;    ///< frozen projection weights kept in f32 or bf16 (half the memory)
  uint64_t seed = 0;                ///< draws A (kaiming-uniform, as PEFT); B starts at zero
  /// QLoRA: the frozen projection weights named in `quantized` are held quantised in bitsandbytes' layouts.
  /// `quant_type` "nf4" or "fp4": blocks of `quant_blocksize` elements, each weight as "<weight>" (the packed codes,
  /// u8), "<weight>.absmax" (f32, one a block) and "<weight>.quant_map" (the format's 16 values). "int8" (LLM.int8):
  /// "<weight>" (int8 codes as u8, one an element) and "<weight>.absmax" (f32, one a row: bitsandbytes' SCB).
  /// load_state_dict gives them (a bitsandbytes model's own) or Model::from_pretrained quantises the checkpoint's
  /// weights as it loads them. Their GEMMs dequantise them (QuantizedLinear), 4-bit values rounded to bf16 when
  /// `quant_bf16` (bitsandbytes' compute dtype). "" : no quantised weight.
  std::string quant_type;
  int64_t quant_blocksize = 64;
  bool quant_bf16 = true;
  std::vector<std::string> quantized;
  /// Whether Model::enable_lora quantises the `quantized` weights from the model's own weights (the CLI's
  /// --base-dtype nf4|fp4|int8, with bitsandbytes' codes: quant::quantize_4bit, quant::quantize_int8_rows) rather
  /// than leaving them for load_state_dict to give.
  bool quantize_base = false;

  /// The scale s applied to the adapter's output.
  double scaling() const;
  /// Whether module `name` (a dotted module path) is one `patterns` names.
  static bool matches(const std::vector<std::string>& patterns, const std::string& name);
  /// Throws Error naming the field when a value is out of range.
  void validate() const;
  /// PEFT's adapter_config.json for these settings (peft_type LORA, `task_type`).
  nlohmann::json to_peft_json(const std::string& task_type, const std::string& base_model) const;
  /// Reads PEFT's adapter_config.json (Error naming the file and field on anything fusetrain cannot honour:
  /// another peft_type, DoRA, per-layer rank or alpha patterns, bias training, layers_to_transform).
  static LoraConfig from_peft_json(const nlohmann::json& json, const std::string& file);
};

}  // namespace fusetrain::models
