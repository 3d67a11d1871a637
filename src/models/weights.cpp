// Weights between host memory and the Device: conversion, upload, initialisation, views or downloads for saving.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/quant.h"
#include "models/family.h"
#include "models/model_units.h"

namespace fusetrain::models {

// The family of a registry row, built from a config.
std::unique_ptr<Family> family_for(const ArchitectureInfo& info, const nlohmann::json& config) {
  return info.make_family(info.head, config);
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Refuses a weight holding inf or NaN; `where` names the tensor (and its file).
void check_finite(const Tensor& src, const std::string& where) {
  const int64_t bad = find_nonfinite(src.data(), src.dtype(), src.numel());
  FT_CHECK(bad < 0, where, " holds a non-finite value at element ", bad,
           "; a model with inf or NaN weights cannot be trained or evaluated (was it saved from a diverged run?)");
}

// Copies `src` into f32 storage; a value inf or NaN, which no weight may hold, is refused.
void copy_converted(float* dst, const Tensor& src, const std::string& where) {
  check_finite(src, where);
  switch (src.dtype()) {
    case DType::f32:
      std::memcpy(dst, src.data(), src.nbytes());
      return;
    case DType::bf16:
      bf16_to_float(dst, static_cast<const uint16_t*>(src.data()), static_cast<size_t>(src.numel()));
      return;
    case DType::f16:
      f16_to_float(dst, static_cast<const uint16_t*>(src.data()), static_cast<size_t>(src.numel()));
      return;
    default:
      throw Error(str("expected a floating-point tensor, found ", dtype_name(src.dtype())));
  }
}

// Uploads `src` (host memory, any float dtype, checked finite) into the parameter `dest` (the device's memory: f32,
// or bf16 for a frozen base weight kept in bf16, or a quantised weight's u8 codes taken as they are), converted on
// the host a slice at a time: no host copy of a whole weight (an 8B model's embedding is 2 GB of f32).
void copy_into(const kernels::Device& device, const Tensor& dest, const Tensor& src, const std::string& where) {
  if (dest.dtype() == DType::u8) {
    FT_CHECK(src.dtype() == DType::u8, where, ": a quantised weight's codes are uint8; found ", dtype_name(src.dtype()));
    device.upload(dest.data(), src.data(), static_cast<size_t>(src.nbytes()));
    return;
  }
  FT_CHECK(dest.dtype() == DType::f32 || dest.dtype() == DType::bf16, where, ": cannot store into a ",
           dtype_name(dest.dtype()), " parameter");
  if (dest.dtype() == src.dtype()) {  // f32 into f32, bf16 into bf16: as it is
    check_finite(src, where);
    device.upload(dest.data(), src.data(), static_cast<size_t>(src.nbytes()));
    return;
  }
  constexpr int64_t kSlice = int64_t{1} << 16;  // 256 KiB of f32: a host buffer glibc hands back
  const int64_t n = src.numel();
  const size_t item = dtype_size(src.dtype());
  std::vector<float> tmp(static_cast<size_t>(std::min(n, kSlice)));
  std::vector<uint16_t> narrow(dest.dtype() == DType::bf16 ? tmp.size() : 0);
  for (int64_t begin = 0; begin < n; begin += kSlice) {
    const int64_t count = std::min(kSlice, n - begin);
    const Tensor slice = Tensor::view(const_cast<char*>(static_cast<const char*>(src.data())) + size_t(begin) * item,
                                      Shape{count}, src.dtype());
    copy_converted(tmp.data(), slice, where);
    if (dest.dtype() == DType::f32) {
      device.upload(dest.data_as<float>() + begin, tmp.data(), static_cast<size_t>(count) * sizeof(float));
    } else {
      float_to_bf16(narrow.data(), tmp.data(), static_cast<size_t>(count));
      device.upload(static_cast<uint16_t*>(dest.data()) + begin, narrow.data(), static_cast<size_t>(count) * 2);
    }
  }
}

// The store's trained parameters, named `prefix` + name, for writing to a file: views of the device's memory where
// the host reads it in place, else copies downloaded into `copies`.
std::vector<std::pair<std::string, Tensor>> host_tensors(const runtime::ParameterStore& store,
                                                         const std::string& prefix,
                                                         std::vector<std::vector<uint8_t>>& copies) {
  std::vector<std::pair<std::string, Tensor>> out;
  const bool in_place = store.device().host_visible();
  for (size_t i = 0; i < store.slots().size(); ++i) {
    Tensor t = store.param(i);
    if (!in_place) {
      copies.emplace_back(t.nbytes());
      store.device().download(copies.back().data(), t.data(), t.nbytes());
      t = Tensor::view(copies.back().data(), t.shape(), t.dtype());
    }
    out.emplace_back(prefix + store.slots()[i].name, t);
  }
  return out;
}

// Uploads host f32 values into the f32 parameter `dest`.
void upload_values(const kernels::Device& device, const Tensor& dest, const std::vector<float>& values) {
  device.upload(dest.data(), values.data(), values.size() * sizeof(float));
}


// Fills every parameter as the architecture initialises it, from one seeded stream: each drawn on the host a slice at
// a time (one small buffer for the whole model, so loading keeps no weight-sized host copy) and uploaded.
void initialise(runtime::ParameterStore& params, const Family& family, uint64_t seed) {
  constexpr int64_t kSlice = int64_t{1} << 16;
  std::mt19937_64 rng(seed);
  std::vector<float> slice(static_cast<size_t>(kSlice));
  const kernels::Device& device = params.device();
  for (size_t i = 0; i < params.slots().size(); ++i) {
    const runtime::ParamSlot& slot = params.slots()[i];
    const ParamInit init = family.init(slot.name);
    float* dest = params.param(i).data_as<float>();  // device memory, written only by upload
    const bool draws = init.kind == Init::Normal && init.stddev > 0.0;  // normal(0, 0), as torch draws it: zeros
    const float fill = init.kind == Init::Ones ? 1.0f : 0.0f;
    std::normal_distribution<float> normal(0.0f, static_cast<float>(draws ? init.stddev : 1.0));
    // A padding row (the embedding's pad_token_id) is zero.
    const bool zero_row = draws && init.zero_row >= 0 && slot.shape.rank() == 2 && init.zero_row < slot.shape[0];
    const int64_t row_begin = zero_row ? init.zero_row * slot.shape[1] : 0;
    const int64_t row_end = zero_row ? row_begin + slot.shape[1] : 0;
    for (int64_t begin = 0; begin < slot.numel; begin += kSlice) {
      const int64_t count = std::min(kSlice, slot.numel - begin);
      for (int64_t k = 0; k < count; ++k) {
        const int64_t e = begin + k;
        slice[static_cast<size_t>(k)] = draws ? normal(rng) : fill;
        if (e >= row_begin && e < row_end) slice[static_cast<size_t>(k)] = 0.0f;
      }
      device.upload(dest + begin, slice.data(), static_cast<size_t>(count) * sizeof(float));
    }
  }
}

std::unique_ptr<runtime::ParameterStore> layout_parameters(const Family& family) {
  BatchSpec probe;
  BuiltGraph built = family.build(probe);
  return std::make_unique<runtime::ParameterStore>(built.graph);
}

}  // namespace fusetrain::models
