// Gradient buckets communicated during backward, and the ZeRO shards.
#include "fusetrain/train/data_parallel.h"

#include <algorithm>
#include <cstring>

#include "fusetrain/core/error.h"

namespace fusetrain::train {

std::vector<Bucket> make_buckets(const runtime::ParameterStore& params, int64_t bucket_bytes) {
  FT_CHECK(bucket_bytes > 0, "the gradient bucket size must be positive, found ", bucket_bytes, " bytes");
  const std::vector<runtime::ParamSlot>& slots = params.slots();
  // A slot's extent runs to the next slot's offset, so the buckets tile the flat buffer, alignment padding included.
  auto end_of = [&](size_t i) { return i + 1 < slots.size() ? slots[i + 1].offset : params.flat_numel(); };
  std::vector<Bucket> buckets;
  for (size_t i = slots.size(); i-- > 0;) {
    const int64_t grown = (buckets.empty() ? 0 : buckets.back().end - slots[i].offset) * 4;
    if (!buckets.empty() && grown <= bucket_bytes) {
      buckets.back().first_slot = i;
      buckets.back().begin = slots[i].offset;
      continue;
    }
    buckets.push_back({i, i, slots[i].offset, end_of(i)});
  }
  return buckets;
}

std::pair<int64_t, int64_t> shard_of(int64_t flat_numel, int rank, int world) {
  FT_CHECK(world > 0 && rank >= 0 && rank < world, "rank ", rank, " is not in a world of ", world);
  const int64_t per = (flat_numel + world - 1) / world;
  const int64_t size = (per + 15) / 16 * 16;
  return {std::min(flat_numel, rank * size), std::min(flat_numel, (rank + 1) * size)};
}

GradientSync::GradientSync(comm::Communicator& comm, runtime::ParameterStore& params, int64_t bucket_bytes,
                           int zero_stage)
    : comm_(comm), params_(params), zero_stage_(zero_stage), buckets_(make_buckets(params, bucket_bytes)) {
  FT_CHECK(zero_stage >= 0 && zero_stage <= 2, "ZeRO stage ", zero_stage, " is not 0, 1 or 2");
  const int world = comm.size();
  shard_ = zero_stage > 0 ? shard_of(params.flat_numel(), comm.rank(), world)
                          : std::pair<int64_t, int64_t>{0, params.flat_numel()};
  if (zero_stage > 0) {
    shard_grads_ = aligned_allocate(static_cast<size_t>(std::max<int64_t>(shard_.second - shard_.first, 1)) * 4);
    int64_t largest = 1;
    for (const Bucket& b : buckets_) largest = std::max(largest, b.end - b.begin);
    if (zero_stage == 2) receive_ = aligned_allocate(static_cast<size_t>(largest) * sizeof(float));
    for (int r = 0; r < world; ++r) {
      const auto [begin, end] = shard_of(params.flat_numel(), r, world);
      all_shards_.push_back(end - begin);
    }
  }
  counts_.assign(static_cast<size_t>(world), 0);
}

size_t GradientSync::shard_gradient_bytes() const {
  if (zero_stage_ == 0) return 0;
  int64_t largest = 0;
  for (const Bucket& b : buckets_) largest = std::max(largest, b.end - b.begin);
  return static_cast<size_t>(shard_.second - shard_.first + (zero_stage_ == 2 ? largest : 0)) * sizeof(float);
}

void GradientSync::start_micro_batch(int64_t index, int64_t count, double weight) {
  FT_CHECK(index >= 0 && index < count && weight >= 0, "micro-batch ", index, " of ", count, " with weight ", weight);
  next_bucket_ = 0;
  if (zero_stage_ == 2) {  // every micro-batch is reduce-scattered; the full buffer starts each one at zero
    communicating_ = true;
    first_communication_ = index == 0;
    pending_scale_ = weight;
    return;
  }
  communicating_ = index == count - 1;
  first_communication_ = true;
  if (index == 0) {  // the buffer is zero
    pending_scale_ = weight;
    return;
  }
  if (weight == 0) return;  // no backward on this rank: the buffer and its scale stay
  if (pending_scale_ != weight && pending_scale_ != 0) {
    // The buffer holds (weighted sum so far) / pending_scale_; rescale it so that this micro-batch's gradient adds
    // with factor 1 and the whole is (weighted sum) / weight.
    float* g = params_.grads_data();
    const auto ratio = static_cast<float>(pending_scale_ / weight);
    const int64_t n = params_.flat_numel();
    for (int64_t i = 0; i < n; ++i) g[i] *= ratio;
  }
  pending_scale_ = weight;
}

void GradientSync::skip_backward() {
  if (!communicating_) return;
  while (next_bucket_ < buckets_.size()) communicate(next_bucket_++);
  communicating_ = false;
}

void GradientSync::begin(const runtime::Plan& plan) {
  if (!communicating_) return;
  if (&plan != plan_) {
    plan_ = &plan;
    const std::vector<int>& final_node = plan.gradient_final_node();
    FT_CHECK(final_node.size() == params_.slots().size(), "the plan was compiled against another parameter store");
    ready_node_.assign(buckets_.size(), -1);
    for (size_t b = 0; b < buckets_.size(); ++b)
      for (size_t s = buckets_[b].first_slot; s <= buckets_[b].last_slot; ++s)
        ready_node_[b] = std::max(ready_node_[b], final_node[s]);
  }
  next_bucket_ = 0;
}

void GradientSync::after_node(size_t index) {
  // Buckets go out in index order on every rank (collectives must match), each as soon as it and those before it
  // are final.
  while (communicating_ && next_bucket_ < buckets_.size() &&
         ready_node_[next_bucket_] <= static_cast<int>(index))
    communicate(next_bucket_++);
}

void GradientSync::end() {
  if (!communicating_) return;
  while (next_bucket_ < buckets_.size()) communicate(next_bucket_++);
  communicating_ = false;
}

void GradientSync::communicate(size_t index) {
  const Bucket& b = buckets_[index];
  float* g = params_.grads_data() + b.begin;
  const int64_t n = b.end - b.begin;
  if (pending_scale_ != 1.0) {
    const auto scale = static_cast<float>(pending_scale_);
    for (int64_t i = 0; i < n; ++i) g[i] *= scale;
  }
  if (zero_stage_ == 0) {
    comm_.all_reduce_sum(g, n);
    return;
  }
  // Each rank receives the bucket's part that falls in its shard (an empty part for most ranks).
  const int world = comm_.size();
  for (int r = 0; r < world; ++r) {
    const auto [begin, end] = shard_of(params_.flat_numel(), r, world);
    counts_[static_cast<size_t>(r)] = std::max<int64_t>(0, std::min(end, b.end) - std::max(begin, b.begin));
  }
  const int64_t mine = counts_[static_cast<size_t>(comm_.rank())];
  float* shard = static_cast<float*>(shard_grads_.get()) + (std::max(shard_.first, b.begin) - shard_.first);
  if (first_communication_) {
    comm_.reduce_scatter_sum(g, mine > 0 ? shard : static_cast<float*>(shard_grads_.get()), counts_);
  } else {
    float* received = static_cast<float*>(receive_.get());
    comm_.reduce_scatter_sum(g, received, counts_);
    for (int64_t i = 0; i < mine; ++i) shard[i] += received[i];
  }
  if (zero_stage_ == 2) std::memset(g, 0, static_cast<size_t>(n) * sizeof(float));
}

const float* GradientSync::optimizer_grads() const {
  return zero_stage_ > 0 ? static_cast<const float*>(shard_grads_.get()) : params_.grads_data();
}

double GradientSync::global_grad_sum_of_squares(double local) const {
  return zero_stage_ > 0 ? comm_.sum(local) : local;
}

void GradientSync::gather_parameters() {
  if (zero_stage_ > 0) comm_.all_gather_in_place(params_.params_data(), all_shards_);
}

}  // namespace fusetrain::train
