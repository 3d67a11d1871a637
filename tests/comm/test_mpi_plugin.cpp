// The engine links no MPI library: a multi-process job loads the Open MPI plugin (libfusetrain_mpi.so), and an
// installation without it, or without Open MPI's runtime, refuses the job with one error saying what to install.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "fusetrain/comm/communicator.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

// Sets FUSETRAIN_MPI_PLUGIN for a scope.
class PluginPath {
 public:
  explicit PluginPath(const std::string& path) { setenv("FUSETRAIN_MPI_PLUGIN", path.c_str(), 1); }
  ~PluginPath() { unsetenv("FUSETRAIN_MPI_PLUGIN"); }
};

TEST(MpiPlugin, AMissingPluginIsOneClearError) {
  const PluginPath path("/nonexistent/libfusetrain_mpi.so");
  const std::string message = error_of([] { comm::mpi_world(); });
  EXPECT_CONTAINS(message, "a multi-process job needs fusetrain's Open MPI plugin, expected at "
                           "/nonexistent/libfusetrain_mpi.so");
  EXPECT_CONTAINS(message, "install libopenmpi-dev and rebuild");
}

TEST(MpiPlugin, APluginThatDoesNotLoadNamesWhatToInstall) {
  const TempDir dir;
  const std::string file = (dir.path / "libfusetrain_mpi.so").string();
  std::ofstream(file) << "not a shared library";
  const PluginPath path(file);
  const std::string message = error_of([] { comm::mpi_world(); });
  EXPECT_CONTAINS(message, "a multi-process job needs Open MPI's runtime, which did not load: ");
  EXPECT_CONTAINS(message, "apt-get install openmpi-bin");
}

}  // namespace
}  // namespace fusetrain::testing
