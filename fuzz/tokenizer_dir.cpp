// A model directory's tokenizer files without a tokenizer.json: data::Tokenizer::from_pretrained, then
// exercise_tokenizer (fuzz_support.h). The first input byte chooses which file of a valid directory the rest of the
// input replaces (byte % 7):
//   0 vocab.txt, 1 tokenizer_config.json, 2 special_tokens_map.json    of a BERT WordPiece directory
//   3 vocab.json, 4 merges.txt, 5 tokenizer_config.json, 6 config.json  of a RoBERTa byte-level BPE directory
#include <array>
#include <memory>
#include <string>

#include "fuzz_support.h"
#include "fusetrain/data/tokenizer.h"

namespace {

namespace fs = std::filesystem;
namespace fuzz = fusetrain::fuzz;

struct Role {
  const char* file;  // the file the input replaces
  fs::path dir;
};

// One directory per role, each valid before the input replaces its file.
std::array<Role, 7> make_dirs() {
  const fs::path root = fuzz::scratch_dir();
  std::array<Role, 7> roles = {{{"vocab.txt", root / "wp_vocab"},
                                {"tokenizer_config.json", root / "wp_config"},
                                {"special_tokens_map.json", root / "wp_special"},
                                {"vocab.json", root / "bpe_vocab"},
                                {"merges.txt", root / "bpe_merges"},
                                {"tokenizer_config.json", root / "bpe_config"},
                                {"config.json", root / "bpe_model_config"}}};
  for (size_t i = 0; i < roles.size(); ++i) {
    fs::create_directories(roles[i].dir);
    if (i < 3)
      fuzz::write_wordpiece_files(roles[i].dir);
    else
      fuzz::write_byte_level_files(roles[i].dir);
  }
  return roles;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::array<Role, 7> roles = make_dirs();
  if (size == 0) return 0;
  const Role& role = roles[data[0] % roles.size()];
  fuzz::write_file(role.dir / role.file, fuzz::as_text(data + 1, size - 1));
  std::unique_ptr<fusetrain::data::Tokenizer> tokenizer;
  fuzz::parses("Tokenizer::from_pretrained",
               [&] { tokenizer = fusetrain::data::Tokenizer::from_pretrained(role.dir.string()); });
  if (tokenizer) fuzz::exercise_tokenizer(*tokenizer, "");
  return 0;
}
