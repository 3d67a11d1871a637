// fusetrain_tokenize: encodes each line of a text file with a fusetrain tokenizer, for parity tests and benchmarks.
//
//   fusetrain_tokenize [options] TOKENIZER TEXT_FILE
//     TOKENIZER        a tokenizer.json, or a model directory (Tokenizer::from_pretrained)
//     --pair-tsv       each line is "first<TAB>second", encoded as a pair
//     --no-special     no special tokens (add_special_tokens = false)
//     --max-length N   truncation to N tokens (longest_first for pairs)
//     --output WHAT    ids (default), offsets ("start:end"), type_ids, special_mask, decode (the ids decoded,
//                      special tokens skipped)
//     --threads T      encode with encode_batch on T threads
//     --bench N        encode the whole file N times; print "tokens <count> seconds <time>" for the encoding
//                      alone (file reading excluded), nothing else
// Output: one line per input line, values separated by spaces.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/data/tokenizer.h"

namespace {

using fusetrain::data::Encoding;
using fusetrain::data::Tokenizer;

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in, path, ": cannot open text file");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

int usage() {
  std::fprintf(stderr,
               "usage: fusetrain_tokenize [--pair-tsv] [--no-special] [--max-length N] [--output "
               "ids|offsets|type_ids|special_mask|decode] [--threads T] [--bench N] TOKENIZER TEXT_FILE\n");
  return 2;
}

int run(int argc, char** argv) {
  bool pairs = false, special = true;
  int64_t max_length = 0;
  int threads = 1, bench = 0;
  std::string output = "ids";
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      FT_CHECK(i + 1 < argc, "fusetrain_tokenize: ", arg, " needs a value");
      return argv[++i];
    };
    if (arg == "--pair-tsv") {
      pairs = true;
    } else if (arg == "--no-special") {
      special = false;
    } else if (arg == "--max-length") {
      max_length = std::stoll(value());
    } else if (arg == "--output") {
      output = value();
    } else if (arg == "--threads") {
      threads = std::stoi(value());
    } else if (arg == "--bench") {
      bench = std::stoi(value());
    } else if (!arg.empty() && arg[0] == '-') {
      return usage();
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) return usage();
  const std::string& source = positional[0];
  auto tokenizer =
      std::filesystem::is_directory(source) ? Tokenizer::from_pretrained(source) : Tokenizer::from_file(source);
  tokenizer->set_truncation(max_length);
  const std::vector<std::string> lines = read_lines(positional[1]);

  if (bench > 0) {
    size_t tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int round = 0; round < bench; ++round) {
      for (const Encoding& e : tokenizer->encode_batch(lines, threads)) tokens += e.ids.size();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("tokens %zu seconds %.6f\n", tokens, seconds);
    return 0;
  }

  std::vector<Encoding> encodings;
  if (pairs) {
    for (const std::string& line : lines) {
      const size_t tab = line.find('\t');
      FT_CHECK(tab != std::string::npos, positional[1], ": --pair-tsv line without a tab: ", line);
      encodings.push_back(tokenizer->encode_pair(line.substr(0, tab), line.substr(tab + 1), special));
    }
  } else if (!special || threads <= 1) {
    for (const std::string& line : lines) encodings.push_back(tokenizer->encode(line, special));
  } else {
    encodings = tokenizer->encode_batch(lines, threads);
  }
  std::string out;
  for (const Encoding& e : encodings) {
    if (output == "decode") {
      out += tokenizer->decode(e.ids);
    } else {
      for (size_t k = 0; k < e.ids.size(); ++k) {
        if (k) out += ' ';
        if (output == "ids") {
          out += std::to_string(e.ids[k]);
        } else if (output == "offsets") {
          out += std::to_string(e.offsets[k].first) + ":" + std::to_string(e.offsets[k].second);
        } else if (output == "type_ids") {
          out += std::to_string(e.type_ids[k]);
        } else if (output == "special_mask") {
          out += std::to_string(e.special_tokens_mask[k]);
        } else {
          throw fusetrain::Error(fusetrain::str("fusetrain_tokenize: --output \"", output,
                                                "\" is not one of ids, offsets, ", "type_ids, special_mask, decode"));
        }
      }
    }
    out += '\n';
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusetrain_tokenize: %s\n", e.what());
    return 1;
  }
}
