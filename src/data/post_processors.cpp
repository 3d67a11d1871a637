// Post-processors: BertProcessing, RobertaProcessing, ByteLevel (offset trimming), TemplateProcessing, Sequence.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "data/tokenizer_impl.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

using nlohmann::json;

struct SpecialToken {
  std::string token;
  int64_t id = -1;
};

Part special(const int64_t& id, int64_t type_id) {
  Part part;
  part.id = id;
  part.type_id = type_id;
  return part;
}

Part sequence(int index, int64_t type_id = -1) {
  Part part;
  part.sequence = index;
  part.type_id = type_id;
  return part;
}

// Moves offsets past leading and before trailing whitespace (tokenizers' byte_level::process_offsets). With
// add_prefix_space, the first token keeps the single space that was added in front of it. The library counts in
// characters (Python offsets are character offsets), so offsets move by characters of the input here too.
void trim_offsets(Segment& segment, bool add_prefix_space) {
  if (segment.leading.size() != segment.size()) return;
  const std::string_view text = segment.text;
  auto is_continuation = [&](int64_t at) { return (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80; };
  for (size_t i = 0; i < segment.size(); ++i) {
    auto& [start, end] = segment.offsets[i];
    int64_t leading = segment.leading[i];
    const int64_t trailing = segment.trailing[i];
    if (leading > 0) {
      const bool is_first = i == 0 || start == 0;
      if (is_first && add_prefix_space && leading == 1) leading = 0;
      int64_t moved = start;
      for (int64_t k = 0; k < leading && moved < static_cast<int64_t>(text.size()); ++k) {
        ++moved;
        while (moved < static_cast<int64_t>(text.size()) && is_continuation(moved)) ++moved;
      }
      start = std::min(moved, end);
    }
    if (trailing > 0) {
      int64_t moved = end, steps = 0;
      while (steps < trailing && moved > 0) {
        --moved;
        while (moved > 0 && is_continuation(moved)) --moved;
        ++steps;
      }
      if (steps == trailing) end = std::max(moved, start);  // only when `end` is at least `trailing` characters in
    }
  }
}

class BertProcessing final : public PostProcessor {
 public:
  BertProcessing(SpecialToken cls, SpecialToken sep) : cls_(std::move(cls)), sep_(std::move(sep)) {}
  size_t added_tokens(bool is_pair) const override { return is_pair ? 3 : 2; }
  void process(std::vector<Segment>& segments, std::vector<Part>& parts, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    parts.clear();
    parts.push_back(special(cls_.id, 0));
    parts.push_back(sequence(0));
    parts.push_back(special(sep_.id, 0));
    if (segments.size() > 1) {
      parts.push_back(sequence(1));
      parts.push_back(special(sep_.id, 1));
    }
  }
  std::vector<std::string> single_special_tokens() const override { return {cls_.token, sep_.token}; }

 private:
  SpecialToken cls_, sep_;
};

class RobertaProcessing final : public PostProcessor {
 public:
  RobertaProcessing(SpecialToken cls, SpecialToken sep, bool trim, bool add_prefix_space)
      : cls_(std::move(cls)), sep_(std::move(sep)), trim_(trim), add_prefix_space_(add_prefix_space) {}
  size_t added_tokens(bool is_pair) const override { return is_pair ? 4 : 2; }
  bool trims_offsets() const override { return trim_; }
  void process(std::vector<Segment>& segments, std::vector<Part>& parts, bool add_special_tokens) const override {
    for (Segment& s : segments) {
      if (trim_) trim_offsets(s, add_prefix_space_);
      std::fill(s.type_ids.begin(), s.type_ids.end(), 0);  // RoBERTa has a single token type
    }
    if (!add_special_tokens) return;
    parts.clear();
    for (size_t k = 0; k < segments.size(); ++k) {
      parts.push_back(special(k == 0 ? cls_.id : sep_.id, 0));
      parts.push_back(sequence(static_cast<int>(k)));
      parts.push_back(special(sep_.id, 0));
    }
  }
  std::vector<std::string> single_special_tokens() const override { return {cls_.token, sep_.token}; }

 private:
  SpecialToken cls_, sep_;
  bool trim_, add_prefix_space_;
};

class ByteLevelProcessing final : public PostProcessor {
 public:
  ByteLevelProcessing(bool trim, bool add_prefix_space) : trim_(trim), add_prefix_space_(add_prefix_space) {}
  size_t added_tokens(bool) const override { return 0; }
  bool trims_offsets() const override { return trim_; }
  void process(std::vector<Segment>& segments, std::vector<Part>&, bool) const override {
    if (!trim_) return;
    for (Segment& s : segments) trim_offsets(s, add_prefix_space_);
  }

 private:
  bool trim_, add_prefix_space_;
};

class TemplateProcessing final : public PostProcessor {
 public:
  struct Item {
    bool is_sequence;
    int sequence;      // 0 for A, 1 for B
    std::string name;  // special token
    int64_t type_id;
  };
  struct Special {
    std::vector<int64_t> ids;
    std::vector<std::string> tokens;
  };

  TemplateProcessing(std::vector<Item> single, std::vector<Item> pair,
                     std::unordered_map<std::string, Special> specials)
      : single_(std::move(single)), pair_(std::move(pair)), specials_(std::move(specials)) {}

  size_t added_tokens(bool is_pair) const override {
    size_t n = 0;
    for (const Item& item : is_pair ? pair_ : single_) {
      if (!item.is_sequence) n += specials_.at(item.name).ids.size();
    }
    return n;
  }

  void process(std::vector<Segment>& segments, std::vector<Part>& parts, bool add_special_tokens) const override {
    const std::vector<Item>& items = segments.size() > 1 ? pair_ : single_;
    parts.clear();
    for (const Item& item : items) {
      if (item.is_sequence) {
        parts.push_back(sequence(std::min(item.sequence, static_cast<int>(segments.size()) - 1), item.type_id));
      } else if (add_special_tokens) {
        Part part;
        part.ids = &specials_.at(item.name).ids;
        part.type_id = item.type_id;
        parts.push_back(part);
      }
    }
  }

  std::vector<std::string> single_special_tokens() const override {
    std::vector<std::string> tokens;
    for (const Item& item : single_) {
      if (item.is_sequence) continue;
      const auto& special = specials_.at(item.name);
      tokens.insert(tokens.end(), special.tokens.begin(), special.tokens.end());
    }
    return tokens;
  }

 private:
  std::vector<Item> single_, pair_;
  std::unordered_map<std::string, Special> specials_;
};

class SequenceProcessing final : public PostProcessor {
 public:
  explicit SequenceProcessing(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  size_t added_tokens(bool is_pair) const override {
    size_t n = 0;
    for (const auto& step : steps_) n += step->added_tokens(is_pair);
    return n;
  }
  bool trims_offsets() const override {
    return std::any_of(steps_.begin(), steps_.end(), [](const auto& step) { return step->trims_offsets(); });
  }
  void process(std::vector<Segment>& segments, std::vector<Part>& parts, bool add_special_tokens) const override {
    for (const auto& step : steps_) step->process(segments, parts, add_special_tokens);
  }
  std::vector<std::string> single_special_tokens() const override {
    std::vector<std::string> tokens;
    for (const auto& step : steps_) {
      auto more = step->single_special_tokens();
      tokens.insert(tokens.end(), more.begin(), more.end());
    }
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

SpecialToken read_special(const json& config, const char* key, const std::string& where, const std::string& type) {
  const auto it = config.find(key);
  FT_CHECK(it != config.end() && it->is_array() && it->size() == 2, where, ": ", type, " \"", key,
           "\" should be [token, id]");
  return SpecialToken{(*it)[0].get<std::string>(),
                      json_integer((*it)[1], str(where, ": ", type, " \"", key, "\" id"), 0, kMaxTokenId)};
}

std::vector<TemplateProcessing::Item> read_template(const json& items, const std::string& where) {
  std::vector<TemplateProcessing::Item> out;
  FT_CHECK(items.is_array(), where, ": TemplateProcessing template ", items.dump(), " is not a list");
  const std::string type_id_what = str(where, ": TemplateProcessing item");
  for (const json& item : items) {
    if (item.contains("Sequence")) {
      const json& sequence = item.at("Sequence");
      const std::string id = sequence.at("id").get<std::string>();
      FT_CHECK(id == "A" || id == "B", where, ": TemplateProcessing sequence id \"", id, "\" is not A or B");
      out.push_back({true, id == "A" ? 0 : 1, "", integer_field(sequence, "type_id", 0, type_id_what, 0, kMaxTokenId)});
    } else if (item.contains("SpecialToken")) {
      const json& special = item.at("SpecialToken");
      out.push_back({false, 0, special.at("id").get<std::string>(),
                     integer_field(special, "type_id", 0, type_id_what, 0, kMaxTokenId)});
    } else {
      throw Error(str(where, ": TemplateProcessing item ", item.dump(), " is neither Sequence nor SpecialToken"));
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<PostProcessor> make_post_processor(const json& config, const std::string& where) {
  if (config.is_null()) return nullptr;
  const std::string type = config.value("type", "");
  if (type == "BertProcessing") {
    return std::make_unique<BertProcessing>(read_special(config, "cls", where, type),
                                            read_special(config, "sep", where, type));
  }
  if (type == "RobertaProcessing") {
    return std::make_unique<RobertaProcessing>(
        read_special(config, "cls", where, type), read_special(config, "sep", where, type),
        config.value("trim_offsets", true), config.value("add_prefix_space", true));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelProcessing>(config.value("trim_offsets", true),
                                                 config.value("add_prefix_space", true));
  }
  if (type == "TemplateProcessing") {
    std::unordered_map<std::string, TemplateProcessing::Special> specials;
    if (auto it = config.find("special_tokens"); it != config.end()) {
      for (const auto& [name, value] : it->items()) {
        TemplateProcessing::Special special;
        const json& ids = value.at("ids");
        FT_CHECK(ids.is_array(), where, ": TemplateProcessing special token \"", name, "\": \"ids\" is not a list");
        for (const json& id : ids)
          special.ids.push_back(json_integer(id, str(where, ": TemplateProcessing special token \"", name, "\" id"), 0,
                                             kMaxTokenId));
        special.tokens = value.at("tokens").get<std::vector<std::string>>();
        specials.emplace(value.value("id", name), std::move(special));
      }
    }
    auto single = read_template(config.at("single"), where);
    auto pair = read_template(config.at("pair"), where);
    for (const auto* items : {&single, &pair}) {
      for (const auto& item : *items) {
        FT_CHECK(item.is_sequence || specials.count(item.name), where, ": TemplateProcessing uses special token \"",
                 item.name, "\", which its \"special_tokens\" does not define");
      }
    }
    return std::make_unique<TemplateProcessing>(std::move(single), std::move(pair), std::move(specials));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (const json& step : config.at("processors")) {
      if (auto processor = make_post_processor(step, where)) steps.push_back(std::move(processor));
    }
    return std::make_unique<SequenceProcessing>(std::move(steps));
  }
  throw Error(str(where, ": post_processor type \"", type,
                  "\" is not supported (supported: BertProcessing, RobertaProcessing, ByteLevel, TemplateProcessing, "
                  "Sequence)"));
}

}  // namespace fusetrain::data::detail
