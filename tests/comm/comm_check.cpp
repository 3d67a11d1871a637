// Checks every collective of the communicator across the ranks of an MPI job (run under mpirun -np N by ctest):
// each rank fills its buffers from its rank, and the results must be the sums and gathers computed here. Prints
// one line per rank and exits non-zero on the first wrong value.
//   fusetrain_comm_check --bandwidth TOTAL_MB   instead times the sum all-reduce of TOTAL_MB of f32 gradients in
//                                               buckets of 1 to 64 MiB (bench/data_parallel.py bandwidth)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fusetrain/comm/communicator.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what, int rank, long i, double got, double want) {
  if (ok) return;
  if (failures++ < 5) std::fprintf(stderr, "rank %d: %s[%ld] = %g, expected %g\n", rank, what, i, got, want);
}

}  // namespace

// The best of 5 timings of all-reducing `total` floats in buckets of `bucket` floats, one after the other.
double time_all_reduce(fusetrain::comm::Communicator& comm, std::vector<float>& data, long bucket) {
  double best = 1e30;
  for (int round = 0; round < 6; ++round) {
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (long at = 0; at < static_cast<long>(data.size()); at += bucket)
      comm.all_reduce_sum(data.data() + at, std::min<long>(bucket, static_cast<long>(data.size()) - at));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (round > 0) best = std::min(best, seconds);  // round 0 warms the buffers and connections
  }
  return comm.sum(best) / comm.size();
}

// The same for ZeRO's pair: a reduce-scatter of each bucket into equal parts, then the in-place all-gather.
double time_reduce_scatter_all_gather(fusetrain::comm::Communicator& comm, std::vector<float>& data, long bucket) {
  std::vector<float> part(static_cast<size_t>(bucket / comm.size() + 16));
  double best = 1e30;
  for (int round = 0; round < 6; ++round) {
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (long at = 0; at < static_cast<long>(data.size()); at += bucket) {
      const long n = std::min<long>(bucket, static_cast<long>(data.size()) - at);
      std::vector<int64_t> counts(static_cast<size_t>(comm.size()), n / comm.size());
      counts.back() += n % comm.size();
      comm.reduce_scatter_sum(data.data() + at, part.data(), counts);
      comm.all_gather_in_place(data.data() + at, counts);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (round > 0) best = std::min(best, seconds);
  }
  return comm.sum(best) / comm.size();
}

int bandwidth(fusetrain::comm::Communicator& comm, long total_mb) {
  std::vector<float> data(static_cast<size_t>(total_mb) << 18, 1.0f);
  if (comm.rank() == 0)
    std::printf("{\"ranks\": %d, \"backend\": \"%s\", \"total_mib\": %ld, \"buckets\": [", comm.size(),
                comm.backend().c_str(), total_mb);
  bool first = true;
  for (long bucket_mb : {1L, 4L, 25L, 64L}) {
    if (bucket_mb > total_mb) continue;
    const double seconds = time_all_reduce(comm, data, bucket_mb << 18);
    // Bus bandwidth as NCCL's tests define it for all-reduce: bytes x 2 (N - 1) / N per second.
    const double bytes = static_cast<double>(data.size()) * sizeof(float);
    const double bus = bytes * 2.0 * (comm.size() - 1) / comm.size() / seconds;
    const double zero_seconds = time_reduce_scatter_all_gather(comm, data, bucket_mb << 18);
    if (comm.rank() == 0)
      std::printf("%s{\"bucket_mib\": %ld, \"seconds\": %.6f, \"bus_gb_per_s\": %.3f, "
                  "\"reduce_scatter_all_gather_seconds\": %.6f}",
                  first ? "" : ", ", bucket_mb, seconds, bus / 1e9, zero_seconds);
    first = false;
  }
  if (comm.rank() == 0) std::printf("]}\n");
  return 0;
}

int main(int argc, char** argv) {
  auto comm = fusetrain::comm::mpi_world();
  if (argc == 3 && std::strcmp(argv[1], "--bandwidth") == 0) return bandwidth(*comm, std::atol(argv[2]));
  const int r = comm->rank(), n = comm->size();
  const long count = 1000003;  // odd, so no chunking lines up by accident
  std::vector<float> data(static_cast<size_t>(count));
  for (long i = 0; i < count; ++i) data[static_cast<size_t>(i)] = static_cast<float>((r + 1) * (i % 7));
  comm->all_reduce_sum(data.data(), count);
  const double ranks_sum = n * (n + 1) / 2.0;
  for (long i = 0; i < count; ++i) expect(data[static_cast<size_t>(i)] == ranks_sum * (i % 7), "all_reduce", r, i,
                                          data[static_cast<size_t>(i)], ranks_sum * (i % 7));

  std::vector<float> async(4096, static_cast<float>(r));
  auto request = comm->start_all_reduce_sum(async.data(), 4096);
  request->wait();
  for (long i = 0; i < 4096; ++i) expect(async[static_cast<size_t>(i)] == n * (n - 1) / 2.0, "iallreduce", r, i,
                                         async[static_cast<size_t>(i)], n * (n - 1) / 2.0);

  // Uneven parts, one of them empty (rank 1's), as a gradient bucket's share of the ZeRO shards.
  std::vector<int64_t> counts(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) counts[static_cast<size_t>(k)] = k == 1 ? 0 : 100 + 37 * k;
  long total_count = 0, offset = 0;
  for (int k = 0; k < n; ++k) {
    if (k < r) offset += counts[static_cast<size_t>(k)];
    total_count += counts[static_cast<size_t>(k)];
  }
  const long part = counts[static_cast<size_t>(r)];
  std::vector<float> full(static_cast<size_t>(total_count)), mine(static_cast<size_t>(part + 1));
  for (long i = 0; i < total_count; ++i) full[static_cast<size_t>(i)] = static_cast<float>(i + r);
  comm->reduce_scatter_sum(full.data(), mine.data(), counts);
  for (long i = 0; i < part; ++i) {
    const double want = n * static_cast<double>(offset + i) + n * (n - 1) / 2.0;
    expect(mine[static_cast<size_t>(i)] == want, "reduce_scatter", r, i, mine[static_cast<size_t>(i)], want);
  }
  std::vector<float> gathered(static_cast<size_t>(total_count), -1.0f);
  for (long i = 0; i < part; ++i) gathered[static_cast<size_t>(offset + i)] = static_cast<float>(r * 1000 + i);
  comm->all_gather_in_place(gathered.data(), counts);
  for (int k = 0, at = 0; k < n; ++k)
    for (long i = 0; i < counts[static_cast<size_t>(k)]; ++i, ++at)
      expect(gathered[static_cast<size_t>(at)] == k * 1000 + i, "all_gather", r, at, gathered[static_cast<size_t>(at)],
             k * 1000 + i);

  double pair[2] = {1.0 * r, 0.5};
  comm->all_reduce_sum(pair, 2);
  expect(pair[0] == n * (n - 1) / 2.0 && pair[1] == 0.5 * n, "all_reduce(double)", r, 0, pair[0], n * (n - 1) / 2.0);
  if (r == 0) {
    for (int k = 1; k < n; ++k) {
      long got = -1;
      comm->recv(&got, sizeof got, k);
      expect(got == 7 * k, "recv", r, k, static_cast<double>(got), 7.0 * k);
    }
  } else {
    const long sent = 7L * r;
    comm->send(&sent, sizeof sent, 0);
  }

  double value = r == 0 ? 3.25 : -1.0;
  comm->broadcast(&value, sizeof value, 0);
  expect(value == 3.25, "broadcast", r, 0, value, 3.25);
  const double total = comm->sum(r + 0.5);
  expect(std::fabs(total - (ranks_sum - n + 0.5 * n)) < 1e-12, "sum", r, 0, total, ranks_sum - n + 0.5 * n);
  comm->barrier();
  std::printf("rank %d of %d (local %d, %s): %s\n", r, n, comm->local_rank(), comm->backend().c_str(),
              failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
