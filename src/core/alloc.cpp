#include "fusetrain/core/alloc.h"

#if __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>  // ASAN_(UN)POISON_MEMORY_REGION, no-ops outside AddressSanitizer builds
#else  // a toolchain without the sanitizer headers (the wheel's zig cc) builds no AddressSanitizer build either
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "fusetrain/core/error.h"

namespace fusetrain {

namespace {

// From this size on, memory comes straight from mmap: the kernel hands out zero pages and commits each on its first
// write, so a buffer that is never written (the gradients of weights LoRA then freezes, padding, an arena's unused
// tail) costs address space only. Below it, aligned_alloc + memset.
constexpr size_t kMapThreshold = size_t{1} << 20;

// Every buffer is preceded by one kAlignment-sized header holding the bytes mapped for it (0: from aligned_alloc),
// so AlignedFree, a stateless deleter, knows how to give it back.
constexpr size_t kHeader = kAlignment;

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

void AlignedFree::operator()(void* p) const {
  if (p == nullptr) return;
  char* base = static_cast<char*>(p) - kHeader;
  ASAN_UNPOISON_MEMORY_REGION(base, kHeader);
  size_t mapped;
  std::memcpy(&mapped, base, sizeof mapped);
  if (mapped == 0) return std::free(base);
  ASAN_UNPOISON_MEMORY_REGION(base, mapped);  // the range may be mapped again for someone else
  munmap(base, mapped);
}

AlignedPtr aligned_allocate(size_t bytes) {
  const size_t size = align_up(bytes == 0 ? 1 : bytes);
  char* base = nullptr;
  size_t mapped = 0, usable = size;
  if (size + kHeader >= kMapThreshold) {
    mapped = align_up(size + kHeader, page_size());
    // MAP_NORESERVE: the pages are counted as they are written, not at the mapping, so a store laid out but never
    // filled (a model loaded straight into its quantised LoRA layout) is not refused for the size it never uses.
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    FT_CHECK(p != MAP_FAILED, "out of memory: could not map ", mapped, " bytes");
    base = static_cast<char*>(p);  // zero pages
    usable = mapped - kHeader;
  } else {
    base = static_cast<char*>(std::aligned_alloc(kAlignment, size + kHeader));
    FT_CHECK(base != nullptr, "out of memory: could not allocate ", size + kHeader, " bytes");
    std::memset(base + kHeader, 0, size);
  }
  std::memcpy(base, &mapped, sizeof mapped);
  char* data = base + kHeader;
  // ASan sees the whole block; poisoning the header and what lies past `bytes` makes an access outside the buffer a
  // finding.
  ASAN_POISON_MEMORY_REGION(base, kHeader);
  ASAN_POISON_MEMORY_REGION(data + bytes, usable - bytes);
  return AlignedPtr(data);
}

void release_pages(void* p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), page = page_size();
  const uintptr_t first = (begin + page - 1) / page * page, last = (begin + bytes) / page * page;
  if (p == nullptr || last <= first) return;
  // Private anonymous memory (mapped, or the allocator's): the pages are dropped and come back zero-filled. Advice
  // the kernel refuses leaves the memory as it was, which is still correct, only not smaller.
  madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace fusetrain
