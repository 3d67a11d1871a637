// Feeds deterministically mutated safetensors files and JSON documents to the io readers. Built with
// -fsanitize=address,undefined (target fusetrain_io_asan), it proves that no input crashes a reader: every input
// either loads (and then every tensor's bytes are read) or is refused with fusetrain::Error.
//
// Usage: parse_fuzz [SEED_DIR] [--iterations N]
//   Built-in seeds (written with save_safetensors, plus hand-written headers and JSON) are always used; every
//   regular file in SEED_DIR is added. Each seed is mutated N times (default 2000).
// Exit status: 0 when nothing but fusetrain::Error escaped a reader and every loaded file kept open()'s promises
// (checked against the input bytes); 1 otherwise. A crash or sanitizer finding aborts the run.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <typeinfo>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"

namespace {

namespace fs = std::filesystem;
namespace io = fusetrain::io;
using fusetrain::DType;
using fusetrain::Tensor;

// splitmix64: small, fast and the same on every platform, so a failing input can be reproduced from its number.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(next() % n); }
};

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string with_length(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string s(8, '\0');
  std::memcpy(s.data(), &n, 8);
  return s + header + data;
}

std::vector<std::string> builtin_seeds(const fs::path& scratch) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32, DType::u8};
  for (int i = 0; i < 6; ++i) {
    Tensor t = Tensor::zeros({2, i + 1}, dtypes[i]);
    for (int64_t k = 0; k < t.numel(); ++k) t.set_item(k, static_cast<double>(k + i));
    tensors.emplace_back(std::string("layer.") + std::to_string(i) + ".weight", t);
  }
  tensors.emplace_back("empty", Tensor::zeros({0, 4}, DType::f32));
  tensors.emplace_back("scalar", Tensor::zeros({}, DType::i64));
  const fs::path saved = scratch / "seed.safetensors";
  io::save_safetensors(saved.string(), tensors, {{"format", "pt"}});
  std::vector<std::string> seeds = {read_bytes(saved)};
  seeds.push_back(with_length(
      R"({"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("__metadata__":{"k":"v"}}   )",
      std::string(11, '\x3f')));
  seeds.push_back(with_length("{}      ", ""));
  seeds.push_back(
      R"({"model_type": "bert", "hidden_size": 8, "layer_norm_eps": 1e-12, "architectures": ["BertModel"]})");
  seeds.push_back(R"({"metadata": {"total_size": 8}, "weight_map": {"a": "model-00001-of-00002.safetensors",)"
                  R"( "b": "model-00002-of-00002.safetensors"}})");
  return seeds;
}

const char* const kTokens[] = {"F32",          "BF16",       "I64",  "U8", "F64", "dtype", "shape", "data_offsets",
                               "__metadata__", "[",          "]",    "{",  "}",   ",",     ":",     "\"",
                               "weight_map",   "model_type", "null", ""};
const char* const kNumbers[] = {"-1",
                                "0",
                                "1",
                                "7",
                                "1e3",
                                "2.5",
                                "4294967296",
                                "9223372036854775807",
                                "9223372036854775808",
                                "18446744073709551615",
                                "18446744073709551616",
                                "1e999"};

// Applies one random edit: bit flips, byte values, truncation, header-length edits, JSON number and token edits,
// range deletion and duplication.
void mutate_once(std::string& s, Rng& rng) {
  switch (rng.below(10)) {
    case 0:
      for (size_t k = 1 + rng.below(4); k > 0 && !s.empty(); --k) s[rng.below(s.size())] ^= char(1 << rng.below(8));
      break;
    case 1:
      if (!s.empty()) s[rng.below(s.size())] = "\0\xff\"{}[],:-09e \x80\xc3"[rng.below(16)];
      break;
    case 2:
      s.resize(rng.below(s.size() + 1));
      break;
    case 3: {  // header length
      if (s.size() < 8) break;
      uint64_t n;
      std::memcpy(&n, s.data(), 8);
      const uint64_t choices[] = {0,
                                  n - 1,
                                  n + 1,
                                  s.size() - 8,
                                  s.size(),
                                  uint64_t{1} << 63,
                                  ~uint64_t{0},
                                  100'000'001,
                                  rng.next() % (s.size() + 16)};
      n = choices[rng.below(9)];
      std::memcpy(s.data(), &n, 8);
      break;
    }
    case 4: {  // replace a run of digits (and a leading minus) with an edge-case number
      size_t at = rng.below(s.size() + 1);
      size_t begin = s.find_first_of("0123456789", at);
      if (begin == std::string::npos) break;
      size_t end = s.find_first_not_of("0123456789", begin);
      if (end == std::string::npos) end = s.size();
      s.replace(begin, end - begin, kNumbers[rng.below(std::size(kNumbers))]);
      break;
    }
    case 5: {  // replace one token by another
      const std::string from = kTokens[rng.below(std::size(kTokens) - 1)];
      size_t at = s.find(from, rng.below(s.size() + 1));
      if (at == std::string::npos) at = s.find(from);
      if (at != std::string::npos) s.replace(at, from.size(), kTokens[rng.below(std::size(kTokens))]);
      break;
    }
    case 6:
      if (!s.empty()) {
        size_t at = rng.below(s.size());
        s.erase(at, 1 + rng.below(std::min<size_t>(16, s.size() - at)));
      }
      break;
    case 7:
      if (!s.empty()) {
        size_t at = rng.below(s.size()), length = 1 + rng.below(std::min<size_t>(32, s.size() - at));
        s.insert(rng.below(s.size() + 1), s.substr(at, length));
      }
      break;
    case 9: {  // move one tensor's byte range, keeping its length: overlaps, gaps, ranges past the end
      const std::string key = "\"data_offsets\":[";
      size_t at = s.find(key, rng.below(s.size() + 1));
      if (at == std::string::npos) at = s.find(key);
      if (at == std::string::npos) break;
      const size_t begin = at + key.size(), end = s.find(']', begin);
      if (end == std::string::npos) break;
      unsigned long long first = 0, last = 0;
      if (std::sscanf(s.substr(begin, end - begin).c_str(), "%llu,%llu", &first, &last) != 2) break;
      const unsigned long long shift = rng.below(24),
                               moved = rng.below(2) ? first + shift : first - std::min(first, shift);
      s.replace(begin, end - begin, std::to_string(moved) + "," + std::to_string(moved + (last - first)));
      break;
    }
    case 8:  // deep nesting
      s.insert(rng.below(s.size() + 1), std::string(1 + rng.below(5000), "[{"[rng.below(2)]));
      break;
  }
}

struct Counts {
  size_t inputs = 0, loaded = 0, refused = 0, unexpected = 0;
};

// Reads every byte of every tensor, so a view past the mapping shows up under ASan.
uint64_t touch(const Tensor& t) {
  uint64_t sum = 0;
  const unsigned char* p = static_cast<const unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];
  if (t.numel() > 0) sum += static_cast<uint64_t>(t.item(t.numel() - 1) != 0);
  return sum;
}

volatile uint64_t sink = 0;

// An oracle for what a successful open() promises, computed from the input bytes independently of the reader
// (ASan cannot see overreads of a file mapping): every entry lies inside the data section, its byte count matches
// its shape and dtype, no two entries overlap, and tensor() returns exactly the entry's bytes. "" when all hold.
std::string broken_promise(const std::string& bytes, const io::SafetensorsFile& file) {
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  const uint64_t data_start = 8 + header_bytes, data_bytes = bytes.size() - data_start;
  std::vector<const io::SafetensorsEntry*> nonempty;
  for (const io::SafetensorsEntry& e : file.entries()) {
    if (e.offset > data_bytes || e.nbytes > data_bytes - e.offset)
      return "tensor \"" + e.name + "\" lies outside the data section";
    if (static_cast<uint64_t>(e.shape.numel()) * fusetrain::dtype_size(e.dtype) != e.nbytes)
      return "tensor \"" + e.name + "\" has a byte count that does not match its shape";
    Tensor t = file.tensor(e.name);
    if (t.nbytes() != e.nbytes || (e.nbytes && std::memcmp(t.data(), bytes.data() + data_start + e.offset, e.nbytes)))
      return "tensor \"" + e.name + "\" does not hold its entry's bytes";
    if (e.nbytes) nonempty.push_back(&e);
  }
  for (size_t i = 1; i < nonempty.size(); ++i)  // entries() is sorted by offset
    if (nonempty[i]->offset < nonempty[i - 1]->offset + nonempty[i - 1]->nbytes)
      return "tensors \"" + nonempty[i - 1]->name + "\" and \"" + nonempty[i]->name + "\" overlap";
  return "";
}

template <typename F>
void attempt(Counts& counts, const std::string& what, F&& action) {
  ++counts.inputs;
  try {
    action();
    ++counts.loaded;
  } catch (const fusetrain::Error&) {
    ++counts.refused;
  } catch (const std::exception& e) {
    ++counts.unexpected;
    std::cerr << "parse_fuzz: " << what << ": " << typeid(e).name() << " escaped: " << e.what() << "\n";
  }
}

// Three model directories whose fixed files are written once; each input then replaces one file in one of them.
struct ModelDirs {
  fs::path weights, config, index;  // the input is model.safetensors, config.json, model.safetensors.index.json
  explicit ModelDirs(const fs::path& work) : weights(work / "weights"), config(work / "config"), index(work / "index") {
    Tensor w = Tensor::zeros({2}, DType::f32);
    for (const fs::path& dir : {weights, config, index}) fs::create_directories(dir);
    write_bytes(weights / "config.json", R"({"model_type": "bert"})");
    io::save_safetensors((config / "model.safetensors").string(), {{"a", w}});
    write_bytes(index / "config.json", R"({"model_type": "bert"})");
    io::save_safetensors((index / "model-00001-of-00002.safetensors").string(), {{"a", w}});
    io::save_safetensors((index / "model-00002-of-00002.safetensors").string(), {{"b", w}});
  }
};

// Runs the readers on `bytes`: as a safetensors file, as a JSON file, and as one file of a model directory
// (`role` 0: model.safetensors, 1: config.json, 2: model.safetensors.index.json).
void exercise(const std::string& bytes, const fs::path& work, const ModelDirs& dirs, int role, Counts& counts,
              const std::string& what) {
  const fs::path file = work / "input.safetensors";
  write_bytes(file, bytes);
  attempt(counts, what + " as safetensors", [&] {
    io::SafetensorsFile f = io::SafetensorsFile::open(file.string());
    if (std::string broken = broken_promise(bytes, f); !broken.empty()) {
      ++counts.unexpected;
      std::cerr << "parse_fuzz: " << what << " loaded, but " << broken << "\n";
    }
    for (const io::SafetensorsEntry& e : f.entries()) sink = sink + touch(f.tensor(e.name));
    for (const auto& [key, value] : f.metadata()) sink = sink + key.size() + value.size();
  });
  attempt(counts, what + " as JSON", [&] { sink = sink + io::read_json_file(file.string()).size(); });

  const fs::path& dir = role == 0 ? dirs.weights : role == 1 ? dirs.config : dirs.index;
  write_bytes(dir / (role == 0   ? "model.safetensors"
                     : role == 1 ? "config.json"
                                 : "model.safetensors.index.json"),
              bytes);
  attempt(counts, what + " in a model directory (role " + std::to_string(role) + ")", [&] {
    io::HfModelDir model = io::read_hf_dir(dir.string());
    for (const std::string& name : model.tensor_names()) sink = sink + touch(model.tensor(name));
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string seed_dir;
  size_t iterations = 2000;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--iterations" && i + 1 < argc)
      iterations = std::stoul(argv[++i]);
    else if (arg == "--help" || arg == "-h") {
      std::cout << "usage: parse_fuzz [SEED_DIR] [--iterations N]\n";
      return 0;
    } else
      seed_dir = arg;
  }
  const fs::path work = fs::temp_directory_path() / ("fusetrain_parse_fuzz_" + std::to_string(::getpid()));
  fs::create_directories(work);

  std::vector<std::string> seeds = builtin_seeds(work);
  if (!seed_dir.empty()) {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(seed_dir, error))
      if (entry.is_regular_file()) seeds.push_back(read_bytes(entry.path()));
    if (error) std::cerr << "parse_fuzz: cannot list " << seed_dir << ": " << error.message() << "\n";
  }

  const ModelDirs dirs(work);
  Counts counts;
  for (size_t s = 0; s < seeds.size(); ++s) {
    exercise(seeds[s], work, dirs, static_cast<int>(s % 3), counts, "seed " + std::to_string(s));
    for (size_t i = 0; i < iterations; ++i) {
      Rng rng{s * 1'000'003ull + i};
      std::string input = seeds[s];
      for (size_t edits = 1 + rng.below(3); edits > 0; --edits) mutate_once(input, rng);
      exercise(input, work, dirs, static_cast<int>(i % 3), counts,
               "seed " + std::to_string(s) + " mutation " + std::to_string(i));
    }
  }
  std::error_code ignored;
  fs::remove_all(work, ignored);
  std::cout << "parse_fuzz: " << seeds.size() << " seeds, " << counts.inputs << " reads: " << counts.loaded
            << " loaded, " << counts.refused << " refused with fusetrain::Error, " << counts.unexpected
            << " other exceptions or broken promises\n";
  return counts.unexpected == 0 ? 0 : 1;
}
