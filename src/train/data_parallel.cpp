// Gradient buckets communicated during backward, and the ZeRO shards.
#include "fusetrain/train/data_parallel.h"

#include <algorithm>
#include <chrono>

#include "fusetrain/core/error.h"

namespace fusetrain::train {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

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

std::vector<int64_t> bucket_parts(const Bucket& bucket, int world) {
  FT_CHECK(world > 0, "a world of ", world, " ranks");
  const int64_t n = bucket.end - bucket.begin;
  const int64_t part = ((n + world - 1) / world + 15) / 16 * 16;
  std::vector<int64_t> parts(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    parts[static_cast<size_t>(r)] = std::clamp<int64_t>(n - r * part, 0, part);
  return parts;
}

std::vector<optim::Segment> shard_segments(const std::vector<Bucket>& buckets, int rank, int world) {
  FT_CHECK(rank >= 0 && rank < world, "rank ", rank, " is not in a world of ", world);
  std::vector<optim::Segment> segments;
  for (const Bucket& b : buckets) {
    const std::vector<int64_t> parts = bucket_parts(b, world);
    int64_t begin = b.begin;
    for (int r = 0; r < rank; ++r) begin += parts[static_cast<size_t>(r)];
    if (parts[static_cast<size_t>(rank)] > 0) segments.push_back({begin, begin + parts[static_cast<size_t>(rank)]});
  }
  std::sort(segments.begin(), segments.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
  return segments;
}

GradientSync::GradientSync(comm::Communicator& comm, runtime::ParameterStore& params, int64_t bucket_bytes,
                           int zero_stage)
    : comm_(comm), params_(params), zero_stage_(zero_stage), buckets_(make_buckets(params, bucket_bytes)) {
  FT_CHECK(zero_stage >= 0 && zero_stage <= 2, "ZeRO stage ", zero_stage, " is not 0, 1 or 2");
  if (zero_stage == 0) return;
  const int world = comm.size(), rank = comm.rank();
  segments_ = shard_segments(buckets_, rank, world);
  int64_t largest = 1;
  for (const Bucket& b : buckets_) {
    parts_.push_back(bucket_parts(b, world));
    largest = std::max(largest, parts_.back()[static_cast<size_t>(rank)]);
    // This rank's part of the bucket starts where its segment sits among the shard's flat-ordered segments.
    int64_t begin = b.begin, offset = 0;
    for (int r = 0; r < rank; ++r) begin += parts_.back()[static_cast<size_t>(r)];
    for (const optim::Segment& s : segments_)
      if (s.begin < begin) offset += s.end - s.begin;
    part_offset_.push_back(offset);
  }
  for (const optim::Segment& s : segments_) shard_numel_ += s.end - s.begin;
  shard_grads_ = params.device().allocate(static_cast<size_t>(std::max<int64_t>(shard_numel_, 1)) * sizeof(float));
  if (zero_stage == 2) receive_ = params.device().allocate(static_cast<size_t>(largest) * sizeof(float));
}

optim::Shard GradientSync::optimizer_shard() const {
  if (zero_stage_ == 0) return {};
  return {segments_, static_cast<const float*>(shard_grads_.get())};
}

void GradientSync::start_micro_batch(int64_t index, int64_t count, double weight) {
  FT_CHECK(index >= 0 && index < count && weight >= 0, "micro-batch ", index, " of ", count, " with weight ", weight);
  next_bucket_ = 0;
  last_micro_batch_ = index == count - 1;
  if (last_micro_batch_) sum_of_squares_ = 0;
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
    device().scale(params_.grads_data(), static_cast<float>(pending_scale_ / weight), params_.flat_numel(), serial());
  }
  pending_scale_ = weight;
}

void GradientSync::skip_backward() {
  if (!communicating_) return;
  run_start_ = now();
  events_.clear();
  while (next_bucket_ < buckets_.size()) communicate(next_bucket_++, -1);
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
  run_start_ = now();
  events_.clear();
}

void GradientSync::after_node(size_t index) {
  // Buckets go out in index order on every rank (collectives must match), each as soon as it and those before it
  // are final.
  while (communicating_ && next_bucket_ < buckets_.size() &&
         ready_node_[next_bucket_] <= static_cast<int>(index))
    communicate(next_bucket_++, static_cast<int>(index));
}

void GradientSync::end() {
  if (!communicating_) return;
  while (next_bucket_ < buckets_.size()) communicate(next_bucket_++, -1);
  communicating_ = false;
}

void GradientSync::communicate(size_t index, int after_node) {
  const double start = now();
  communicate_bucket(index);
  const double end = now();
  communication_seconds_ += end - start;
  if (record_events_) events_.push_back({index, after_node, start - run_start_, end - run_start_});
}

void GradientSync::communicate_bucket(size_t index) {
  const Bucket& b = buckets_[index];
  float* g = params_.grads_data() + b.begin;
  const int64_t n = b.end - b.begin;
  if (pending_scale_ != 1.0) device().scale(g, static_cast<float>(pending_scale_), n, serial());
  if (zero_stage_ == 0) {
    if (all_reduce_rows(b)) return;
    // The bucket goes out in pieces that fit in L2, each squared for the norm right after its all-reduce leaves it
    // in cache (one pass less over memory than a whole-bucket all-reduce then a whole-bucket norm).
    for (int64_t i = 0; i < n; i += kPieceElements) {
      const int64_t m = std::min(kPieceElements, n - i);
      comm_.all_reduce_sum(g + i, m);
      if (last_micro_batch_) sum_of_squares_ += device().sum_of_squares(g + i, m, serial());
    }
    return;
  }
  // Each rank receives the sum of its part of the bucket.
  const std::vector<int64_t>& parts = parts_[index];
  const int64_t mine = parts[static_cast<size_t>(comm_.rank())];
  float* shard = static_cast<float*>(shard_grads_.get()) + part_offset_[index];
  if (first_communication_) {
    comm_.reduce_scatter_sum(g, shard, parts);
  } else {
    float* received = static_cast<float*>(receive_.get());
    comm_.reduce_scatter_sum(g, received, parts);
    device().add_into(shard, received, mine, serial());
  }
  if (last_micro_batch_) sum_of_squares_ += device().sum_of_squares(shard, mine, serial());
  // The full buffer's bucket is spent: zero it now, while in cache, for the next accumulation.
  device().zero(g, static_cast<size_t>(n) * sizeof(float), serial());
}

bool GradientSync::all_reduce_rows(const Bucket& b) {
  // An embedding table's gradient has non-zero rows only for the tokens of the batch (a few percent of a
  // vocabulary): the ranks agree on the union of their non-zero rows (a sum of per-row flags) and all-reduce those
  // rows packed together. The rows outside the union are zero on every rank, so the result is the dense sum's.
  const runtime::ParamSlot& slot = params_.slots()[b.first_slot];
  if (b.first_slot != b.last_slot || slot.shape.rank() != 2 || slot.shape[0] < kMinSparseRows) return false;
  const int64_t rows = slot.shape[0], width = slot.shape[1];
  float* table = params_.grads_data() + slot.offset;
  // The Device's buffers: the row flags (one table's rows) and the packed rows (as many as the largest union seen).
  if (flag_rows_ < rows) {
    row_flags_ = device().allocate(static_cast<size_t>(rows) * sizeof(float));
    flag_rows_ = rows;
  }
  float* flags = static_cast<float*>(row_flags_.get());
  device().zero(flags, static_cast<size_t>(rows) * sizeof(float), serial());
  device().mark_nonzero_rows(table, rows, width, flags, serial());
  comm_.all_reduce_sum(flags, rows);
  host_flags_.resize(static_cast<size_t>(rows));
  device().download(host_flags_.data(), flags, static_cast<size_t>(rows) * sizeof(float));
  rows_.clear();
  for (int64_t r = 0; r < rows; ++r)
    if (host_flags_[static_cast<size_t>(r)] != 0.0f) rows_.push_back(r);
  if (static_cast<int64_t>(rows_.size()) * 2 > rows) return false;  // dense enough: the whole bucket is cheaper
  const auto count = static_cast<int64_t>(rows_.size());
  const int64_t packed = count * width;
  if (packed_capacity_ < packed) {
    packed_ = device().allocate(static_cast<size_t>(packed) * sizeof(float));
    packed_capacity_ = packed;
  }
  float* rows_packed = static_cast<float*>(packed_.get());
  device().gather_rows(table, width, rows_.data(), count, rows_packed, serial());
  comm_.all_reduce_sum(rows_packed, packed);
  // Every row outside the union is zero, so the packed rows carry the whole table's sum of squares.
  if (last_micro_batch_) sum_of_squares_ += device().sum_of_squares(rows_packed, packed, serial());
  device().scatter_rows(rows_packed, width, rows_.data(), count, table, serial());
  return true;
}

double GradientSync::global_grad_sum_of_squares() const {
  return zero_stage_ > 0 ? comm_.sum(sum_of_squares_) : sum_of_squares_;
}

void GradientSync::gather_parameters() {
  if (zero_stage_ == 0) return;
  for (size_t b = 0; b < buckets_.size(); ++b)
    comm_.all_gather_in_place(params_.params_data() + buckets_[b].begin, parts_[b]);
}

}  // namespace fusetrain::train
