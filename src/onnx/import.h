// ONNX import: an ONNX ModelProto as a models::Family, so models::Model trains it through the same pipeline as
// the families fusetrain builds natively (see docs/architecture.md, "ONNX import").
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fusetrain/models/registry.h"
#include "fusetrain/onnx/import.h"

namespace fusetrain::models {
class Family;
class Model;
}  // namespace fusetrain::models

namespace fusetrain::onnx_import {

/// Reads the ONNX file at `path` and checks every node against the op-mapping table. Throws Error listing every
/// unsupported op and where it occurs.
std::unique_ptr<models::Family> make_onnx_family(const std::string& path, models::Head head,
                                                 const nlohmann::json& config, const ImportOptions& options);

/// Whether `family` was imported from ONNX.
bool is_onnx_family(const models::Family& family);

}  // namespace fusetrain::onnx_import
