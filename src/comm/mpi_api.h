// The C interface between the engine and its Open MPI plugin (libfusetrain_mpi.so, src/comm/mpi_plugin.cpp). The
// engine never links MPI: it loads the plugin when a job is launched by mpirun, so an installation without Open MPI
// trains one process and says what to install when asked for more. Plain C types only (no exception, no C++ type
// crosses it): every call returns 0 or an MPI error code, which error_string() describes.
#pragma once

#include <stdint.h>

extern "C" {

/// Version 1 of the table; a change of any entry is a new version and a new entry point.
struct FusetrainMpiApi {
  /// Initialises MPI (MPI_THREAD_FUNNELED) unless it is; finalises it at exit.
  int (*init)();
  /// This process's rank, the world's size and the rank among the processes on this host.
  int (*rank)(int* rank);
  int (*size)(int* size);
  int (*local_rank)(int* local_rank);
  /// The library's version text up to its first comma ("Open MPI v4.1.4").
  int (*library_version)(char* text, int capacity);
  /// Sums over ranks in place.
  int (*all_reduce_f32)(float* data, int count);
  int (*all_reduce_f64)(double* data, int count);
  /// all_reduce_f32 started in the background; *request is then waited on (and released) by wait().
  int (*start_all_reduce_f32)(float* data, int count, void** request);
  int (*wait)(void* request);
  /// MPI_Reduce_scatter of f32 with `counts` per rank; MPI_Allgatherv in place with counts and displacements.
  int (*reduce_scatter_f32)(const float* in, float* out, const int* counts);
  int (*all_gather_f32)(float* data, const int* counts, const int* displacements);
  int (*send)(const void* data, int bytes, int dest);
  int (*recv)(void* data, int bytes, int source);
  int (*broadcast)(void* data, int bytes, int root);
  int (*barrier)();
  /// The text of an error code, NUL-terminated within capacity.
  void (*error_string)(int code, char* text, int capacity);
};

/// The plugin's one exported symbol.
const FusetrainMpiApi* fusetrain_mpi_api_v1();
}
