// CPU feature detection, read once at start-up.
#pragma once

#include <string>

namespace fusetrain {

/// Instruction-set features that select kernels at run time.
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  /// Half-precision conversions (vcvtph2ps / vcvtps2ph on 8 lanes), with the AVX state enabled.
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;
  /// "avx2 fma avx512f ..." for the features present.
  std::string to_string() const;
};

/// Features of this CPU (and enabled by the OS). AMX counts only when the kernel
/// granted this process the tile state.
const CpuFeatures& cpu_features();

/// The CPU's brand string, e.g. "AMD EPYC 9R14".
std::string cpu_model_name();

}  // namespace fusetrain
