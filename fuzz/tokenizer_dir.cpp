// A model directory's tokenizer files without a tokenizer.json: data::Tokenizer::from_pretrained, then
// exercise_tokenizer (fuzz_support.h). The first input byte chooses which file of a valid directory the rest of the
// input replaces (byte % 7):
//   0 vocab.txt, 1 tokenizer_config.json, 2 special_tokens_map.json    of a BERT WordPiece directory
//   3 vocab.json, 4 merges.txt, 5 tokenizer_config.json, 6 config.json  of a RoBERTa byte-level BPE directory
#include <memory>
#include <vector>

#include "fuzz_support.h"
#include "fusetrain/data/tokenizer.h"

namespace {

namespace fuzz = fusetrain::fuzz;

// One directory per role, each valid before the input replaces its file.
std::vector<fuzz::RoleFile> make_dirs() {
  std::vector<fuzz::RoleFile> roles = fuzz::make_role_dirs({{"wp_vocab", "vocab.txt"},
                                                            {"wp_config", "tokenizer_config.json"},
                                                            {"wp_special", "special_tokens_map.json"},
                                                            {"bpe_vocab", "vocab.json"},
                                                            {"bpe_merges", "merges.txt"},
                                                            {"bpe_config", "tokenizer_config.json"},
                                                            {"bpe_model_config", "config.json"}});
  for (size_t i = 0; i < roles.size(); ++i) {
    if (i < 3)
      fuzz::write_wordpiece_files(roles[i].dir);
    else
      fuzz::write_byte_level_files(roles[i].dir);
  }
  return roles;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<fuzz::RoleFile> roles = make_dirs();
  std::unique_ptr<fusetrain::data::Tokenizer> tokenizer;
  if (const fuzz::RoleFile* role = fuzz::replace_role_file(roles, data, size))
    fuzz::parses("Tokenizer::from_pretrained",
                 [&] { tokenizer = fusetrain::data::Tokenizer::from_pretrained(role->dir.string()); });
  if (tokenizer) fuzz::exercise_tokenizer(*tokenizer, "");
  return 0;
}
