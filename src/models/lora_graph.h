// LoRA as a rewrite of a built model graph: adapters beside the targeted projections, base weights frozen.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "fusetrain/ir/graph.h"
#include "fusetrain/models/lora.h"

namespace fusetrain::models::lora {

using Adapter = LoraAdapter;

/// Name of the adapter matrices of `module`.
std::string a_name(const std::string& module);
std::string b_name(const std::string& module);

/// Adds an adapter to every projection whose weight's module `config` targets and freezes every parameter that is
/// neither an adapter nor under config.modules_to_save. Frozen weights named in `bf16_weights` are kept in bf16: a
/// cast of theirs to bf16 reads them directly, any other reader gets a cast to f32. `training` enables the
/// adapters' dropout. "all-linear" adapts every projection but those under `head_prefixes` (the output layers).
/// Values the caller holds in `watched` that an adapted projection produced now name the sum with the adapter.
/// Throws Error when a target names no module, or a module that is not a projection. Without `with_adapters` the
/// base is frozen (and kept in bf16) as it is, with no adapter added: the graph of the model's reference (PEFT's
/// disable_adapter).
std::vector<Adapter> apply(ir::Graph& graph, const LoraConfig& config, bool training,
                           const std::set<std::string>& bf16_weights, const std::vector<std::string>& head_prefixes,
                           const std::vector<ir::ValueId*>& watched = {}, bool with_adapters = true);

/// The frozen weights of `graph` (an applied graph) that only projections and embedding lookups read: those
/// config.base_dtype = bf16 keeps in bf16 (a lookup gathers bf16 rows and casts them to f32).
std::set<std::string> bf16_candidates(const ir::Graph& graph);

/// The frozen weights of `graph` (an applied graph) a QLoRA base holds quantised, as bitsandbytes' load_in_4bit /
/// load_in_8bit replaces nn.Linear layers: every (out, in) weight that only Linear projections read, but those under
/// `head_prefixes` (the output layer stays in full precision).
std::vector<std::string> quantizable(const ir::Graph& graph, const std::vector<std::string>& head_prefixes);

}  // namespace fusetrain::models::lora
