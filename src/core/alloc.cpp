#include "fusetrain/core/alloc.h"

#include <sanitizer/asan_interface.h>  // ASAN_POISON_MEMORY_REGION, a no-op outside AddressSanitizer builds

#include <cstdlib>
#include <cstring>

#include "fusetrain/core/error.h"

namespace fusetrain {

void AlignedFree::operator()(void* p) const { std::free(p); }

AlignedPtr aligned_allocate(size_t bytes) {
  size_t size = align_up(bytes == 0 ? 1 : bytes);
  void* p = std::aligned_alloc(kAlignment, size);
  FT_CHECK(p != nullptr, "out of memory: could not allocate ", size, " bytes");
  std::memset(p, 0, size);
  // ASan sees only the rounded allocation; poisoning the rounding makes an access past `bytes` a finding.
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + bytes, size - bytes);
  return AlignedPtr(p);
}

}  // namespace fusetrain
