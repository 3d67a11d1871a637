#include "fusetrain/core/cpu.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace fusetrain {
namespace {

uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux requires a process to ask for the AMX tile data state before using it.
bool request_amx_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  bool osxsave = ecx & (1u << 27);
  bool has_fma = ecx & (1u << 12);
  bool has_f16c = ecx & (1u << 29);
  uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  bool ymm_state = (xcr0 & 0x6) == 0x6;
  bool zmm_state = (xcr0 & 0xe6) == 0xe6;
  bool tile_state = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  f.avx2 = ymm_state && (ebx & (1u << 5));
  f.fma = ymm_state && has_fma;
  f.f16c = ymm_state && has_f16c;
  f.avx512f = zmm_state && (ebx & (1u << 16));
  f.avx512bw = f.avx512f && (ebx & (1u << 30));
  f.avx512vl = f.avx512f && (ebx & (1u << 31));
  f.avx512dq = f.avx512f && (ebx & (1u << 17));
  bool amx_bf16 = edx & (1u << 22);
  bool amx_tile = edx & (1u << 24);
  unsigned eax1, ebx1, ecx1, edx1;
  if (__get_cpuid_count(7, 1, &eax1, &ebx1, &ecx1, &edx1)) f.avx512_bf16 = f.avx512f && (eax1 & (1u << 5));
  if (amx_tile && tile_state && request_amx_permission()) {
    f.amx_tile = true;
    f.amx_bf16 = amx_bf16;
  }
  return f;
}

}  // namespace

std::string CpuFeatures::to_string() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512dq, "avx512dq");
  add(avx512_bf16, "avx512_bf16");
  add(amx_tile, "amx_tile");
  add(amx_bf16, "amx_bf16");
  return s.empty() ? "none" : s;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

std::string cpu_model_name() {
  unsigned regs[12] = {};
  unsigned max_ext = __get_cpuid_max(0x80000000u, nullptr);
  if (max_ext < 0x80000004u) return "unknown x86-64";
  for (unsigned i = 0; i < 3; ++i)
    __get_cpuid(0x80000002u + i, &regs[i * 4], &regs[i * 4 + 1], &regs[i * 4 + 2], &regs[i * 4 + 3]);
  char name[49] = {};
  std::memcpy(name, regs, 48);
  std::string s(name);
  size_t begin = s.find_first_not_of(' ');
  size_t end = s.find_last_not_of(' ');
  return begin == std::string::npos ? "unknown x86-64" : s.substr(begin, end - begin + 1);
}

}  // namespace fusetrain
