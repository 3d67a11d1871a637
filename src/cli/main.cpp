// The `fusetrain` binary: see cli/app.cpp.
#include "cli/app.h"

int main(int argc, char** argv) { return fusetrain::cli::main(argc, argv); }
