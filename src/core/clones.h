// Element loops compiled for AVX-512, AVX2 and baseline x86-64, chosen at load time by CPU (target_clones); the
// library itself is built for baseline x86-64. ThreadSanitizer builds keep one plain copy: g++ and clang both
// instrument the clones' load-time resolver, which then runs before TSan is up and crashes.
#pragma once

#ifdef FUSETRAIN_NO_TARGET_CLONES
#define FT_VECTOR_CLONES
#else
#define FT_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
