// Small helpers shared by the C++ test suites: temporary directories, file
// bytes, and checking that a call throws fusetrain::Error.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>

#include "fusetrain/core/error.h"

namespace fusetrain::testing {

/// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           str("fusetrain_test_", ::getpid(), "_", counter++, "_", std::random_device()());
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// The path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }
  /// Writes `bytes` to `name` inside the directory; returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream(file(name), std::ios::binary) << bytes;
    return file(name);
  }
  std::filesystem::path path;
};

/// The whole file as bytes.
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// Replaces the file with `bytes`.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The message of the fusetrain::Error `action` throws; a test failure if it throws none.
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected fusetrain::Error";
  return "";
}

}  // namespace fusetrain::testing

/// Expects `text` to contain `part`, printing both otherwise.
#define EXPECT_CONTAINS(text, part)                          \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "message: " << (text) << "\nexpected to contain: " << (part)
