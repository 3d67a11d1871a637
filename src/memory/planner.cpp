#include "fusetrain/memory/planner.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"

namespace fusetrain::memory {
namespace {

bool lifetimes_overlap(const BufferRequest& a, const BufferRequest& b) {
  return a.first <= b.last && b.first <= a.last;
}

}  // namespace

ArenaPlan plan_arena(const std::vector<BufferRequest>& requests, size_t alignment) {
  ArenaPlan plan;
  plan.alignment = alignment;
  plan.offsets.assign(requests.size(), 0);
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (requests[a].bytes != requests[b].bytes) return requests[a].bytes > requests[b].bytes;
    return requests[a].first < requests[b].first;
  });

  struct Placed {
    size_t offset, end;
  };
  std::vector<size_t> placed;  // request indices already given an offset
  std::vector<Placed> conflicts;
  for (size_t index : order) {
    const BufferRequest& r = requests[index];
    size_t size = align_up(r.bytes, alignment);
    FT_CHECK(r.first <= r.last, "buffer ", r.name, ": lifetime [", r.first, ", ", r.last, "] is empty");
    conflicts.clear();
    for (size_t other : placed)
      if (lifetimes_overlap(r, requests[other]))
        conflicts.push_back({plan.offsets[other], plan.offsets[other] + align_up(requests[other].bytes, alignment)});
    std::sort(conflicts.begin(), conflicts.end(), [](const Placed& a, const Placed& b) { return a.offset < b.offset; });
    // Best fit: the smallest gap between conflicting buffers that holds `size`.
    size_t best_offset = 0, best_gap = SIZE_MAX, cursor = 0;
    bool found = false;
    for (const Placed& c : conflicts) {
      if (c.offset > cursor) {
        size_t gap = c.offset - cursor;
        if (gap >= size && gap < best_gap) {
          best_gap = gap;
          best_offset = cursor;
          found = true;
        }
      }
      cursor = std::max(cursor, c.end);
    }
    plan.offsets[index] = found ? best_offset : cursor;
    plan.arena_bytes = std::max(plan.arena_bytes, plan.offsets[index] + size);
    placed.push_back(index);
  }
  return plan;
}

void check_arena(const std::vector<BufferRequest>& requests, const ArenaPlan& plan) {
  FT_CHECK(plan.offsets.size() == requests.size(), "arena plan has ", plan.offsets.size(), " offsets for ",
           requests.size(), " buffers");
  for (size_t i = 0; i < requests.size(); ++i) {
    FT_CHECK(plan.offsets[i] % plan.alignment == 0, "buffer ", requests[i].name, " at offset ", plan.offsets[i],
             " is not ", plan.alignment, "-byte aligned");
    FT_CHECK(plan.offsets[i] + requests[i].bytes <= plan.arena_bytes, "buffer ", requests[i].name,
             " ends past the arena (", plan.offsets[i] + requests[i].bytes, " > ", plan.arena_bytes, ")");
  }
  // Sweep in offset order; only buffers whose byte ranges overlap are compared.
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return plan.offsets[a] < plan.offsets[b]; });
  for (size_t i = 0; i < order.size(); ++i) {
    const BufferRequest& a = requests[order[i]];
    size_t a_end = plan.offsets[order[i]] + a.bytes;
    for (size_t j = i + 1; j < order.size() && plan.offsets[order[j]] < a_end; ++j) {
      const BufferRequest& b = requests[order[j]];
      if (a.bytes == 0 || b.bytes == 0) continue;
      FT_CHECK(!lifetimes_overlap(a, b), "memory plan is unsound: ", a.name, " (bytes ", plan.offsets[order[i]], "..",
               a_end, ", steps ", a.first, "..", a.last, ") overlaps ", b.name, " (bytes ", plan.offsets[order[j]],
               "..", plan.offsets[order[j]] + b.bytes, ", steps ", b.first, "..", b.last, ")");
    }
  }
}

size_t naive_bytes(const std::vector<BufferRequest>& requests, size_t alignment) {
  size_t total = 0;
  for (const BufferRequest& r : requests) total += align_up(r.bytes, alignment);
  return total;
}

std::string MemoryReport::to_string() const {
  auto size = [](size_t bytes) {
    char buf[32];
    if (bytes >= (size_t{1} << 20))
      std::snprintf(buf, sizeof buf, "%10.2f MiB", bytes / 1048576.0);
    else
      std::snprintf(buf, sizeof buf, "%10.2f KiB", bytes / 1024.0);
    return std::string(buf);
  };
  char buf[160];
  std::string out;
  out += "parameters        " + size(parameter_bytes) + "\n";
  if (frozen_parameter_bytes > 0)
    out += "frozen weights    " + size(frozen_parameter_bytes) + "  (no gradient, no optimizer state)\n";
  out += "gradients         " + size(gradient_bytes) + "\n";
  out += "optimizer state   " + size(optimizer_state_bytes) + "\n";
  out += "inputs            " + size(input_bytes) + "\n";
  std::snprintf(buf, sizeof buf, "  (one arena: %zu buffers, %zu in place)\n", num_buffers, num_in_place);
  out += "activation peak   " + size(activation_peak_bytes) + buf;
  out += "activations naive " + size(activation_naive_bytes) + "  (every activation in its own buffer)\n";
  return out;
}

}  // namespace fusetrain::memory
