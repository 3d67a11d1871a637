// What the fuzz targets share: the rule they assert, a scratch directory for the files a parser reads by path, and
// helpers that read everything a parser returned (so a view past its buffer shows up under AddressSanitizer).
//
// The rule: an input either parses or is refused with fusetrain::Error. Any other exception aborts the run with its
// type and message, so libFuzzer records the input as a crash, as it does for sanitizer reports, leaks and signals.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/core/tensor.h"

namespace fusetrain::data {
class Tokenizer;
}

namespace fusetrain::fuzz {

/// Prints "fuzz: <message>" and aborts: libFuzzer saves the input as a crash.
[[noreturn]] void fail(const std::string& message);

/// The demangled dynamic type of `e`, e.g. "std::out_of_range".
std::string type_name(const std::exception& e);

/// True when FUSETRAIN_FUZZ_VERBOSE is set: every refusal is then printed (to see why a seed does not parse).
bool verbose();

/// Prints "fuzz: <what> refused the input: <message>".
void report_refusal(const char* what, const Error& error);

/// Runs `parse`; fusetrain::Error is the expected refusal, any other exception fails the run with its type and
/// message. Returns true when `parse` returned normally.
template <typename F>
bool parses(const char* what, F&& parse) {
  try {
    parse();
    return true;
  } catch (const Error& e) {
    if (verbose()) report_refusal(what, e);
    return false;
  } catch (const std::exception& e) {
    fail(str(what, ": ", type_name(e), " escaped (only fusetrain::Error may): ", e.what()));
  } catch (...) {
    fail(str(what, ": an exception not derived from std::exception escaped"));
  }
}

/// A directory private to this process, created on first use and removed at exit (a crash leaves it): under
/// $FUSETRAIN_FUZZ_SCRATCH when set, else /dev/shm when there is one, else the temporary directory.
const std::filesystem::path& scratch_dir();

/// One file of a prepared, valid directory, for the targets whose first input byte chooses which file the rest of
/// the input replaces.
struct RoleFile {
  std::string file;
  std::filesystem::path dir;
};

/// Creates scratch_dir()/<name> for each role given as {name, file}.
std::vector<RoleFile> make_role_dirs(std::initializer_list<std::pair<const char*, const char*>> roles);

/// Writes the input after its first byte over the file of role data[0] % roles.size() and returns that role, or
/// nullptr for an empty input.
const RoleFile* replace_role_file(const std::vector<RoleFile>& roles, const uint8_t* data, size_t size);

/// Writes `bytes` to `path`, replacing it.
void write_file(const std::filesystem::path& path, std::string_view bytes);

/// The input as a string view.
inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

/// Reads every byte of `tensor` and its last element; the sum keeps the reads from being optimised away.
uint64_t touch(const Tensor& tensor);

/// Writes a BERT WordPiece tokenizer's vocab.txt (lower-case words, "##" pieces and the five special tokens),
/// tokenizer_config.json and special_tokens_map.json into `dir`.
void write_wordpiece_files(const std::filesystem::path& dir);

/// Writes a RoBERTa byte-level BPE tokenizer's vocab.json (the 256 byte symbols, a few merges, <s> </s> <pad> <unk>
/// <mask>), merges.txt, tokenizer_config.json and config.json into `dir`.
void write_byte_level_files(const std::filesystem::path& dir);

/// Encodes `text` with `tokenizer` (alone and as either text of a pair, with and without special tokens and
/// truncation) and two fixed texts, decodes the ids (and ids outside the vocabulary), and looks tokens up; fails the
/// run when an encoding breaks its promises (one type id, mask entry and offset per id; offsets inside the text).
void exercise_tokenizer(data::Tokenizer& tokenizer, std::string_view text);

/// Where touch() sums go.
extern volatile uint64_t sink;

}  // namespace fusetrain::fuzz
