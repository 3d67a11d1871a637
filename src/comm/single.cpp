// The one-process communicator: collectives over a single rank.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "fusetrain/comm/communicator.h"
#include "fusetrain/core/error.h"

namespace fusetrain::comm {
namespace {

class Done final : public Request {
 public:
  void wait() override {}
};

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_rank() const override { return 0; }
  std::string backend() const override { return "single process"; }
  void all_reduce_sum(float*, int64_t) override {}
  std::unique_ptr<Request> start_all_reduce_sum(float*, int64_t) override { return std::make_unique<Done>(); }
  void all_reduce_sum(double*, int64_t) override {}
  void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) override {
    if (in != out) std::copy_n(in, counts[0], out);
  }
  void all_gather_in_place(float*, std::span<const int64_t>) override {}
  void send(const void*, int64_t, int dest) override {
    throw Error(str("send to rank ", dest, " in a job of one process"));
  }
  void recv(void*, int64_t, int source) override {
    throw Error(str("recv from rank ", source, " in a job of one process"));
  }
  void broadcast(void*, int64_t, int) override {}
  double sum(double value) override { return value; }
  void barrier() override {}
};

}  // namespace

std::unique_ptr<Communicator> single_process() { return std::make_unique<SingleProcess>(); }

bool launched_by_mpi() {
  // Checked in every build: a build without MPI started by mpirun must refuse (mpi_world throws) rather than run N
  // independent trainings into one output directory.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::atoi(value) > 1) return true;
  }
  return false;
}

}  // namespace fusetrain::comm
