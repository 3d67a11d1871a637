// Data parallel training over a communicator: gradient buckets communicated while backward runs (DDP), and ZeRO
// stages 1 and 2 (the AdamW moments sharded across ranks).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "fusetrain/comm/communicator.h"
#include "fusetrain/core/alloc.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/runtime/parameters.h"
#include "fusetrain/runtime/plan.h"

namespace fusetrain::train {

/// Consecutive parameter slots [first_slot, last_slot] whose gradients, elements [begin, end) of the flat buffer,
/// are communicated together.
struct Bucket {
  size_t first_slot = 0, last_slot = 0;
  int64_t begin = 0, end = 0;
};

/// The buckets of a parameter store: slots from the last to the first (backward finishes the last layers first),
/// each bucket at most `bucket_bytes` of gradients unless one slot alone is larger. Bucket 0 holds the last slots.
std::vector<Bucket> make_buckets(const runtime::ParameterStore& params, int64_t bucket_bytes);

/// How a bucket is split across ranks for ZeRO: `world` parts of equal length (a multiple of 16 elements, 64 bytes)
/// but the last ones, which may be shorter or empty; part r is rank r's. Returns the parts' lengths.
std::vector<int64_t> bucket_parts(const Bucket& bucket, int world);

/// Rank `rank`'s ZeRO shard: its part of every bucket, in flat-buffer order (the order of its moments).
std::vector<optim::Segment> shard_segments(const std::vector<Bucket>& buckets, int rank, int world);

/// Synchronises the gradients of a data-parallel step across ranks. Each micro-batch's backward runs with this as
/// its plan's observer: after the node that finishes a bucket's last gradient, the bucket is weighted (the rank's
/// share of the step's mean) and communicated, in bucket order on every rank, while the rest of backward goes on.
/// DDP all-reduces the buckets into the full gradient buffer; ZeRO reduce-scatters them into this rank's shard.
class GradientSync final : public runtime::RunObserver {
 public:
  /// `zero_stage` 0, 1 or 2 (TrainingArguments::zero_stage).
  GradientSync(comm::Communicator& comm, runtime::ParameterStore& params, int64_t bucket_bytes, int zero_stage);

  /// Before micro-batch `index` (0-based) of a step's `count`: `weight` is the factor this rank's mean gradient of
  /// the micro-batch gets in the step's mean gradient (its labelled positions over the global count, over `count`).
  /// A rank without data in the micro-batch passes weight 0 and calls skip_backward() instead of running backward.
  void start_micro_batch(int64_t index, int64_t count, double weight);
  /// For a rank without data in this micro-batch: communicates what backward would have.
  void skip_backward();

  /// The optimizer's part: under ZeRO this rank's segments and the gradients it receives for them (laid out like
  /// the moments); for DDP the whole buffers.
  optim::Shard optimizer_shard() const;
  /// After the step's last micro-batch: the squared norm of the step's whole gradient (before the optimizer's
  /// scale). Each bucket's part is summed as soon as it is communicated, while it is still in cache, instead of in
  /// a pass of its own; under ZeRO the shards' sums are added over ranks.
  double global_grad_sum_of_squares() const;
  /// After the optimizer updated this rank's shard: every rank gathers every shard of the parameters (ZeRO).
  void gather_parameters();

  /// One bucket's communication in a run: after which scheduled node it started, and when it started and ended
  /// (seconds since the run began).
  struct Event {
    size_t bucket = 0;
    int after_node = -1;
    double start = 0, end = 0;
  };
  /// Records the events of each communicating run (inspect --profile's timeline); off by default.
  void set_record_events(bool on) { record_events_ = on; }
  /// The last communicating run's events.
  const std::vector<Event>& events() const { return events_; }
  /// Seconds spent in the bucket collectives (waiting for other ranks included) since construction.
  double communication_seconds() const { return communication_seconds_; }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  int zero_stage() const { return zero_stage_; }

  // runtime::RunObserver
  void begin(const runtime::Plan& plan) override;
  void after_node(size_t index) override;
  void end() override;

 private:
  void communicate(size_t bucket, int after_node);
  void communicate_bucket(size_t bucket);
  /// DDP: all-reduces a bucket holding one embedding table by its non-zero rows only; false when the bucket is not
  /// such a table or too many rows are non-zero (then the caller all-reduces it whole).
  bool all_reduce_rows(const Bucket& bucket);
  static constexpr int64_t kMinSparseRows = 4096;
  // A dense bucket is all-reduced in pieces of at most this many floats (1 MiB, half of L2), so that the norm pass
  // that follows each piece reads it from cache: on W3 this took 2 ranks x 1 thread from 0.906x to 0.943x of
  // 1 process x 2 threads (bench/RESULTS.md).
  static constexpr int64_t kPieceElements = 1 << 18;
  // The sparse embedding all-reduce: row flags and packed rows in the Device's memory (grown, never shrunk), the
  // summed flags read back and the union's row indices in host memory.
  kernels::DeviceBuffer row_flags_, packed_;
  int64_t flag_rows_ = 0, packed_capacity_ = 0;
  std::vector<float> host_flags_;
  std::vector<int64_t> rows_;
  /// The device that owns the gradients, and the context of the serial operations communication interleaves with.
  const kernels::Device& device() const { return params_.device(); }
  static kernels::StepContext serial() { return kernels::StepContext{}; }
  comm::Communicator& comm_;
  runtime::ParameterStore& params_;
  int zero_stage_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<optim::Segment> segments_;  // ZeRO: this rank's shard
  std::vector<int64_t> part_offset_;       // ZeRO: where this rank's part of bucket b starts in the shard
  std::vector<std::vector<int64_t>> parts_;  // ZeRO: every rank's part length, per bucket
  int64_t shard_numel_ = 0;
  kernels::DeviceBuffer shard_grads_;  // ZeRO: this rank's shard of the step's gradient
  kernels::DeviceBuffer receive_;      // ZeRO-2: a bucket's part of the shard, before it is added
  // The plan being run: for each bucket, the node after which its gradients are final.
  const runtime::Plan* plan_ = nullptr;
  std::vector<int> ready_node_;
  size_t next_bucket_ = 0;
  bool communicating_ = false;  // this micro-batch's backward sends its buckets
  bool first_communication_ = true;  // the step's first communicating micro-batch (ZeRO writes, later ones add)
  bool last_micro_batch_ = false;    // the step's last micro-batch: its communication completes the gradient
  double sum_of_squares_ = 0;        // of the step's complete gradient, bucket by bucket (this rank's part)
  // The full buffer holds the step's weighted gradient sum divided by pending_scale_ (DDP and ZeRO-1 accumulate
  // micro-batches locally and send the last one's buffer).
  double pending_scale_ = 1.0;
  bool record_events_ = false;
  std::vector<Event> events_;
  double run_start_ = 0, communication_seconds_ = 0;
};

}  // namespace fusetrain::train
