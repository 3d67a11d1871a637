// DataLoader: batches of an epoch in a seeded order, collated ahead of time on a background thread.
//
//   DataLoader loader(train.size(), {.batch_size = 32, .shuffle = true, .seed = 42},
//                     padded_collate(train, {.pad_id = tokenizer.pad_id()}));
//   for (int64_t epoch = 0; epoch < 3; ++epoch) {
//     loader.start_epoch(epoch);
//     while (auto batch = loader.next()) step(*batch);
//   }
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "fusetrain/data/collator.h"

namespace fusetrain::data {

/// Makes one batch from example indices. `batch_number` counts batches across epochs
/// (epoch * batches_per_epoch + position in the epoch), so a seeded collator (MLM masking) gives every batch of a
/// run its own, reproducible draws. Called on the loader's background thread.
using CollateFn = std::function<Batch(std::span<const int64_t> indices, uint64_t batch_number)>;

/// Options for padded_collate.
struct CollateOptions {
  int64_t pad_to_multiple_of = 8;
  int64_t pad_id = 0;
  /// Set for masked LM: apply_mlm_mask with this spec after padding.
  std::optional<MaskSpec> mlm = std::nullopt;
  /// Seed of the MLM masks.
  uint64_t seed = 42;
  /// A sequence-to-sequence dataset's decoder start token (collate_padded); -1 for other datasets.
  int64_t decoder_start_id = -1;
};

/// A CollateFn over `dataset` (held by reference; it must outlive the function): collate_padded, then
/// apply_mlm_mask(seed, batch_number) when options.mlm is set.
CollateFn padded_collate(const TokenizedDataset& dataset, const CollateOptions& options = {});

/// Options for DataLoader.
struct LoaderOptions {
  /// Examples per batch; 0 is an error.
  int64_t batch_size = 8;
  /// Visit the examples in a new seeded order each epoch (else in index order).
  bool shuffle = false;
  /// The order of epoch e comes from std::mt19937_64 seeded with seed + e.
  uint64_t seed = 42;
  /// Drop the last batch of an epoch when it is smaller than batch_size.
  bool drop_last = false;
  /// Batches collated ahead of the consumer (the bound of the queue), at least 1.
  int64_t prefetch = 4;
  /// Group by length (transformers' train_sampling_strategy="group_by_length") when not empty: one length per
  /// example. Each epoch's shuffled order is then regrouped by length_grouped_order with group_batch_size, so the
  /// examples of a batch have similar lengths and dynamic padding pads little.
  std::vector<int64_t> lengths;
  /// The batch whose multiple makes a group (0: batch_size); a step's examples (batch x accumulation) in training.
  int64_t group_batch_size = 0;
};

/// Regroups a shuffled `order` by `lengths` (indexed by example) as transformers' LengthGroupedSampler does: cut
/// into megabatches of batch_size x min(order.size() / (4 x batch_size), 50) examples (at least one batch), each
/// sorted by descending length (stably), then the longest example of all swapped to the first position (so a batch
/// that does not fit in memory fails at once). Throws Error if batch_size is not positive or an example has no
/// length.
std::vector<int64_t> length_grouped_order(std::vector<int64_t> order, std::span<const int64_t> lengths,
                                          int64_t batch_size);

/// Yields the batches of an epoch in a deterministic order while a background thread collates up to `prefetch`
/// batches ahead in a bounded queue. Used from one thread. An exception thrown by the collate function is rethrown
/// by next() once the batches before it are consumed. Destroying the loader mid-epoch stops and joins the thread.
class DataLoader {
 public:
  /// A loader over examples [0, dataset_size). Throws Error if batch_size is 0 or negative or prefetch < 1.
  DataLoader(int64_t dataset_size, const LoaderOptions& options, CollateFn collate);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Batches in one epoch: dataset_size / batch_size, rounded up unless drop_last.
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  /// Starts epoch `epoch` from its first batch (stopping any epoch in progress) and begins collating ahead.
  void start_epoch(int64_t epoch);
  /// Skips the next k batches of the current epoch without collating them (resuming a run mid-epoch).
  void skip(int64_t k);
  /// The next batch of the epoch, or nullopt after its last one. Starts epoch 0 if no epoch was started.
  std::optional<Batch> next();
  /// The order in which epoch `epoch` visits the examples (a permutation of [0, dataset_size)): a Fisher-Yates
  /// shuffle drawing from std::mt19937_64(seed + epoch) with an exact bounded-integer method, so it is the same
  /// with every standard library; then grouped by length when options.lengths is set.
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  /// The epoch in progress (-1 before the first).
  int64_t epoch() const { return epoch_; }
  /// Position in the epoch of the batch next() returns next.
  int64_t position() const { return position_; }

 private:
  void stop_producer();
  void start_producer(int64_t first_batch);
  void produce(int64_t first_batch);

  int64_t dataset_size_;
  LoaderOptions options_;
  CollateFn collate_;
  int64_t batches_per_epoch_ = 0;
  int64_t epoch_ = -1;
  int64_t position_ = 0;
  std::vector<int64_t> order_;  // this epoch's example order

  std::thread producer_;
  std::mutex mutex_;
  std::condition_variable space_;  // the producer waits here for room in the queue
  std::condition_variable ready_;  // the consumer waits here for a batch, an error or the end
  std::deque<Batch> queue_;
  std::exception_ptr error_;  // the producer's exception, delivered after the queued batches
  bool stopping_ = false;
  bool finished_ = false;  // the producer made its last batch (or failed)
};

}  // namespace fusetrain::data
