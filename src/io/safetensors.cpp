#include "fusetrain/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "fusetrain/core/error.h"
#include "fusetrain/io/json_fields.h"

namespace fusetrain::io {

// The file format is little-endian; so is every machine fusetrain targets.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian machine");

namespace {

using json = nlohmann::json;

// The safetensors library refuses headers above 100 MB; so do we (a corrupt length must not make us parse 2^64 bytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeEntry {
  const char* name;
  DType dtype;
};
constexpr DTypeEntry kDTypes[] = {{"F32", DType::f32}, {"BF16", DType::bf16}, {"F16", DType::f16},
                                  {"I64", DType::i64}, {"I32", DType::i32},   {"U8", DType::u8}};

std::optional<DType> parse_safetensors_dtype(const std::string& name) {
  for (const DTypeEntry& e : kDTypes)
    if (name == e.name) return e.dtype;
  return std::nullopt;
}

std::string supported_dtypes() {
  std::string s;
  for (const DTypeEntry& e : kDTypes) s += std::string(s.empty() ? "" : ", ") + e.name;
  return s;
}

// A JSON value for an error message. Containers are named by type only: arbitrary input may nest deeply, and
// dumping it would recurse.
std::string describe(const json& value) {
  if (!value.is_primitive()) return str("a JSON ", value.type_name());
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Levenshtein distance, for "did you mean" hints.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "; did you mean \"x\"?" when some entry is close to `name`, else "".
std::string nearest_name_hint(const std::string& name, const std::vector<SafetensorsEntry>& entries) {
  const std::string* best = nullptr;
  size_t best_distance = name.size() / 4 + 2;
  for (const SafetensorsEntry& e : entries) {
    size_t d = edit_distance(name, e.name);
    if (d < best_distance) best_distance = d, best = &e.name;
  }
  return best ? str("; did you mean \"", *best, "\"?") : std::string();
}

// The whole file, mapped read-only.
struct Mapping {
  void* address = nullptr;
  size_t size = 0;
  Mapping(void* a, size_t s) : address(a), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(address, size); }
};

struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

// Checks one header entry and returns it; every failure names the file and the tensor.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& value, uint64_t data_bytes) {
  const std::string where = str(path, ": tensor \"", name, "\"");
  FT_CHECK(value.is_object(), where, ": header entry is ", describe(value),
           ", expected an object with \"dtype\", \"shape\" and \"data_offsets\"");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    FT_CHECK(value.contains(key), where, ": header entry has no \"", key, "\"");

  const json& dtype_value = value["dtype"];
  FT_CHECK(dtype_value.is_string(), where, ": \"dtype\" is ", describe(dtype_value), ", expected a string");
  const std::string& dtype_string = dtype_value.get_ref<const std::string&>();
  std::optional<DType> dtype = parse_safetensors_dtype(dtype_string);
  FT_CHECK(dtype, where, ": dtype \"", dtype_string, "\" is not supported (supported: ", supported_dtypes(), ")");

  const json& shape_value = value["shape"];
  FT_CHECK(shape_value.is_array(), where, ": \"shape\" is ", describe(shape_value), ", expected a list of integers");
  std::vector<int64_t> dims;
  int64_t nonzero_product = 1;  // Every sub-product of the dims must fit in int64_t for Shape::numel.
  bool has_zero = false;
  for (const json& d : shape_value) {
    FT_CHECK(d.is_number_integer(), where, ": shape entry ", describe(d), " is not an integer");
    FT_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()), where,
             ": shape entry ", describe(d), " is not a non-negative 64-bit integer");
    int64_t extent = d.get<int64_t>();
    dims.push_back(extent);
    if (extent == 0)
      has_zero = true;
    else
      FT_CHECK(!__builtin_mul_overflow(nonzero_product, extent, &nonzero_product), where, ": shape ",
               Shape(dims).to_string(), "... has more elements than fit in 64 bits");
  }
  Shape shape(std::move(dims));
  uint64_t nbytes = 0;
  FT_CHECK(!__builtin_mul_overflow(has_zero ? uint64_t{0} : uint64_t(nonzero_product), dtype_size(*dtype), &nbytes),
           where, ": shape ", shape.to_string(), " of ", dtype_string, " is too large for 64-bit byte offsets");

  const json& offsets = value["data_offsets"];
  FT_CHECK(offsets.is_array() && offsets.size() == 2, where, ": \"data_offsets\" is ", describe(offsets),
           offsets.is_array() ? str(" with ", offsets.size(), " elements") : std::string(), ", expected [begin, end]");
  for (const json& o : offsets)
    FT_CHECK(o.is_number_unsigned(), where, ": data offset ", describe(o), " is not a non-negative integer");
  uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  FT_CHECK(begin <= end, where, ": data_offsets [", begin, ", ", end, "] end before they begin");
  FT_CHECK(end - begin == nbytes, where, ": shape ", shape.to_string(), " of ", dtype_string, " needs ", nbytes,
           " bytes but data_offsets give ", end - begin);
  FT_CHECK(end <= data_bytes, path, ": truncated: tensor \"", name, "\" needs bytes up to ", end,
           " but the data section has ", data_bytes, " bytes");

  SafetensorsEntry entry;
  entry.name = name;
  entry.dtype = *dtype;
  entry.shape = std::move(shape);
  entry.offset = static_cast<size_t>(begin);
  entry.nbytes = static_cast<size_t>(nbytes);
  return entry;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const DTypeEntry& e : kDTypes)
    if (e.dtype == dtype) return e.name;
  throw Error(str("dtype ", dtype_name(dtype), " has no safetensors name"));
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  FileDescriptor file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  FT_CHECK(file.fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat info {};
  FT_CHECK(::fstat(file.fd, &info) == 0, path, ": cannot stat: ", std::strerror(errno));
  FT_CHECK(!S_ISDIR(info.st_mode), path, ": is a directory, expected a safetensors file");
  FT_CHECK(S_ISREG(info.st_mode), path, ": is not a regular file");
  const uint64_t file_bytes = static_cast<uint64_t>(info.st_size);
  FT_CHECK(file_bytes >= 8, path, ": not a safetensors file: it is ", file_bytes,
           " bytes, shorter than the 8-byte header length");

  void* address = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, file.fd, 0);
  FT_CHECK(address != MAP_FAILED, path, ": cannot map ", file_bytes, " bytes: ", std::strerror(errno));
  auto mapping = std::make_shared<Mapping>(address, file_bytes);
  const char* bytes = static_cast<const char*>(address);

  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes, 8);
  FT_CHECK(header_bytes <= file_bytes - 8, path, ": header length ", header_bytes, " is larger than the file (",
           file_bytes, " bytes, ", file_bytes - 8, " after the length field)");
  FT_CHECK(header_bytes <= kMaxHeaderBytes, path, ": header length ", header_bytes, " exceeds the 100 MB limit");

  // Parse, noticing repeated top-level keys (a JSON object keeps only the last one silently).
  std::set<std::string> seen;
  std::string duplicate;
  auto watch_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_bytes, watch_keys);
  } catch (const json::exception& e) {
    throw Error(str(path, ": header is not valid JSON: ", json_error_text(e)));
  }
  FT_CHECK(header.is_object(), path, ": header is ", describe(header), ", expected a JSON object");
  FT_CHECK(duplicate.empty(), path, ": tensor \"", duplicate, "\" appears twice in the header");

  SafetensorsFile result;
  result.path_ = path;
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      FT_CHECK(value.is_object(), path, ": \"__metadata__\" is ", describe(value), ", expected an object of strings");
      for (const auto& [key, text] : value.items()) {
        FT_CHECK(text.is_string(), path, ": \"__metadata__\" value for \"", key, "\" is ", describe(text),
                 ", expected a string");
        result.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    result.entries_.push_back(parse_entry(path, name, value, data_bytes));
  }

  std::sort(result.entries_.begin(), result.entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    if (a.offset != b.offset) return a.offset < b.offset;
    if (a.nbytes != b.nbytes) return a.nbytes < b.nbytes;
    return a.name < b.name;
  });
  // Sorted by start, a range overlaps an earlier one exactly when it starts before the furthest end seen so far.
  const SafetensorsEntry* furthest = nullptr;
  for (const SafetensorsEntry& e : result.entries_) {
    if (e.nbytes == 0) continue;
    if (furthest && e.offset < furthest->offset + furthest->nbytes)
      throw Error(str(path, ": tensors \"", furthest->name, "\" (bytes ", furthest->offset, " to ",
                      furthest->offset + furthest->nbytes, ") and \"", e.name, "\" (bytes ", e.offset, " to ",
                      e.offset + e.nbytes, ") overlap"));
    if (!furthest || e.offset + e.nbytes > furthest->offset + furthest->nbytes) furthest = &e;
  }
  for (size_t i = 0; i < result.entries_.size(); ++i) result.index_[result.entries_[i].name] = i;
  result.data_ = bytes + 8 + header_bytes;
  result.mapping_ = std::move(mapping);
  return result;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  FT_CHECK(e, path_, ": no tensor \"", name, "\" among its ", entries_.size(), " tensors",
           nearest_name_hint(name, entries_));
  // The mapping is read-only; kernels never write to parameters they did not allocate.
  void* data = const_cast<char*>(data_ + e->offset);
  if (reinterpret_cast<uintptr_t>(data) % dtype_size(e->dtype) != 0) {
    Tensor copy = Tensor::zeros(e->shape, e->dtype);
    std::memcpy(copy.data(), data, e->nbytes);
    return copy;
  }
  return Tensor::view_shared(data, e->shape, e->dtype, mapping_);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps "__metadata__" first and the entries in offset order, as the safetensors library writes them.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<ByteSpan> pieces(2);
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const std::string where = str(path, ": tensor \"", name, "\"");
    FT_CHECK(name != "__metadata__", where, ": the name is reserved for the metadata map");
    FT_CHECK(names.insert(name).second, where, " is given twice");
    FT_CHECK(t.defined(), where, " is undefined (no data)");
    std::vector<uint64_t> dims;
    for (int64_t d : t.shape().dims()) {
      FT_CHECK(d >= 0, where, ": shape ", t.shape().to_string(), " has a negative extent");
      dims.push_back(static_cast<uint64_t>(d));
    }
    const uint64_t nbytes = t.nbytes();
    header[name] = {
        {"dtype", safetensors_dtype_name(t.dtype())}, {"shape", dims}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    pieces.push_back({t.data(), static_cast<size_t>(nbytes), is_floating(t.dtype()) ? name.c_str() : nullptr,
                      t.dtype()});
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    throw Error(str(
        path, ": cannot write the header (a tensor name or metadata string is not valid UTF-8): ", json_error_text(e)));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_bytes = text.size();
  pieces[0] = {&header_bytes, 8};
  pieces[1] = {text.data(), text.size()};
  write_file_atomic(path, pieces);
}

void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces) {
  const std::string temporary = str(path, ".tmp-", ::getpid());
  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  FT_CHECK(fd >= 0, path, ": cannot create the temporary file ", temporary, ": ", std::strerror(errno), " (", path,
           " was left unchanged)");
  auto fail = [&](const char* step) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(temporary.c_str());
    throw Error(
        str(path, ": ", step, " ", temporary, " failed: ", std::strerror(error), " (", path, " was left unchanged)"));
  };
  // Checked pieces go in 1 MiB blocks, each checked for inf and NaN just before it is written (still in cache).
  for (const ByteSpan& piece : pieces) {
    const size_t element = dtype_size(piece.dtype);
    const size_t block = piece.finite_name != nullptr ? (size_t{1} << 20) / element * element : size_t{1} << 30;
    for (size_t done = 0; done < piece.size;) {
      const char* p = static_cast<const char*>(piece.data) + done;
      const size_t chunk = std::min(piece.size - done, block);
      if (piece.finite_name != nullptr) {
        const int64_t bad = find_nonfinite(p, piece.dtype, static_cast<int64_t>(chunk / element));
        if (bad >= 0) {
          ::close(fd);
          ::unlink(temporary.c_str());
          throw Error(str(path, ": tensor \"", piece.finite_name, "\" holds a non-finite value at element ",
                          done / element + static_cast<size_t>(bad), "; a non-finite weight is never written (",
                          path, " was left unchanged)"));
        }
      }
      for (size_t left = chunk; left > 0;) {
        ssize_t written = ::write(fd, p, left);
        if (written < 0 && errno == EINTR) continue;
        if (written == 0) errno = EIO;
        if (written <= 0) fail("writing");
        p += written;
        left -= static_cast<size_t>(written);
      }
      done += chunk;
    }
  }
  if (::fsync(fd) != 0) fail("syncing");
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) fail("closing");
  if (::rename(temporary.c_str(), path.c_str()) != 0) fail("renaming");
  // Make the rename itself durable; failure here loses nothing already on disk, so it is not an error.
  std::string directory = std::filesystem::path(path).parent_path().string();
  int directory_fd = ::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory_fd >= 0) {
    ::fsync(directory_fd);
    ::close(directory_fd);
  }
}

void copy_file_atomic(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  FT_CHECK(in.is_open(), from, ": cannot open: ", std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FT_CHECK(!in.bad(), from, ": cannot read: ", std::strerror(errno));
  write_file_atomic(to, {{bytes.data(), bytes.size()}});
}

}  // namespace fusetrain::io
