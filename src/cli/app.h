// The command line's entry point, shared by the `fusetrain` binary and `python -m fusetrain`.
#pragma once

namespace fusetrain::cli {

/// Parses argv (argv[0] is the program name) and runs the subcommand; returns the exit status. Errors are printed
/// as one line on stderr.
int main(int argc, char** argv);

}  // namespace fusetrain::cli
