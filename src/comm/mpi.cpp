// The communicator over Open MPI (MPI_COMM_WORLD), through the plugin libfusetrain_mpi.so (mpi_api.h), which this
// engine loads on first use from its own directory: the engine links no MPI library, so an installation without
// Open MPI runs one process and refuses a multi-process launch with one error naming what to install. Only the thread
// that created the communicator calls MPI (MPI_THREAD_FUNNELED).
#include <dlfcn.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_api.h"
#include "fusetrain/comm/communicator.h"
#include "fusetrain/core/error.h"

namespace fusetrain::comm {
namespace {

namespace fs = std::filesystem;

// The directory of the program or shared library this engine is part of (the fusetrain command, fusetrain._core).
fs::path engine_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&engine_directory), &info) != 0 && info.dli_fname != nullptr) {
    const fs::path file(info.dli_fname);
    if (file.extension() == ".so" || file.string().find(".so.") != std::string::npos) return file.parent_path();
  }
  std::error_code error;
  const fs::path program = fs::read_symlink("/proc/self/exe", error);
  return error ? fs::path(".") : program.parent_path();
}

// The plugin's table, loaded once: $FUSETRAIN_MPI_PLUGIN, else libfusetrain_mpi.so beside the engine.
const FusetrainMpiApi& api() {
  static const FusetrainMpiApi* table = [] {
    const char* given = std::getenv("FUSETRAIN_MPI_PLUGIN");
    const std::string path = given ? given : (engine_directory() / "libfusetrain_mpi.so").string();
    FT_CHECK(fs::exists(path), "a multi-process job needs fusetrain's Open MPI plugin, expected at ", path,
             ", which this installation lacks (it was built without Open MPI: install libopenmpi-dev and rebuild)");
    // Open MPI's library first, global: the wheel's plugin names no MPI library (so that the wheel's platform tag
    // does not follow the build machine's Open MPI) and finds MPI's symbols here; Open MPI's own components, which
    // libmpi loads, resolve its symbols too. A plugin that links libmpi itself (a source build) loads either way.
    dlopen("libmpi.so.40", RTLD_NOW | RTLD_GLOBAL);  // Open MPI 3, 4 and 5's soname
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr)
      throw Error(str("a multi-process job needs Open MPI's runtime, which did not load: ", dlerror(),
                      " (install Open MPI 4: Debian and Ubuntu `apt-get install openmpi-bin`, RHEL and Fedora `dnf "
                      "install openmpi`)"));
    void* entry = dlsym(handle, "fusetrain_mpi_api_v1");
    FT_CHECK(entry != nullptr, path, " is not fusetrain's Open MPI plugin (no fusetrain_mpi_api_v1)");
    return reinterpret_cast<const FusetrainMpiApi* (*)()>(entry)();
  }();
  return *table;
}

void check(int status, const char* what) {
  if (status == 0) return;
  char text[512];
  api().error_string(status, text, sizeof text);
  throw Error(str(what, " failed: ", text));
}

int count_of(int64_t n) {
  FT_CHECK(n >= 0 && n <= INT_MAX, "a collective of ", n, " values exceeds MPI's int count; split it");
  return static_cast<int>(n);
}

class MpiRequest final : public Request {
 public:
  void* request = nullptr;
  void wait() override {
    void* pending = request;
    request = nullptr;
    if (pending) check(api().wait(pending), "MPI_Wait");
  }
  ~MpiRequest() override {
    if (request) api().wait(request);
  }
};

class Mpi final : public Communicator {
 public:
  Mpi() : mpi_(api()) {
    check(mpi_.init(), "MPI_Init_thread");
    check(mpi_.rank(&rank_), "MPI_Comm_rank");
    check(mpi_.size(&size_), "MPI_Comm_size");
    check(mpi_.local_rank(&local_rank_), "MPI_Comm_split_type");
    char version[256];
    check(mpi_.library_version(version, sizeof version), "MPI_Get_library_version");
    backend_ = version;
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  std::string backend() const override { return backend_; }
  void all_reduce_sum(float* data, int64_t n) override {
    check(mpi_.all_reduce_f32(data, count_of(n)), "MPI_Allreduce");
  }
  std::unique_ptr<Request> start_all_reduce_sum(float* data, int64_t n) override {
    auto request = std::make_unique<MpiRequest>();
    check(mpi_.start_all_reduce_f32(data, count_of(n), &request->request), "MPI_Iallreduce");
    return request;
  }
  void all_reduce_sum(double* data, int64_t n) override {
    check(mpi_.all_reduce_f64(data, count_of(n)), "MPI_Allreduce");
  }
  void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) override {
    set_counts(counts);
    check(mpi_.reduce_scatter_f32(in, out, counts_.data()), "MPI_Reduce_scatter");
  }
  void all_gather_in_place(float* data, std::span<const int64_t> counts) override {
    set_counts(counts);
    check(mpi_.all_gather_f32(data, counts_.data(), displacements_.data()), "MPI_Allgatherv");
  }
  void send(const void* data, int64_t bytes, int dest) override {
    check(mpi_.send(data, count_of(bytes), dest), "MPI_Send");
  }
  void recv(void* data, int64_t bytes, int source) override {
    check(mpi_.recv(data, count_of(bytes), source), "MPI_Recv");
  }
  void broadcast(void* data, int64_t bytes, int root) override {
    check(mpi_.broadcast(data, count_of(bytes), root), "MPI_Bcast");
  }
  double sum(double value) override {
    check(mpi_.all_reduce_f64(&value, 1), "MPI_Allreduce");
    return value;
  }
  void barrier() override { check(mpi_.barrier(), "MPI_Barrier"); }

 private:
  // MPI's int counts and displacements of a v-collective, kept to avoid allocating per call.
  void set_counts(std::span<const int64_t> counts) {
    FT_CHECK(static_cast<int64_t>(counts.size()) == size_, "a collective over ", size_, " ranks got ", counts.size(),
             " counts");
    counts_.resize(counts.size());
    displacements_.resize(counts.size());
    int64_t offset = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      counts_[r] = count_of(counts[r]);
      displacements_[r] = count_of(offset);
      offset += counts[r];
    }
  }
  const FusetrainMpiApi& mpi_;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  std::string backend_;
  std::vector<int> counts_, displacements_;
};

}  // namespace

std::unique_ptr<Communicator> mpi_world() { return std::make_unique<Mpi>(); }

}  // namespace fusetrain::comm
