// safetensors read and write: round trips, the exact bytes the safetensors library writes, files written by hand,
// every malformed-input error, and crash-safe saving.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "fusetrain/core/error.h"
#include "fusetrain/io/safetensors.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

namespace fs = std::filesystem;
using io::SafetensorsFile;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &n, 8);
  return s;
}

// A file in the safetensors layout with `header` verbatim (not padded) and `data` after it.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

Tensor filled(Shape shape, DType dtype, double start) {
  Tensor t = Tensor::zeros(std::move(shape), dtype);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set_item(i, start + static_cast<double>(i) * (dtype == DType::u8 ? 1 : -1.5));
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

TEST(Safetensors, RoundTripsEveryDtype) {
  TempDir dir;
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"f32", filled({2, 3}, DType::f32, 0.25)},   {"bf16", filled({5}, DType::bf16, -2.0)},
      {"f16", filled({3, 1, 2}, DType::f16, 7.5)}, {"i64", filled({4}, DType::i64, 1e12)},
      {"i32", filled({2, 2}, DType::i32, -100)},   {"u8", filled({3}, DType::u8, 250)},
      {"scalar", filled({}, DType::f32, 3.0)},     {"empty", Tensor::zeros({0, 3}, DType::f16)},
  };
  std::string path = dir.file("all.safetensors");
  io::save_safetensors(path, tensors, {{"format", "pt"}, {"step", "12"}});

  SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  ASSERT_EQ(file.entries().size(), tensors.size());
  size_t expected_offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, original] = tensors[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(file.entries()[i].name, name);  // offsets follow the order given
    EXPECT_EQ(file.entries()[i].offset, expected_offset);
    EXPECT_EQ(file.entries()[i].nbytes, original.nbytes());
    expected_offset += original.nbytes();
    ASSERT_TRUE(file.contains(name));
    EXPECT_EQ(file.find(name)->dtype, original.dtype());
    EXPECT_TRUE(same_bytes(file.tensor(name), original));
  }
  EXPECT_EQ(file.find("absent"), nullptr);
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
}

TEST(Safetensors, WritesTheBytesTheSafetensorsLibraryWrites) {
  // Python: safetensors.numpy.save({"a": int64 [0, 1, 2], "b": float32 [0, 0], "c": uint8 [[1, 1]]},
  //                                metadata={"format": "pt", "z": "1"})
  const std::string header =
      R"({"__metadata__":{"format":"pt","z":"1"},"a":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[24,32]},"c":{"dtype":"U8","shape":[1,2],"data_offsets":[32,34]}}   )";
  ASSERT_EQ(header.size(), 208u);
  Tensor a = Tensor::zeros({3}, DType::i64), b = Tensor::zeros({2}, DType::f32), c = Tensor::zeros({1, 2}, DType::u8);
  for (int i = 0; i < 3; ++i) a.set_item(i, i);
  c.set_item(0, 1);
  c.set_item(1, 1);
  TempDir dir;
  std::string path = dir.file("golden.safetensors");
  io::save_safetensors(path, {{"a", a}, {"b", b}, {"c", c}}, {{"z", "1"}, {"format", "pt"}});
  std::string data(static_cast<const char*>(a.data()), 24);
  data += std::string(8, '\0') + std::string("\x01\x01", 2);
  EXPECT_EQ(read_file(path), le64(208) + header + data);
}

TEST(Safetensors, ReadsAHandWrittenFile) {
  // The example from the safetensors documentation, with the entries listed out of offset order, a second tensor,
  // and the header padded with a newline and spaces.
  const std::string header =
      R"({"z_first":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}, "a_second": {"data_offsets": [16, 20],)"
      R"( "shape": [], "dtype": "F32"}, "__metadata__": {"k": "v"}})"
      "\n  ";
  std::string data;
  for (int32_t v : {1, -2, 3, 40000}) data.append(reinterpret_cast<const char*>(&v), 4);
  float f = 2.5f;
  data.append(reinterpret_cast<const char*>(&f), 4);
  TempDir dir;
  std::string path = dir.file("hand.safetensors");
  write_file(path, safetensors_bytes(header, data));

  SafetensorsFile file = SafetensorsFile::open(path);
  ASSERT_EQ(file.entries().size(), 2u);
  EXPECT_EQ(file.entries()[0].name, "z_first");
  EXPECT_EQ(file.entries()[1].name, "a_second");
  Tensor ints = file.tensor("z_first");
  EXPECT_EQ(ints.shape(), (Shape{2, 2}));
  EXPECT_EQ(ints.dtype(), DType::i32);
  EXPECT_EQ(ints.item(3), 40000);
  EXPECT_EQ(ints.item(1), -2);
  Tensor scalar = file.tensor("a_second");
  EXPECT_EQ(scalar.shape(), Shape{});
  EXPECT_EQ(scalar.item(), 2.5);
  EXPECT_EQ(file.metadata().at("k"), "v");
}

TEST(Safetensors, TensorKeepsTheMappingAlive) {
  TempDir dir;
  std::string path = dir.file("w.safetensors");
  Tensor original = filled({64}, DType::f32, 1.0);
  io::save_safetensors(path, {{"w", original}});
  Tensor view;
  {
    SafetensorsFile file = SafetensorsFile::open(path);
    view = file.tensor("w");
  }
  fs::remove(path);
  EXPECT_TRUE(view.owns_memory());
  EXPECT_TRUE(same_bytes(view, original));
}

TEST(Safetensors, MisalignedTensorIsCopiedToAlignedMemory) {
  std::string header =
      R"({"byte":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-aligned, so "f" starts at 1 mod 8
  std::string data = "\x07";
  for (float v : {1.5f, -3.0f}) data.append(reinterpret_cast<const char*>(&v), 4);
  TempDir dir;
  std::string path = dir.file("odd.safetensors");
  write_file(path, safetensors_bytes(header, data));
  Tensor t = SafetensorsFile::open(path).tensor("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 4, 0u);
  EXPECT_EQ(t.item(0), 1.5);
  EXPECT_EQ(t.item(1), -3.0);
}

TEST(Safetensors, MissingTensorNamesFileAndTensor) {
  TempDir dir;
  std::string path = dir.file("w.safetensors");
  io::save_safetensors(path, {{"encoder.layer.0.weight", filled({2}, DType::f32, 0)}});
  SafetensorsFile file = SafetensorsFile::open(path);
  std::string message = error_of([&] { file.tensor("encoder.layer.0.wieght"); });
  EXPECT_CONTAINS(message, path);
  EXPECT_CONTAINS(message, "no tensor \"encoder.layer.0.wieght\"");
  EXPECT_CONTAINS(message, "did you mean \"encoder.layer.0.weight\"");
}

struct BadFile {
  const char* what;
  std::string bytes;
  std::vector<std::string> expected;  // substrings of the message besides the path
};

TEST(Safetensors, EveryMalformedFileGivesAnErrorNamingFileAndTensor) {
  auto entry = [](const std::string& name, const std::string& body) { return str("\"", name, "\":{", body, "}"); };
  auto single = [&](const std::string& body) { return str("{", entry("w", body), "}"); };
  const std::string w_ok = entry("w", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])");
  const std::vector<BadFile> cases = {
      {"shorter than 8 bytes", "abc", {"3 bytes, shorter than the 8-byte header length"}},
      {"header longer than the file", le64(1000) + "{}", {"header length 1000 is larger than the file (10 bytes"}},
      {"not JSON", safetensors_bytes("{\"w\": [1, }", ""), {"header is not valid JSON", "parse error at line 1"}},
      {"not UTF-8", safetensors_bytes("{\"w\xff\": 1}", ""), {"header is not valid JSON"}},
      {"not an object", safetensors_bytes("[1, 2]", ""), {"header is a JSON array, expected a JSON object"}},
      {"entry not an object", safetensors_bytes(R"({"w": 5})", ""), {"tensor \"w\": header entry is 5"}},
      {"no dtype",
       safetensors_bytes(single(R"("shape":[2],"data_offsets":[0,8])"), std::string(8, 0)),
       {"tensor \"w\": header entry has no \"dtype\""}},
      {"no shape",
       safetensors_bytes(single(R"("dtype":"F32","data_offsets":[0,8])"), std::string(8, 0)),
       {"tensor \"w\": header entry has no \"shape\""}},
      {"no data_offsets",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2])"), std::string(8, 0)),
       {"tensor \"w\": header entry has no \"data_offsets\""}},
      {"dtype not a string",
       safetensors_bytes(single(R"("dtype":4,"shape":[1],"data_offsets":[0,4])"), ""),
       {"tensor \"w\": \"dtype\" is 4, expected a string"}},
      {"unknown dtype",
       safetensors_bytes(single(R"("dtype":"F64","shape":[1],"data_offsets":[0,8])"), std::string(8, 0)),
       {"tensor \"w\": dtype \"F64\" is not supported (supported: F32, BF16, F16, I64, I32, U8)"}},
      {"shape not a list",
       safetensors_bytes(single(R"("dtype":"F32","shape":"2","data_offsets":[0,8])"), ""),
       {"tensor \"w\": \"shape\" is \"2\", expected a list of integers"}},
      {"negative extent",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2,-1],"data_offsets":[0,8])"), ""),
       {"tensor \"w\": shape entry -1 is not a non-negative 64-bit integer"}},
      {"fractional extent",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2.5],"data_offsets":[0,8])"), ""),
       {"tensor \"w\": shape entry 2.5 is not an integer"}},
      {"huge shape",
       safetensors_bytes(single(R"("dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8])"), ""),
       {"tensor \"w\": shape (4294967296, 4294967296)... has more elements than fit in 64 bits"}},
      {"offsets not a pair",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2],"data_offsets":[0])"), ""),
       {"tensor \"w\": \"data_offsets\" is a JSON array with 1 elements, expected [begin, end]"}},
      {"negative offset",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2],"data_offsets":[-8,0])"), ""),
       {"tensor \"w\": data offset -8 is not a non-negative integer"}},
      {"end before begin",
       safetensors_bytes(single(R"("dtype":"F32","shape":[0],"data_offsets":[8,4])"), std::string(8, 0)),
       {"tensor \"w\": data_offsets [8, 4] end before they begin"}},
      {"truncated",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2,3],"data_offsets":[0,24])"), std::string(20, 0)),
       {"truncated: tensor \"w\" needs bytes up to 24 but the data section has 20"}},
      {"size mismatch",
       safetensors_bytes(single(R"("dtype":"F32","shape":[2,3],"data_offsets":[0,20])"), std::string(24, 0)),
       {"tensor \"w\": shape (2, 3) of F32 needs 24 bytes but data_offsets give 20"}},
      {"overlap",
       safetensors_bytes(str("{", w_ok, ",", entry("v", R"("dtype":"I32","shape":[1],"data_offsets":[4,8])"), "}"),
                         std::string(8, 0)),
       {"tensors \"w\" (bytes 0 to 8) and \"v\" (bytes 4 to 8) overlap"}},
      {"overlap across a small tensor",
       safetensors_bytes(str("{", entry("big", R"("dtype":"U8","shape":[10],"data_offsets":[0,10])"), ",",
                             entry("in", R"("dtype":"U8","shape":[2],"data_offsets":[2,4])"), "}"),
                         std::string(10, 0)),
       {"\"big\"", "\"in\"", "overlap"}},
      {"duplicate name",
       safetensors_bytes(str("{", w_ok, ",", w_ok, "}"), std::string(8, 0)),
       {"tensor \"w\" appears twice in the header"}},
      {"metadata not an object",
       safetensors_bytes(R"({"__metadata__": [1]})", ""),
       {"\"__metadata__\" is a JSON array, expected an object of strings"}},
      {"metadata value not a string",
       safetensors_bytes(R"({"__metadata__": {"epoch": 3}})", ""),
       {"\"__metadata__\" value for \"epoch\" is 3, expected a string"}},
  };
  TempDir dir;
  for (const BadFile& c : cases) {
    SCOPED_TRACE(c.what);
    std::string path = dir.file("bad.safetensors");
    write_file(path, c.bytes);
    std::string message = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    for (const std::string& part : c.expected) EXPECT_CONTAINS(message, part);
  }
}

TEST(Safetensors, RejectsHeaderAbove100MB) {
  TempDir dir;
  std::string path = dir.file("huge.safetensors");
  write_file(path, le64(100'000'001) + "{}");
  fs::resize_file(path, 100'000'100);  // sparse: costs no disk
  std::string message = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_CONTAINS(message, path);
  EXPECT_CONTAINS(message, "header length 100000001 exceeds the 100 MB limit");
}

TEST(Safetensors, OpenNamesAMissingFileOrADirectory) {
  TempDir dir;
  std::string missing = dir.file("nope.safetensors");
  std::string message = error_of([&] { SafetensorsFile::open(missing); });
  EXPECT_CONTAINS(message, missing + ": cannot open: No such file");
  message = error_of([&] { SafetensorsFile::open(dir.path.string()); });
  EXPECT_CONTAINS(message, dir.path.string() + ": is a directory");
}

TEST(Safetensors, FailedSaveLeavesTheOldFileIntact) {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  Tensor old_weights = filled({4}, DType::f32, 1.0);
  io::save_safetensors(path, {{"w", old_weights}});
  const std::string old_bytes = read_file(path);
  // Writing fails: the temporary name is taken by a directory.
  fs::create_directory(str(path, ".tmp-", ::getpid()));
  std::string message = error_of([&] { io::save_safetensors(path, {{"w", filled({8}, DType::f32, 9.0)}}); });
  EXPECT_CONTAINS(message, path);
  EXPECT_CONTAINS(message, "was left unchanged");
  EXPECT_EQ(read_file(path), old_bytes);
  EXPECT_TRUE(same_bytes(SafetensorsFile::open(path).tensor("w"), old_weights));
}

TEST(Safetensors, SavingOverAMappedFileKeepsOldViewsValid) {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  Tensor first = filled({1000}, DType::f32, 1.0), second = filled({1000}, DType::f32, -7.0);
  io::save_safetensors(path, {{"w", first}});
  Tensor view = SafetensorsFile::open(path).tensor("w");
  io::save_safetensors(path, {{"w", view}, {"v", second}});  // the source is the file being replaced
  EXPECT_TRUE(same_bytes(view, first));
  SafetensorsFile reread = SafetensorsFile::open(path);
  EXPECT_TRUE(same_bytes(reread.tensor("w"), first));
  EXPECT_TRUE(same_bytes(reread.tensor("v"), second));
  for (const auto& entry : fs::directory_iterator(dir.path))
    EXPECT_EQ(entry.path().filename(), "model.safetensors") << "temporary file left behind";
}

TEST(Safetensors, SaveRejectsBadTensorLists) {
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  Tensor t = filled({2}, DType::f32, 0);
  std::string message = error_of([&] { io::save_safetensors(path, {{"w", t}, {"w", t}}); });
  EXPECT_CONTAINS(message, path + ": tensor \"w\" is given twice");
  message = error_of([&] { io::save_safetensors(path, {{"__metadata__", t}}); });
  EXPECT_CONTAINS(message, "tensor \"__metadata__\": the name is reserved");
  message = error_of([&] { io::save_safetensors(path, {{"u", Tensor()}}); });
  EXPECT_CONTAINS(message, path + ": tensor \"u\" is undefined");
  message = error_of([&] { io::save_safetensors(path, {{"bad\xff", t}}); });
  EXPECT_CONTAINS(message, "not valid UTF-8");
  EXPECT_FALSE(fs::exists(path));
}

// A non-finite value is found in the block being written, the save stops, the old file stays, nothing is left
// behind, and the error names the tensor and the element; integer tensors are not checked.
TEST(Safetensors, SaveRefusesNonFiniteValuesAsItWrites) {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  io::save_safetensors(path, {{"w", filled({4}, DType::f32, 1.0)}});
  const std::string old_bytes = read_file(path);
  const int64_t n = 3 * (int64_t{1} << 18) + 5;  // past one 1 MiB block of f32, so the hit is in a later block
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (double bad : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
      Tensor big = Tensor::zeros({n}, dtype);
      big.set_item(n - 2, bad);
      std::string message =
          error_of([&] { io::save_safetensors(path, {{"ok", filled({3}, DType::f32, 0)}, {"big", big}}); });
      EXPECT_CONTAINS(message, path + ": tensor \"big\" holds a non-finite value at element " + std::to_string(n - 2));
      EXPECT_CONTAINS(message, "was left unchanged");
      EXPECT_EQ(read_file(path), old_bytes) << dtype_name(dtype);
    }
  }
  for (const auto& entry : fs::directory_iterator(dir.path))
    EXPECT_EQ(entry.path().filename(), "model.safetensors") << "temporary file left behind";
  Tensor ids = Tensor::zeros({4}, DType::i32);
  ids.set_item(1, -1);
  io::save_safetensors(path, {{"ids", ids}});  // integers hold no inf or NaN: written as they are
  EXPECT_TRUE(same_bytes(SafetensorsFile::open(path).tensor("ids"), ids));
}

TEST(FindNonfinite, FindsTheFirstInfOrNanOfEachFloatingType) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t n : {int64_t{1}, int64_t{1023}, int64_t{1024}, int64_t{1025}, int64_t{5000}}) {
      Tensor t = filled({n}, dtype, 3.0);  // a finite ramp (3, 1.5, 0, -1.5, ...; within f16's range)
      EXPECT_EQ(find_nonfinite(t.data(), dtype, n), -1) << dtype_name(dtype) << " n=" << n;
      for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
        Tensor u = filled({n}, dtype, 3.0);
        u.set_item(at, std::nan(""));
        if (at + 1 < n) u.set_item(n - 1, HUGE_VAL);  // a later hit does not hide the first
        EXPECT_EQ(find_nonfinite(u.data(), dtype, n), at) << dtype_name(dtype) << " n=" << n;
      }
    }
  }
  const float largest = 3.4028235e38f;
  EXPECT_EQ(find_nonfinite(&largest, DType::f32, 1), -1);
  int64_t ids[2] = {-1, 0x7ff0000000000000};
  EXPECT_EQ(find_nonfinite(ids, DType::i64, 2), -1);
}

}  // namespace
}  // namespace fusetrain::testing
