// A Hugging Face model directory: io::read_hf_dir, then every tensor read in full. The first input byte chooses
// which file of a valid directory the rest of the input replaces (byte % 5):
//   0 model.safetensors          (config.json fixed)
//   1 config.json                (model.safetensors fixed)
//   2 model.safetensors.index.json (config.json and two shards fixed)
//   3 model-00001-of-00002.safetensors, a shard the fixed index names
//   4 generation_config.json     (config.json and model.safetensors fixed)
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"

namespace {

namespace fs = std::filesystem;
namespace io = fusetrain::io;
namespace fuzz = fusetrain::fuzz;
using fusetrain::DType;
using fusetrain::Tensor;

constexpr const char* kConfig = R"({"model_type": "bert", "architectures": ["BertModel"]})";
constexpr const char* kIndex =
    R"({"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors",)"
    R"( "b": "model-00002-of-00002.safetensors"}})";

// One directory per role, each valid before the input replaces its file.
std::vector<fuzz::RoleFile> make_dirs() {
  std::vector<fuzz::RoleFile> roles = fuzz::make_role_dirs({{"weights", "model.safetensors"},
                                                            {"config", "config.json"},
                                                            {"index", "model.safetensors.index.json"},
                                                            {"shard", "model-00001-of-00002.safetensors"},
                                                            {"generation", "generation_config.json"}});
  Tensor a = Tensor::zeros({2}, DType::f32), b = Tensor::zeros({2, 1}, DType::bf16);
  for (const fuzz::RoleFile& role : roles) fuzz::write_file(role.dir / "config.json", kConfig);
  for (const fs::path& dir : {roles[1].dir, roles[4].dir})
    io::save_safetensors((dir / "model.safetensors").string(), {{"a", a}});
  for (const fs::path& dir : {roles[2].dir, roles[3].dir}) {
    fuzz::write_file(dir / "model.safetensors.index.json", kIndex);
    io::save_safetensors((dir / "model-00001-of-00002.safetensors").string(), {{"a", a}});
    io::save_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"b", b}});
  }
  return roles;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<fuzz::RoleFile> roles = make_dirs();
  const fuzz::RoleFile* role = fuzz::replace_role_file(roles, data, size);
  if (role != nullptr)
    fuzz::parses("read_hf_dir", [&] {
      io::HfModelDir model = io::read_hf_dir(role->dir.string());
      for (const std::string& name : model.tensor_names()) fuzz::sink = fuzz::sink + fuzz::touch(model.tensor(name));
      if (model.generation_config) fuzz::sink = fuzz::sink + model.generation_config->size();
    });
  return 0;
}
