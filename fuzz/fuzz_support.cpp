#include "fuzz_support.h"

#include <cxxabi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <typeinfo>
#include <vector>

#include "fusetrain/data/tokenizer.h"

// Under AddressSanitizer a single allocation above this size fails (malloc and aligned_alloc return null), so a
// parser asked for a huge buffer reports its own "out of memory" Error instead of taking the machine's memory.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1:max_allocation_size_mb=64"; }
// UBSan reports say where the undefined operation was called from.
extern "C" const char* __ubsan_default_options() { return "print_stacktrace=1"; }

namespace fusetrain::fuzz {

namespace fs = std::filesystem;

volatile uint64_t sink = 0;

void fail(const std::string& message) {
  std::fprintf(stderr, "fuzz: %s\n", message.c_str());
  std::abort();
}

bool verbose() {
  static const bool on = std::getenv("FUSETRAIN_FUZZ_VERBOSE") != nullptr;
  return on;
}

void report_refusal(const char* what, const Error& error) {
  std::fprintf(stderr, "fuzz: %s refused the input: %s\n", what, error.what());
}

std::string type_name(const std::exception& e) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status),
                                              std::free);
  return status == 0 && name ? name.get() : typeid(e).name();
}

const fs::path& scratch_dir() {
  // Never destroyed: static objects are destroyed before the exit handler below would read one.
  static const fs::path* const dir = [] {
    const char* chosen = std::getenv("FUSETRAIN_FUZZ_SCRATCH");
    const fs::path base = chosen != nullptr                ? fs::path(chosen)
                          : fs::is_directory("/dev/shm") ? fs::path("/dev/shm")
                                                         : fs::temp_directory_path();
    const auto* d = new fs::path(base / ("fusetrain-fuzz-" + std::to_string(::getpid())));
    fs::create_directories(*d);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(scratch_dir(), ignored);
    });
    return d;
  }();
  return *dir;
}

std::vector<RoleFile> make_role_dirs(std::initializer_list<std::pair<const char*, const char*>> roles) {
  std::vector<RoleFile> out;
  for (const auto& [name, file] : roles) {
    out.push_back({file, scratch_dir() / name});
    fs::create_directories(out.back().dir);
  }
  return out;
}

const RoleFile* replace_role_file(const std::vector<RoleFile>& roles, const uint8_t* data, size_t size) {
  if (size == 0) return nullptr;
  const RoleFile& role = roles[data[0] % roles.size()];
  write_file(role.dir / role.file, as_text(data + 1, size - 1));
  return &role;
}

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

uint64_t touch(const Tensor& tensor) {
  uint64_t sum = 0;
  const auto* p = static_cast<const unsigned char*>(tensor.data());
  for (size_t i = 0; i < tensor.nbytes(); ++i) sum += p[i];
  if (tensor.numel() > 0) sum += static_cast<uint64_t>(tensor.item(tensor.numel() - 1) != 0);
  return sum;
}

namespace {

std::string utf8(uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else {  // the byte-level alphabet stays below U+0800
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

// Fails the run unless `encoding` has one type id, mask entry and offset per id, each offset inside its text.
void check_encoding(const data::Encoding& encoding, size_t first_length, size_t second_length, const char* what) {
  const size_t n = encoding.ids.size();
  if (encoding.type_ids.size() != n || encoding.special_tokens_mask.size() != n || encoding.offsets.size() != n)
    fail(str(what, ": ", n, " ids but ", encoding.type_ids.size(), " type ids, ", encoding.special_tokens_mask.size(),
             " mask entries and ", encoding.offsets.size(), " offsets"));
  const size_t longest = std::max(first_length, second_length);
  for (size_t i = 0; i < n; ++i) {
    const auto [begin, end] = encoding.offsets[i];
    if (begin < 0 || begin > end || static_cast<size_t>(end) > longest)
      fail(str(what, ": token ", i, " (id ", encoding.ids[i], ") has offsets (", begin, ", ", end,
               ") outside a text of ", longest, " bytes"));
  }
}

}  // namespace

// GPT-2's byte-level vocabulary: the 256 byte symbols (printable Latin-1 bytes as themselves, the others from U+0100
// on), a few merges of them, and RoBERTa's special tokens.
void write_byte_level_files(const fs::path& dir) {
  std::string vocab = R"({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3)";
  int64_t id = 4;
  uint32_t shifted = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    std::string symbol = utf8(printable ? b : shifted++);
    if (symbol == "\"" || symbol == "\\") symbol = "\\" + symbol;
    vocab += ", \"" + symbol + "\": " + std::to_string(id++);
  }
  const char* merges[] = {"Ġ t", "h e", "l l", "ll o", "he llo", "Ġt he", "Ġ w", "o r"};
  std::string merges_text = "#version: 0.2\n";
  for (const char* merge : merges) {
    std::string token = merge;
    token.erase(token.find(' '), 1);
    vocab += ", \"" + token + "\": " + std::to_string(id++);
    merges_text += std::string(merge) + "\n";
  }
  vocab += ", \"<mask>\": " + std::to_string(id) + "}";
  write_file(dir / "vocab.json", vocab);
  write_file(dir / "merges.txt", merges_text);
  write_file(dir / "config.json", R"({"model_type": "roberta"})");
  write_file(dir / "tokenizer_config.json", R"({"add_prefix_space": false, "tokenizer_class": "RobertaTokenizer"})");
}

void write_wordpiece_files(const fs::path& dir) {
  write_file(dir / "vocab.txt",
                   "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n,\n!\n'\n.\ns\nit\nna\n##ive\ncafe\n##s\n2024\n"
                   "a\nb\nc\n東\n京\n##fi\n");
  write_file(dir / "tokenizer_config.json", R"({"do_lower_case": true, "strip_accents": null})");
  write_file(dir / "special_tokens_map.json",
                   R"({"cls_token": "[CLS]", "mask_token": {"content": "[MASK]"}, "pad_token": "[PAD]"})");
}

void exercise_tokenizer(data::Tokenizer& tokenizer, std::string_view text) {
  // The input's text takes every path; two fixed texts (non-ASCII with a ligature and CJK, special tokens' strings
  // and control characters) make sure each tokenizer also sees text its vocabulary was built for.
  const std::string_view fixed[] = {"  Naïve café — 東京 ﬁ, it's 2024!  ", "[CLS] [MASK] <s> </s> <unk>\tb\r\n"};
  parses("Tokenizer::encode", [&] {
    for (bool special : {true, false}) {
      data::Encoding encoding = tokenizer.encode(text, special);
      check_encoding(encoding, text.size(), 0, "Tokenizer::encode");
      sink = sink + tokenizer.decode(encoding.ids, special).size();
    }
    check_encoding(tokenizer.encode_pair(text, fixed[0]), text.size(), fixed[0].size(), "Tokenizer::encode_pair");
    tokenizer.set_truncation(6);
    check_encoding(tokenizer.encode_pair(fixed[1], text), fixed[1].size(), text.size(), "truncated encode_pair");
    check_encoding(tokenizer.encode(text), text.size(), 0, "truncated encode");
    tokenizer.set_truncation(0);
    sink = sink + static_cast<uint64_t>(tokenizer.token_to_id(text));
  });
  for (std::string_view t : fixed) {
    parses("Tokenizer::encode", [&] {
      data::Encoding encoding = tokenizer.encode(t);
      check_encoding(encoding, t.size(), 0, "Tokenizer::encode");
      sink = sink + tokenizer.decode(encoding.ids).size();
    });
  }
  parses("Tokenizer::decode", [&] {
    const int64_t v = tokenizer.vocab_size();
    std::vector<int64_t> ids = {-1, v, v + 7, INT64_MAX, INT64_MIN};
    for (int64_t id = 0; id < std::min<int64_t>(v, 16); ++id) ids.push_back(id);
    for (int64_t id : ids) sink = sink + tokenizer.id_to_token(id).size();
    sink = sink + tokenizer.decode(ids, false).size() + tokenizer.decode(ids, true).size();
    for (int64_t id : {tokenizer.pad_id(), tokenizer.unk_id(), tokenizer.cls_id(), tokenizer.sep_id(),
                       tokenizer.mask_id(), tokenizer.bos_id(), tokenizer.eos_id()})
      sink = sink + static_cast<uint64_t>(id) + tokenizer.special_ids().size();
  });
}

}  // namespace fusetrain::fuzz
