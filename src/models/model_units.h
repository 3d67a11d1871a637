// The helpers Model's units share (model.cpp, model_load.cpp, model_lora.cpp, model_inputs.cpp, weights.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fusetrain/core/tensor.h"
#include "fusetrain/kernels/device.h"
#include "fusetrain/models/model.h"
#include "fusetrain/runtime/parameters.h"
#include "models/family.h"

namespace fusetrain::models {

// ---- weights.cpp: weights between host memory and the Device

/// Whether `s` begins with `prefix`.
bool starts_with(const std::string& s, const std::string& prefix);
/// The family of a registry row, built from a config.
std::unique_ptr<Family> family_for(const ArchitectureInfo& info, const nlohmann::json& config);
/// Error naming `where` if `src` (any float dtype) holds inf or NaN.
void check_finite(const Tensor& src, const std::string& where);
/// `src` (f32, bf16 or f16; checked finite) as f32 into host memory at `dst`.
void copy_converted(float* dst, const Tensor& src, const std::string& where);
/// Uploads `src` (host memory, any float dtype, checked finite) into the parameter `dest` (the device's memory: f32,
/// or bf16 for a frozen base weight kept in bf16, or a quantised weight's u8 codes taken as they are), converted on
/// the host a slice at a time: no host copy of a whole weight (an 8B model's embedding is 2 GB of f32).
void copy_into(const kernels::Device& device, const Tensor& dest, const Tensor& src, const std::string& where);
/// Uploads host f32 values into the f32 parameter `dest`.
void upload_values(const kernels::Device& device, const Tensor& dest, const std::vector<float>& values);
/// The store's trained parameters, named `prefix` + name, for writing to a file: views of the device's memory where
/// the host reads it in place, else copies downloaded into `copies`.
std::vector<std::pair<std::string, Tensor>> host_tensors(const runtime::ParameterStore& store,
                                                         const std::string& prefix,
                                                         std::vector<std::vector<uint8_t>>& copies);
/// Fills every parameter as the architecture initialises it, from one seeded stream (drawn on the host, uploaded).
void initialise(runtime::ParameterStore& params, const Family& family, uint64_t seed);
/// The parameter store of the family's graphs, on the default device.
std::unique_ptr<runtime::ParameterStore> layout_parameters(const Family& family);

// ---- model_inputs.cpp: a batch's inputs checked against the model's declaration

/// Error unless `t` (named `what`) is int64 of shape (B, T).
void require_ids(const Tensor& t, const char* what, int64_t B, int64_t T);

}  // namespace fusetrain::models
