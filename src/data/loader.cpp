// DataLoader: a producer thread collates batches ahead into a bounded queue; the consumer takes them in order.
#include "fusetrain/data/loader.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "fusetrain/core/error.h"

namespace fusetrain::data {
namespace {

// Uniform integer in [0, bound) from a 64-bit generator, exactly (Lemire's multiply-shift with rejection). Unlike
// std::uniform_int_distribution its output is specified here, so orders match across standard libraries.
uint64_t bounded(std::mt19937_64& rng, uint64_t bound) {
  unsigned __int128 product = static_cast<unsigned __int128>(rng()) * bound;
  uint64_t low = static_cast<uint64_t>(product);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      product = static_cast<unsigned __int128>(rng()) * bound;
      low = static_cast<uint64_t>(product);
    }
  }
  return static_cast<uint64_t>(product >> 64);
}

}  // namespace

std::vector<int64_t> length_grouped_order(std::vector<int64_t> order, std::span<const int64_t> lengths,
                                          int64_t batch_size) {
  FT_CHECK(batch_size > 0, "length_grouped_order: batch_size must be positive, got ", batch_size);
  for (int64_t index : order)
    FT_CHECK(index >= 0 && static_cast<size_t>(index) < lengths.size(), "length_grouped_order: example ", index,
             " has no length (", lengths.size(), " lengths given)");
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t megabatch = batch_size * std::max<int64_t>(std::min<int64_t>(n / (batch_size * 4), 50), 1);
  auto longer = [&](int64_t a, int64_t b) { return lengths[static_cast<size_t>(a)] > lengths[static_cast<size_t>(b)]; };
  size_t longest_group = 0;  // the megabatch whose first (longest) example is the longest of all; the first such
  for (int64_t begin = 0; begin < n; begin += megabatch) {
    auto first = order.begin() + begin, last = order.begin() + std::min(n, begin + megabatch);
    std::stable_sort(first, last, longer);
    if (longer(*first, order[longest_group])) longest_group = static_cast<size_t>(begin);
  }
  if (n > 0) std::swap(order[0], order[longest_group]);
  return order;
}

CollateFn padded_collate(const TokenizedDataset& dataset, const CollateOptions& options) {
  return [&dataset, options](std::span<const int64_t> indices, uint64_t batch_number) {
    Batch batch = collate_padded(dataset, indices, options.pad_to_multiple_of, options.pad_id, options.decoder_start_id);
    if (options.mlm) apply_mlm_mask(batch, *options.mlm, options.seed, batch_number);
    return batch;
  };
}

DataLoader::DataLoader(int64_t dataset_size, const LoaderOptions& options, CollateFn collate)
    : dataset_size_(dataset_size), options_(options), collate_(std::move(collate)) {
  FT_CHECK(options.batch_size > 0, "DataLoader: batch_size must be positive, got ", options.batch_size);
  FT_CHECK(options.prefetch > 0, "DataLoader: prefetch must be at least 1, got ", options.prefetch);
  FT_CHECK(dataset_size >= 0, "DataLoader: dataset_size must not be negative, got ", dataset_size);
  FT_CHECK(options.lengths.empty() || static_cast<int64_t>(options.lengths.size()) == dataset_size,
           "DataLoader: grouping by length needs one length per example: ", options.lengths.size(), " lengths for ",
           dataset_size, " examples");
  FT_CHECK(options.group_batch_size >= 0, "DataLoader: group_batch_size must not be negative, got ",
           options.group_batch_size);
  FT_CHECK(static_cast<bool>(collate_), "DataLoader: no collate function given");
  batches_per_epoch_ = options.drop_last ? dataset_size / options.batch_size
                                         : (dataset_size + options.batch_size - 1) / options.batch_size;
}

DataLoader::~DataLoader() { stop_producer(); }

std::vector<int64_t> DataLoader::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!options_.shuffle) return order;
  std::mt19937_64 rng(options_.seed + static_cast<uint64_t>(epoch));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[bounded(rng, i)]);
  if (options_.lengths.empty()) return order;
  return length_grouped_order(std::move(order), options_.lengths,
                              options_.group_batch_size > 0 ? options_.group_batch_size : options_.batch_size);
}

void DataLoader::start_epoch(int64_t epoch) {
  FT_CHECK(epoch >= 0, "DataLoader: epoch must not be negative, got ", epoch);
  stop_producer();
  epoch_ = epoch;
  order_ = epoch_order(epoch);
  position_ = 0;
  start_producer(0);
}

void DataLoader::skip(int64_t k) {
  FT_CHECK(k >= 0, "DataLoader: cannot skip ", k, " batches");
  if (epoch_ < 0) start_epoch(0);
  {
    std::lock_guard lock(mutex_);
    for (; k > 0 && !queue_.empty(); --k, ++position_) queue_.pop_front();
  }
  space_.notify_one();
  if (k == 0) return;
  stop_producer();
  position_ = std::min(position_ + k, batches_per_epoch_);
  start_producer(position_);
}

std::optional<Batch> DataLoader::next() {
  if (epoch_ < 0) start_epoch(0);
  std::unique_lock lock(mutex_);
  ready_.wait(lock, [&] { return !queue_.empty() || finished_; });
  if (!queue_.empty()) {
    Batch batch = std::move(queue_.front());
    queue_.pop_front();
    ++position_;
    lock.unlock();
    space_.notify_one();
    return batch;
  }
  if (error_) std::rethrow_exception(error_);  // stays until the next start_epoch
  return std::nullopt;
}

void DataLoader::stop_producer() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  space_.notify_all();
  if (producer_.joinable()) producer_.join();
  std::lock_guard lock(mutex_);
  queue_.clear();
  error_ = nullptr;
  stopping_ = false;
  finished_ = false;
}

void DataLoader::start_producer(int64_t first_batch) {
  finished_ = false;
  producer_ = std::thread(&DataLoader::produce, this, first_batch);
}

// Runs on the producer thread. order_, epoch_ and collate_ stay unchanged while it runs: the consumer only
// changes them after stop_producer() joined it.
void DataLoader::produce(int64_t first_batch) {
  const size_t batch_size = static_cast<size_t>(options_.batch_size);
  const uint64_t first_number = static_cast<uint64_t>(epoch_) * static_cast<uint64_t>(batches_per_epoch_);
  try {
    for (int64_t i = first_batch; i < batches_per_epoch_; ++i) {
      {
        std::unique_lock lock(mutex_);
        space_.wait(lock, [&] { return stopping_ || static_cast<int64_t>(queue_.size()) < options_.prefetch; });
        if (stopping_) return;
      }
      const size_t begin = static_cast<size_t>(i) * batch_size;
      const size_t count = std::min(batch_size, order_.size() - begin);
      Batch batch =
          collate_(std::span<const int64_t>(order_.data() + begin, count), first_number + static_cast<uint64_t>(i));
      {
        std::lock_guard lock(mutex_);
        if (stopping_) return;
        queue_.push_back(std::move(batch));
      }
      ready_.notify_one();
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    error_ = std::current_exception();
  }
  {
    std::lock_guard lock(mutex_);
    finished_ = true;
  }
  ready_.notify_one();
}

}  // namespace fusetrain::data
