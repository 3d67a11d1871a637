/* Linked into the wheel's modules (scripts/wheel.sh): the math functions the engine calls, from the machine's glibc as
 * in a source build. zig's toolchain links its own copies of these, which round some results differently from
 * glibc's (glibc picks FMA variants at run time), so the wheel would train to other numbers than the source build. */
#define GLIBC_MATH(type, name, version)                    \
  type glibc_##name(type) __asm__(#name "@" version);       \
  type name(type x) { return glibc_##name(x); }

GLIBC_MATH(float, expf, "GLIBC_2.27")
GLIBC_MATH(float, logf, "GLIBC_2.27")
GLIBC_MATH(float, sinf, "GLIBC_2.2.5")
GLIBC_MATH(float, cosf, "GLIBC_2.2.5")
GLIBC_MATH(double, exp, "GLIBC_2.2.5")
GLIBC_MATH(double, log, "GLIBC_2.2.5")
GLIBC_MATH(double, sin, "GLIBC_2.2.5")
GLIBC_MATH(double, cos, "GLIBC_2.2.5")
