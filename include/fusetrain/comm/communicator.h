// Collective communication between the processes of one data-parallel job: the interface the trainer uses, with
// one process (no communication) and Open MPI behind it; NCCL/RCCL fit the same interface later.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace fusetrain::comm {

/// A collective started without waiting; wait() blocks until its buffers may be read or reused.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
};

/// The ranks of a job. Every collective must be called by every rank in the same order with the same sizes.
/// Float buffers are f32; sums are element-wise.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The rank among the processes on this host (thread and memory placement).
  virtual int local_rank() const = 0;
  /// What carries the collectives ("single process", "Open MPI 4.1.4", ...).
  virtual std::string backend() const = 0;

  /// data[i] = sum over ranks of data[i], in place.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  /// all_reduce_sum started in the background (a gradient bucket while backward goes on).
  virtual std::unique_ptr<Request> start_all_reduce_sum(float* data, int64_t n) = 0;
  /// The sum over ranks of n doubles, in place.
  virtual void all_reduce_sum(double* data, int64_t n) = 0;
  /// `in` holds sum(counts) values (counts has size() entries, zeros allowed); rank r receives in `out` (counts[r]
  /// values) the sum over ranks of its part, the counts[r] values after the parts of ranks 0..r-1.
  virtual void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) = 0;
  /// `data` holds sum(counts) values; rank r's part (counts[r] values after those of ranks 0..r-1) is its own, and
  /// afterwards every rank holds every rank's part.
  virtual void all_gather_in_place(float* data, std::span<const int64_t> counts) = 0;
  /// Point to point: `bytes` bytes to rank `dest`, which receives them with recv(..., source = this rank).
  virtual void send(const void* data, int64_t bytes, int dest) = 0;
  virtual void recv(void* data, int64_t bytes, int source) = 0;
  /// `bytes` bytes from `root` into every rank's `data`.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  /// The sum over ranks of one double (losses, token counts, norms).
  virtual double sum(double value) = 0;
  virtual void barrier() = 0;
};

/// The job of one process: every collective is the identity.
std::unique_ptr<Communicator> single_process();

/// True when the process was started by an MPI launcher (mpirun, srun) with more than one rank, as the launcher's
/// environment says (in every build: mpi_world() then refuses a build without MPI).
bool launched_by_mpi();

/// The MPI world (MPI is initialised on first use and finalised at exit). Throws Error when this build has no MPI.
std::unique_ptr<Communicator> mpi_world();

}  // namespace fusetrain::comm
