// Evaluation metrics: classification accuracy and F1, and entity-level scores for BIO-tagged sequences.
#include <algorithm>
#include <cctype>
#include <set>
#include <tuple>

#include "fusetrain/core/error.h"
#include "fusetrain/train/trainer.h"

namespace fusetrain::train {
namespace {

// A tag's prefix ('B', 'I' or 'O') and entity type: "B-PER" -> ('B', "PER"), "O" -> ('O', "").
std::pair<char, std::string> split_tag(const std::string& tag) {
  if (tag.size() >= 2 && (tag[0] == 'B' || tag[0] == 'I') && (tag[1] == '-' || tag[1] == '_'))
    return {tag[0], tag.substr(2)};
  return {'O', ""};
}

// The entities of one sequence as (type, first, last): a B-X starts one, as does an I-X that does not continue an
// entity of type X (conlleval's lenient reading, seqeval's default).
std::vector<std::tuple<std::string, size_t, size_t>> entities(const std::vector<std::string>& tags) {
  std::vector<std::tuple<std::string, size_t, size_t>> out;
  std::string type;  // the open entity's type; empty when none is open
  size_t first = 0;
  for (size_t i = 0; i <= tags.size(); ++i) {
    auto [prefix, kind] = i < tags.size() ? split_tag(tags[i]) : std::pair<char, std::string>{'O', ""};
    const bool continues = prefix == 'I' && kind == type && !type.empty();
    if (!continues && !type.empty()) {
      out.emplace_back(type, first, i - 1);
      type.clear();
    }
    if (prefix != 'O' && !continues) {
      type = kind;
      first = i;
    }
  }
  return out;
}

}  // namespace

bool is_bio(const std::vector<std::string>& label_names) {
  bool any_entity = false;
  for (const std::string& name : label_names) {
    if (name == "O") continue;
    if (split_tag(name).first == 'O') return false;
    any_entity = true;
  }
  return any_entity;
}

std::map<std::string, double> entity_metrics(const std::vector<std::vector<std::string>>& predicted,
                                             const std::vector<std::vector<std::string>>& reference) {
  FT_CHECK(predicted.size() == reference.size(), "entity_metrics: ", predicted.size(), " predicted sequences for ",
           reference.size(), " reference sequences");
  size_t found = 0, expected = 0, correct = 0, tokens = 0, tokens_right = 0;
  for (size_t s = 0; s < predicted.size(); ++s) {
    FT_CHECK(predicted[s].size() == reference[s].size(), "entity_metrics: sequence ", s, " has ",
             predicted[s].size(), " predicted tags for ", reference[s].size(), " reference tags");
    auto mine = entities(predicted[s]), theirs = entities(reference[s]);
    std::set<std::tuple<std::string, size_t, size_t>> truth(theirs.begin(), theirs.end());
    found += mine.size();
    expected += theirs.size();
    for (const auto& entity : mine) correct += truth.count(entity);
    tokens += predicted[s].size();
    for (size_t i = 0; i < predicted[s].size(); ++i) tokens_right += predicted[s][i] == reference[s][i];
  }
  const double precision = found ? static_cast<double>(correct) / static_cast<double>(found) : 0.0;
  const double recall = expected ? static_cast<double>(correct) / static_cast<double>(expected) : 0.0;
  return {{"precision", precision},
          {"recall", recall},
          {"f1", precision + recall > 0 ? 2 * precision * recall / (precision + recall) : 0.0},
          {"accuracy", tokens ? static_cast<double>(tokens_right) / static_cast<double>(tokens) : 0.0}};
}

std::map<std::string, double> classification_metrics(const Predictions& p) {
  const int64_t K = p.classes;
  std::vector<int64_t> true_positive(static_cast<size_t>(K)), predicted(static_cast<size_t>(K)),
      actual(static_cast<size_t>(K));
  int64_t correct = 0, n = static_cast<int64_t>(p.labels.size());
  for (int64_t r = 0; r < n; ++r) {
    const float* row = p.logits.data() + r * K;
    int64_t best = std::max_element(row, row + K) - row;
    int64_t label = p.labels[static_cast<size_t>(r)];
    correct += best == label;
    ++predicted[static_cast<size_t>(best)];
    if (label >= 0 && label < K) ++actual[static_cast<size_t>(label)];
    if (best == label) ++true_positive[static_cast<size_t>(best)];
  }
  auto f1_of = [&](int64_t k) {
    double tp = static_cast<double>(true_positive[static_cast<size_t>(k)]);
    double denominator = static_cast<double>(predicted[static_cast<size_t>(k)] + actual[static_cast<size_t>(k)]);
    return denominator > 0 ? 2 * tp / denominator : 0.0;
  };
  double f1 = 0;
  if (K == 2)
    f1 = f1_of(1);
  else {
    for (int64_t k = 0; k < K; ++k) f1 += f1_of(k);
    f1 /= static_cast<double>(std::max<int64_t>(K, 1));
  }
  return {{"accuracy", n ? static_cast<double>(correct) / static_cast<double>(n) : 0.0}, {"f1", f1}};
}

namespace {

// Levenshtein distance between two sequences (one row of the table at a time).
template <typename T>
int64_t edit_distance(const std::vector<T>& a, const std::vector<T>& b) {
  std::vector<int64_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int64_t>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int64_t diagonal = row[0];
    row[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int64_t up = row[j];
      row[j] = std::min({up + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  size_t at = 0;
  while (at < text.size()) {
    while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
    const size_t start = at;
    while (at < text.size() && !std::isspace(static_cast<unsigned char>(text[at]))) ++at;
    if (at > start) words.push_back(text.substr(start, at - start));
  }
  return words;
}

// The text's Unicode code points (UTF-8 decoded; a stray byte counts as one), ends stripped of whitespace.
std::vector<uint32_t> chars_of(const std::string& text) {
  size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  std::vector<uint32_t> out;
  for (size_t i = begin; i < end;) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n && i + k < end; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

}  // namespace

std::map<std::string, double> transcription_metrics(const std::vector<std::string>& predictions,
                                                    const std::vector<std::string>& references) {
  FT_CHECK(predictions.size() == references.size(), "transcription metrics: ", predictions.size(),
           " transcriptions for ", references.size(), " references");
  int64_t word_edits = 0, words = 0, char_edits = 0, chars = 0;
  for (size_t i = 0; i < references.size(); ++i) {
    const std::vector<std::string> ref = words_of(references[i]), hyp = words_of(predictions[i]);
    word_edits += edit_distance(hyp, ref);
    words += static_cast<int64_t>(ref.size());
    const std::vector<uint32_t> ref_chars = chars_of(references[i]), hyp_chars = chars_of(predictions[i]);
    char_edits += edit_distance(hyp_chars, ref_chars);
    chars += static_cast<int64_t>(ref_chars.size());
  }
  std::map<std::string, double> out;
  if (words > 0) out["wer"] = static_cast<double>(word_edits) / static_cast<double>(words);
  if (chars > 0) out["cer"] = static_cast<double>(char_edits) / static_cast<double>(chars);
  return out;
}

}  // namespace fusetrain::train
