#!/usr/bin/env bash
# Apply our fixes to upstream crates: for each patches/NAME+VERSION.patch, copy the crate registry's
# source of NAME VERSION into patched/NAME-VERSION (ignored by git) and apply the patch there. The
# root Cargo.toml's [patch.crates-io] points at those folders, so every build runs this first
# (scripts/quickstart.sh, scripts/test.sh, .ci/run and the Dockerfile do). patches/README.md says
# why each fix exists and how to drop it.
#
# Idempotent and cheap: a folder whose stamp matches its patch is left alone, so its files keep their
# modification times and cargo rebuilds nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo_home=${CARGO_HOME:-$HOME/.cargo}

die() { echo "patch-crates: error: $*" >&2; exit 1; }
command -v patch >/dev/null || die "the 'patch' program is required (e.g. apt-get install patch)"

# registry_source NAME VERSION -> prints the unpacked registry source folder, fetching it if needed.
registry_source() {
  local name=$1 version=$2 dir tmp
  dir=$(ls -d "$cargo_home"/registry/src/*/"$name-$version" 2>/dev/null | head -n1 || true)
  if [ -z "$dir" ]; then
    # cargo itself fetches and unpacks the crate, from a throwaway package that depends on it
    # (the workspace cannot be used: its [patch] paths do not exist yet).
    tmp=$(mktemp -d)
    mkdir -p "$tmp/src" && touch "$tmp/src/lib.rs"
    printf '[package]\nname = "fetch"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\n%s = { version = "=%s", default-features = false }\n' \
      "$name" "$version" >"$tmp/Cargo.toml"
    (cd "$tmp" && cargo fetch --quiet >&2) || die "cargo could not fetch $name $version from the crate registry"
    rm -rf "$tmp"
    dir=$(ls -d "$cargo_home"/registry/src/*/"$name-$version" 2>/dev/null | head -n1 || true)
    [ -n "$dir" ] || die "fetched $name $version but found no source under $cargo_home/registry/src"
  fi
  echo "$dir"
}

mkdir -p patched
for patch_file in patches/*.patch; do
  base=$(basename "$patch_file" .patch)   # NAME+VERSION
  name=${base%+*}
  version=${base#*+}
  dest=patched/$name-$version
  stamp=$(cat "$patch_file" "$0" | sha256sum | cut -c1-16)
  if [ -f "$dest/.spade-patch-stamp" ] && [ "$(cat "$dest/.spade-patch-stamp")" = "$stamp" ]; then
    continue
  fi
  src=$(registry_source "$name" "$version")
  rm -rf "$dest.tmp"
  cp -R "$src" "$dest.tmp"
  patch --quiet --forward --batch -p1 -d "$dest.tmp" <"$patch_file" ||
    die "$patch_file does not apply to $name $version from the registry"
  echo "$stamp" >"$dest.tmp/.spade-patch-stamp"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  echo "patch-crates: $dest ($patch_file applied)"
done
