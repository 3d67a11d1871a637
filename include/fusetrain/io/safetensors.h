// safetensors: read (memory-mapped, validated on open) and write (atomically).
//
// Format: 8-byte little-endian header length N, N bytes of JSON header
// {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...},
// then the data section; offsets are relative to the start of the data section.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/shape.h"
#include "fusetrain/core/tensor.h"

namespace fusetrain::io {

/// One tensor's header entry. `offset` is relative to the start of the data section.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  size_t offset = 0;
  size_t nbytes = 0;
};

/// The safetensors dtype string for a DType: "F32", "BF16", "F16", "I64", "I32", "U8".
const char* safetensors_dtype_name(DType dtype);

/// A safetensors file mapped read-only (mmap) and validated on open: every entry's dtype, shape and byte range
/// is checked, so tensor() never reads outside the file. Copies share the mapping.
class SafetensorsFile {
 public:
  /// Maps and validates `path`; throws Error naming the file (and the tensor, where one is at fault).
  static SafetensorsFile open(const std::string& path);

  /// The path given to open().
  const std::string& path() const { return path_; }
  /// Every tensor, ordered by data offset (the order of the bytes in the file).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  /// The entry named `name`, or nullptr if the file has none.
  const SafetensorsEntry* find(const std::string& name) const;
  /// True if the file has a tensor named `name`.
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  /// The tensor named `name`: a view into the mapping that keeps the mapping alive. The memory is read-only
  /// (writing through the view faults); clone() it for a mutable copy. A tensor whose bytes are not aligned to
  /// its element size in the file is returned as an aligned owning copy instead. Throws Error naming the file and
  /// the tensor if absent.
  Tensor tensor(const std::string& name) const;
  /// The free-form string map stored under "__metadata__" (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
  std::shared_ptr<void> mapping_;  // the whole file, unmapped when the last file or tensor referencing it goes
  const char* data_ = nullptr;     // start of the data section inside the mapping
};

/// Writes `tensors` (F32, BF16, F16, I64, I32, U8) to `path` in the safetensors format: "__metadata__" first
/// (omitted when empty), then one entry per tensor in the order given, with contiguous data offsets in that order;
/// the JSON is compact and padded with spaces to a multiple of 8 bytes, as the safetensors library writes it.
/// The file is written to "<path>.tmp-<pid>", fsynced and renamed over `path`, so a failure never leaves a
/// truncated file at `path` (an existing file there stays intact). Every floating-point tensor is checked for inf
/// and NaN as it is written: a non-finite value stops the write and throws Error naming the tensor (a non-finite
/// weight is never saved). Throws Error on duplicate or reserved names, undefined tensors, or any I/O failure.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// One contiguous piece of bytes to write. With `finite_name` set, the bytes are values of the floating type
/// `dtype` that must all be finite: the writer checks each block just before writing it, and a non-finite value
/// fails the write with an Error naming `finite_name`.
struct ByteSpan {
  const void* data = nullptr;
  size_t size = 0;
  const char* finite_name = nullptr;
  DType dtype = DType::u8;
};

/// The io layer's crash-safe writer: writes the concatenation of `pieces` to "<path>.tmp-<pid>", fsyncs it,
/// renames it over `path` and fsyncs the directory. On failure the temporary file is removed, `path` is left as it
/// was, and Error names the file and the failing step (or the tensor holding a non-finite value).
void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces);

/// Copies the file `from` to `to` with write_file_atomic (so a full disk is an Error saying so, and `to` is either
/// the old file or the whole copy); an Error names `from` if it cannot be read.
void copy_file_atomic(const std::string& from, const std::string& to);

}  // namespace fusetrain::io
