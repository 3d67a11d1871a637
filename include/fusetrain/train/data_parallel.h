// Data parallel training over a communicator: gradient buckets communicated while backward runs (DDP), and ZeRO
// stages 1 and 2 (the AdamW moments sharded across ranks).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "fusetrain/comm/communicator.h"
#include "fusetrain/core/alloc.h"
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

/// Rank `rank`'s ZeRO shard of a flat buffer of `flat_numel` elements: [rank * S, min((rank + 1) * S, flat_numel))
/// with S = flat_numel / world rounded up to 16 elements (64 bytes); the last ranks' shards may be short or empty.
std::pair<int64_t, int64_t> shard_of(int64_t flat_numel, int rank, int world);

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

  /// The gradients the optimizer reads after the step's last micro-batch: the full buffer (DDP) or, under ZeRO,
  /// this rank's shard, shard_begin()..shard_end() of the flat buffer.
  const float* optimizer_grads() const;
  int64_t shard_begin() const { return shard_.first; }
  int64_t shard_end() const { return shard_.second; }
  /// The sum over ranks of each rank's gradient sum of squares (the global norm squared): the full buffer is
  /// identical on every rank under DDP, so there it is the local sum.
  double global_grad_sum_of_squares(double local) const;
  /// After the optimizer updated this rank's shard: every rank gathers every shard of the parameters (ZeRO).
  void gather_parameters();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  int zero_stage() const { return zero_stage_; }
  /// Bytes of gradients this rank keeps beyond the full buffer (ZeRO's shard accumulator).
  size_t shard_gradient_bytes() const;

  // runtime::RunObserver
  void begin(const runtime::Plan& plan) override;
  void after_node(size_t index) override;
  void end() override;

 private:
  void communicate(size_t bucket);
  comm::Communicator& comm_;
  runtime::ParameterStore& params_;
  int zero_stage_ = 0;
  std::vector<Bucket> buckets_;
  std::pair<int64_t, int64_t> shard_;
  AlignedPtr shard_grads_;  // ZeRO: this rank's shard of the step's gradient
  AlignedPtr receive_;      // ZeRO-2: a bucket's part of the shard, before it is added
  std::vector<int64_t> counts_;
  std::vector<int64_t> all_shards_;  // every rank's shard length (the parameters' all-gather)
  // The plan being run: for each bucket, the node after which its gradients are final.
  const runtime::Plan* plan_ = nullptr;
  std::vector<int> ready_node_;
  size_t next_bucket_ = 0;
  bool communicating_ = false;  // this micro-batch's backward sends its buckets
  bool first_communication_ = true;  // the step's first communicating micro-batch (ZeRO writes, later ones add)
  // The full buffer holds the step's weighted gradient sum divided by pending_scale_ (DDP and ZeRO-1 accumulate
  // micro-batches locally and send the last one's buffer).
  double pending_scale_ = 1.0;
};

}  // namespace fusetrain::train
