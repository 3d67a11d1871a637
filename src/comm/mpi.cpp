// The communicator over Open MPI (MPI_COMM_WORLD). MPI is initialised with MPI_THREAD_FUNNELED on first use:
// only the thread that created the communicator calls MPI.
#include <memory>
#include <string>

#include "fusetrain/comm/communicator.h"
#include "fusetrain/core/error.h"

#ifdef FUSETRAIN_HAVE_MPI
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <vector>
#endif

namespace fusetrain::comm {

#ifdef FUSETRAIN_HAVE_MPI
namespace {

void check(int status, const char* what) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  throw Error(str(what, " failed: ", std::string(text, static_cast<size_t>(length))));
}

int count_of(int64_t n) {
  FT_CHECK(n >= 0 && n <= INT_MAX, "a collective of ", n, " values exceeds MPI's int count; split it");
  return static_cast<int>(n);
}

void initialise() {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised) return;
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  std::atexit([] {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised) MPI_Finalize();
  });
}

class MpiRequest final : public Request {
 public:
  MPI_Request request = MPI_REQUEST_NULL;
  void wait() override { check(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait"); }
  ~MpiRequest() override {
    if (request != MPI_REQUEST_NULL) MPI_Wait(&request, MPI_STATUS_IGNORE);
  }
};

class Mpi final : public Communicator {
 public:
  Mpi() {
    initialise();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MPI_Comm local;
    check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local),
          "MPI_Comm_split_type");
    MPI_Comm_rank(local, &local_rank_);
    MPI_Comm_free(&local);
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string text(version, static_cast<size_t>(length));
    backend_ = text.substr(0, text.find(','));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  std::string backend() const override { return backend_; }
  void all_reduce_sum(float* data, int64_t n) override {
    check(MPI_Allreduce(MPI_IN_PLACE, data, count_of(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  }
  std::unique_ptr<Request> start_all_reduce_sum(float* data, int64_t n) override {
    auto request = std::make_unique<MpiRequest>();
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count_of(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &request->request),
          "MPI_Iallreduce");
    return request;
  }
  void all_reduce_sum(double* data, int64_t n) override {
    check(MPI_Allreduce(MPI_IN_PLACE, data, count_of(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  }
  void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) override {
    set_counts(counts);
    check(MPI_Reduce_scatter(in, out, counts_.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Reduce_scatter");
  }
  void all_gather_in_place(float* data, std::span<const int64_t> counts) override {
    set_counts(counts);
    check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts_.data(), displacements_.data(), MPI_FLOAT,
                         MPI_COMM_WORLD),
          "MPI_Allgatherv");
  }
  void send(const void* data, int64_t bytes, int dest) override {
    check(MPI_Send(data, count_of(bytes), MPI_BYTE, dest, 0, MPI_COMM_WORLD), "MPI_Send");
  }
  void recv(void* data, int64_t bytes, int source) override {
    check(MPI_Recv(data, count_of(bytes), MPI_BYTE, source, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "MPI_Recv");
  }
  void broadcast(void* data, int64_t bytes, int root) override {
    check(MPI_Bcast(data, count_of(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  }
  double sum(double value) override {
    check(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
    return value;
  }
  void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }

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
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  std::string backend_;
  std::vector<int> counts_, displacements_;
};

}  // namespace

std::unique_ptr<Communicator> mpi_world() { return std::make_unique<Mpi>(); }

#else

std::unique_ptr<Communicator> mpi_world() {
  throw Error("this fusetrain was built without MPI (install libopenmpi-dev and rebuild) and cannot run as one rank "
              "of a multi-process job");
}

#endif

}  // namespace fusetrain::comm
