// Decoders: WordPiece, ByteLevel, Metaspace, BPEDecoder, Replace, ByteFallback, Fuse, Strip, Sequence.
#include <cctype>
#include <nlohmann/json.hpp>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

using nlohmann::json;

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  size_t at = s.find(from);
  while (at != std::string::npos) {
    s.replace(at, from.size(), to);
    at = s.find(from, at + to.size());
  }
}

// Bytes to text, each maximal invalid subsequence becoming U+FFFD (Rust's String::from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const auto b0 = static_cast<unsigned char>(bytes[i]);
    if (b0 < 0x80) {
      out.push_back(static_cast<char>(b0));
      ++i;
      continue;
    }
    size_t need = 0;
    unsigned char low = 0x80, high = 0xBF;  // range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      need = 1;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      need = 2;
      if (b0 == 0xE0) low = 0xA0;
      if (b0 == 0xED) high = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      need = 3;
      if (b0 == 0xF0) low = 0x90;
      if (b0 == 0xF4) high = 0x8F;
    }
    size_t j = i + 1;
    bool valid = need > 0;
    for (size_t k = 0; valid && k < need; ++k, ++j) {
      if (j >= bytes.size()) {
        valid = false;
        break;
      }
      const auto b = static_cast<unsigned char>(bytes[j]);
      const bool ok = k == 0 ? (b >= low && b <= high) : (b >= 0x80 && b <= 0xBF);
      if (!ok) {
        valid = false;
        break;
      }
    }
    if (valid) {
      out.append(bytes.data() + i, j - i);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i = j;
  }
  return out;
}

class WordPieceDecoder final : public Decoder {
 public:
  WordPieceDecoder(std::string prefix, bool cleanup) : prefix_(std::move(prefix)), cleanup_(cleanup) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& token = tokens[i];
      if (i != 0) {
        if (token.compare(0, prefix_.size(), prefix_) == 0) {
          token.erase(0, prefix_.size());
        } else {
          token.insert(token.begin(), ' ');
        }
      }
      if (cleanup_) cleanup(token);
    }
  }
  // BERT's detokenization clean-up, in the library's order.
  static void cleanup(std::string& s) {
    static const std::pair<const char*, const char*> kRules[] = {
        {" .", "."},   {" ?", "?"},           {" !", "!"},   {" ,", ","},     {" ' ", "'"},   {" n't", "n't"},
        {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
    for (const auto& [from, to] : kRules) replace_all(s, from, to);
  }

 private:
  std::string prefix_;
  bool cleanup_;
};

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) {
      const size_t mark = bytes.size();
      bool all = true;
      size_t i = 0;
      while (i < token.size()) {
        const int b = byte_of_char(unicode::next_char(token, i));
        if (b < 0) {
          all = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
      }
      if (!all) {  // not byte-level text (an added token): its own bytes
        bytes.resize(mark);
        bytes += token;
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, bool drop_first) : drop_first_(drop_first) {
    unicode::append_utf8(replacement_, replacement);
  }
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) replace_all(tokens[i], replacement_, (i == 0 && drop_first_) ? "" : " ");
  }

 private:
  std::string replacement_;
  bool drop_first_;
};

class BpeDecoder final : public Decoder {
 public:
  explicit BpeDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) replace_all(tokens[i], suffix_, i + 1 == tokens.size() ? "" : " ");
  }

 private:
  std::string suffix_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::string pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) replace_all(token, pattern_, content_);
  }

 private:
  std::string pattern_, content_;
};

// Runs of "<0xNN>" tokens become the text their bytes spell (U+FFFD per byte when that is not valid UTF-8).
class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    size_t pending = 0;
    auto flush = [&] {
      if (pending == 0) return;
      if (unicode::find_invalid_utf8(bytes) == std::string::npos) {
        out.push_back(bytes);
      } else {
        for (size_t k = 0; k < pending; ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      bytes.clear();
      pending = 0;
    };
    for (std::string& token : tokens) {
      int byte = -1;
      if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>') {
        const std::string hex = token.substr(3, 2);
        if (std::isxdigit(static_cast<unsigned char>(hex[0])) && std::isxdigit(static_cast<unsigned char>(hex[1]))) {
          byte = std::stoi(hex, nullptr, 16);
        }
      }
      if (byte >= 0) {
        bytes.push_back(static_cast<char>(byte));
        ++pending;
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined += token;
    tokens.assign(1, std::move(joined));
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop) : start_(start), stop_(stop) {
    unicode::append_utf8(content_, content);
  }
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      for (size_t k = 0; k < start_ && token.compare(0, content_.size(), content_) == 0; ++k) {
        token.erase(0, content_.size());
      }
      for (size_t k = 0; k < stop_ && token.size() >= content_.size() &&
                         token.compare(token.size() - content_.size(), content_.size(), content_) == 0;
           ++k) {
        token.erase(token.size() - content_.size());
      }
    }
  }

 private:
  std::string content_;
  size_t start_, stop_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

char32_t one_char(const json& value, const std::string& where, const char* what) {
  const std::string s = value.get<std::string>();
  size_t i = 0;
  FT_CHECK(!s.empty() && unicode::find_invalid_utf8(s) == std::string::npos, where, ": ", what,
           " is not one character");
  const char32_t c = unicode::next_char(s, i);
  FT_CHECK(i == s.size(), where, ": ", what, " ", value.dump(), " is not one character");
  return c;
}

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& config, const std::string& where) {
  if (config.is_null()) return nullptr;
  const std::string type = config.value("type", "");
  if (type == "WordPiece") {
    return std::make_unique<WordPieceDecoder>(config.value("prefix", std::string("##")), config.value("cleanup", true));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    bool drop_first = config.value("add_prefix_space", true);
    if (config.contains("prepend_scheme")) drop_first = config.at("prepend_scheme").get<std::string>() != "never";
    return std::make_unique<MetaspaceDecoder>(
        one_char(config.value("replacement", json("\u2581")), where, "Metaspace decoder replacement"), drop_first);
  }
  if (type == "BPEDecoder") return std::make_unique<BpeDecoder>(config.value("suffix", std::string("</w>")));
  if (type == "Replace") {
    const json& pattern = config.at("pattern");
    FT_CHECK(pattern.contains("String"), where, ": Replace decoder pattern ", pattern.dump(),
             " is not supported (only {\"String\": ...} patterns are)");
    return std::make_unique<ReplaceDecoder>(pattern.at("String").get<std::string>(),
                                            config.value("content", std::string()));
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    const std::string what = str(where, ": Strip decoder");
    return std::make_unique<StripDecoder>(one_char(config.at("content"), where, "Strip decoder content"),
                                          integer_field(config, "start", 0, what, 0, kMaxTokenId),
                                          integer_field(config, "stop", 0, what, 0, kMaxTokenId));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const json& step : config.at("decoders")) {
      if (auto decoder = make_decoder(step, where)) steps.push_back(std::move(decoder));
    }
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  throw Error(str(where, ": decoder type \"", type,
                  "\" is not supported (supported: WordPiece, ByteLevel, Metaspace, BPEDecoder, Replace, "
                  "ByteFallback, Fuse, Strip, Sequence)"));
}

}  // namespace fusetrain::data::detail
