// The fusetrain command line.
#include <cstdio>
#include <cstring>
#include <exception>

#include "fusetrain/core/cpu.h"

int main(int argc, char** argv) {
  try {
    if (argc > 1 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
      std::printf("usage: fusetrain [--version]\n\nPrints the version and the CPU features the kernels can use.\n");
      return 0;
    }
    if (argc > 1 && std::strcmp(argv[1], "--version") != 0) {
      std::fprintf(stderr, "fusetrain: unknown argument \"%s\" (expected --version or --help)\n", argv[1]);
      return 2;
    }
    std::printf("fusetrain %s\n", FUSETRAIN_VERSION);
    std::printf("cpu: %s\n", fusetrain::cpu_model_name().c_str());
    std::printf("features: %s\n", fusetrain::cpu_features().to_string().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusetrain: %s\n", e.what());
    return 1;
  }
}
