// libfusetrain_mpi.so: the engine's collectives over Open MPI (MPI_COMM_WORLD), behind the C table of mpi_api.h.
// Built and linked against MPI on its own, so the engine and the wheel load Open MPI only for a multi-process job.
// Only the thread that created the communicator calls it (MPI_THREAD_FUNNELED).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "comm/mpi_api.h"

namespace {

int init() {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised) return MPI_SUCCESS;
  int provided = 0;
  const int status = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (status != MPI_SUCCESS) return status;
  std::atexit([] {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised) MPI_Finalize();
  });
  return MPI_SUCCESS;
}

int rank(int* out) { return MPI_Comm_rank(MPI_COMM_WORLD, out); }
int size(int* out) { return MPI_Comm_size(MPI_COMM_WORLD, out); }

int local_rank(int* out) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm local;
  const int status = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &local);
  if (status != MPI_SUCCESS) return status;
  MPI_Comm_rank(local, out);
  return MPI_Comm_free(&local);
}

int library_version(char* text, int capacity) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  const int status = MPI_Get_library_version(version, &length);
  if (status != MPI_SUCCESS) return status;
  std::string whole(version, static_cast<size_t>(length));
  whole = whole.substr(0, whole.find(','));
  std::snprintf(text, static_cast<size_t>(capacity), "%s", whole.c_str());
  return MPI_SUCCESS;
}

int all_reduce_f32(float* data, int count) {
  return MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}
int all_reduce_f64(double* data, int count) {
  return MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
}

int start_all_reduce_f32(float* data, int count, void** request) {
  auto* handle = new MPI_Request(MPI_REQUEST_NULL);
  const int status = MPI_Iallreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, handle);
  *request = handle;
  return status;
}

int wait(void* request) {
  auto* handle = static_cast<MPI_Request*>(request);
  const int status = *handle == MPI_REQUEST_NULL ? MPI_SUCCESS : MPI_Wait(handle, MPI_STATUS_IGNORE);
  delete handle;
  return status;
}

int reduce_scatter_f32(const float* in, float* out, const int* counts) {
  return MPI_Reduce_scatter(in, out, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}
int all_gather_f32(float* data, const int* counts, const int* displacements) {
  return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts, displacements, MPI_FLOAT, MPI_COMM_WORLD);
}
int send(const void* data, int bytes, int dest) { return MPI_Send(data, bytes, MPI_BYTE, dest, 0, MPI_COMM_WORLD); }
int recv(void* data, int bytes, int source) {
  return MPI_Recv(data, bytes, MPI_BYTE, source, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}
int broadcast(void* data, int bytes, int root) { return MPI_Bcast(data, bytes, MPI_BYTE, root, MPI_COMM_WORLD); }
int barrier() { return MPI_Barrier(MPI_COMM_WORLD); }

void error_string(int code, char* text, int capacity) {
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, message, &length) != MPI_SUCCESS) length = 0;
  std::snprintf(text, static_cast<size_t>(capacity), "%.*s", length, message);
}

const FusetrainMpiApi kApi = {init,           rank,      size,           local_rank,         library_version,
                              all_reduce_f32, all_reduce_f64, start_all_reduce_f32, wait, reduce_scatter_f32,
                              all_gather_f32, send,      recv,           broadcast,          barrier,
                              error_string};

}  // namespace

extern "C" __attribute__((visibility("default"))) const FusetrainMpiApi* fusetrain_mpi_api_v1() { return &kApi; }
