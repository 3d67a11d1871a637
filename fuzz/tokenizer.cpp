// A tokenizer.json: data::Tokenizer::from_file, then exercise_tokenizer (fuzz_support.h) encodes, truncates and
// decodes with it. The input is the tokenizer.json, optionally followed by a NUL byte and a text to encode (JSON
// text never holds a raw NUL, so the split is unambiguous).
#include <memory>

#include "fuzz_support.h"
#include "fusetrain/data/tokenizer.h"

namespace fuzz = fusetrain::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = (fuzz::scratch_dir() / "tokenizer.json").string();
  const std::string_view input = fuzz::as_text(data, size);
  const size_t nul = input.find('\0');
  fuzz::write_file(path, input.substr(0, nul));
  const std::string_view text = nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);
  std::unique_ptr<fusetrain::data::Tokenizer> tokenizer;
  fuzz::parses("Tokenizer::from_file", [&] { tokenizer = fusetrain::data::Tokenizer::from_file(path); });
  if (tokenizer) fuzz::exercise_tokenizer(*tokenizer, text);
  return 0;
}
