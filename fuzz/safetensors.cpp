// A safetensors file: io::SafetensorsFile::open on the input bytes. When it opens, every promise open() makes is
// checked against the input itself (ASan cannot see reads past a file mapping): each entry lies inside the data
// section, its byte count matches its shape and dtype, no two entries overlap, and tensor() returns exactly the
// entry's bytes. Then every tensor is read in full and the metadata walked.
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "fusetrain/io/safetensors.h"

namespace {

namespace io = fusetrain::io;
namespace fuzz = fusetrain::fuzz;

// The first promise of a successful open() that the file breaks, "" when it keeps them all.
std::string broken_promise(std::string_view bytes, const io::SafetensorsFile& file) {
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  const uint64_t data_start = 8 + header_bytes, data_bytes = bytes.size() - data_start;
  std::vector<const io::SafetensorsEntry*> nonempty;
  for (const io::SafetensorsEntry& e : file.entries()) {
    if (e.offset > data_bytes || e.nbytes > data_bytes - e.offset)
      return "tensor \"" + e.name + "\" lies outside the data section";
    if (static_cast<uint64_t>(e.shape.numel()) * fusetrain::dtype_size(e.dtype) != e.nbytes)
      return "tensor \"" + e.name + "\" has a byte count that does not match its shape";
    fusetrain::Tensor t = file.tensor(e.name);
    if (t.nbytes() != e.nbytes || (e.nbytes && std::memcmp(t.data(), bytes.data() + data_start + e.offset, e.nbytes)))
      return "tensor \"" + e.name + "\" does not hold its entry's bytes";
    if (e.nbytes) nonempty.push_back(&e);
  }
  for (size_t i = 1; i < nonempty.size(); ++i)  // entries() is sorted by offset
    if (nonempty[i]->offset < nonempty[i - 1]->offset + nonempty[i - 1]->nbytes)
      return "tensors \"" + nonempty[i - 1]->name + "\" and \"" + nonempty[i]->name + "\" overlap";
  return "";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = (fuzz::scratch_dir() / "input.safetensors").string();
  const std::string_view bytes = fuzz::as_text(data, size);
  fuzz::write_file(path, bytes);
  fuzz::parses("SafetensorsFile::open", [&] {
    io::SafetensorsFile file = io::SafetensorsFile::open(path);
    if (std::string broken = broken_promise(bytes, file); !broken.empty())
      fuzz::fail("SafetensorsFile::open accepted the file, but " + broken);
    for (const io::SafetensorsEntry& e : file.entries()) fuzz::sink = fuzz::sink + fuzz::touch(file.tensor(e.name));
    for (const auto& [key, value] : file.metadata()) fuzz::sink = fuzz::sink + key.size() + value.size();
  });
  return 0;
}
