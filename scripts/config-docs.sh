#!/usr/bin/env bash
# Keep docs/configuration.md in step with the binaries' --help.
#
#   bash scripts/config-docs.sh --write   # replace each help block in docs/configuration.md
#   bash scripts/config-docs.sh --check   # exit 1 with a diff when a block differs from --help
#
# Builds nothing: it runs the binaries already in $CARGO_TARGET_DIR/debug (default
# ~/.cache/spade/target, as scripts/quickstart.sh builds them). A help block is whatever lies between
#   <!-- BEGIN --help: NAME -->   and   <!-- END --help: NAME -->
# where NAME is spade-gateway or spade-verifier; the prose around the markers is left alone.
# The binaries run with an empty environment, so SPADE_* variables set in this shell (which clap
# would print as current values) never reach the document.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
doc=docs/configuration.md
bin_dir="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}/debug"

usage() { echo "usage: bash scripts/config-docs.sh --write|--check" >&2; exit 2; }
[ $# -eq 1 ] || usage
mode=$1
case "$mode" in --write | --check) ;; *) usage ;; esac
[ -f "$doc" ] || { echo "config-docs: $doc not found" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for name in spade-gateway spade-verifier; do
  bin="$bin_dir/$name"
  if [ ! -x "$bin" ]; then
    echo "config-docs: $bin not found; build it first (cargo build --workspace --bins, or bash scripts/quickstart.sh)" >&2
    exit 2
  fi
  grep -qxF "<!-- BEGIN --help: $name -->" "$doc" && grep -qxF "<!-- END --help: $name -->" "$doc" ||
    { echo "config-docs: $doc lacks the markers for $name" >&2; exit 2; }
  env -i PATH="$PATH" HOME="$HOME" LANG=C.UTF-8 COLUMNS=100 "$bin" --help >"$tmp/$name.help"
done

# Rebuild the document: lines outside the markers are copied, each block is replaced by the help
# text in a fenced block.
awk -v dir="$tmp" '
  match($0, /^<!-- BEGIN --help: [a-z-]+ -->$/) {
    print
    name = $0; sub(/^<!-- BEGIN --help: /, "", name); sub(/ -->$/, "", name)
    print "```text"
    file = dir "/" name ".help"
    while ((getline line < file) > 0) print line
    close(file)
    print "```"
    skipping = 1
    next
  }
  /^<!-- END --help: [a-z-]+ -->$/ { skipping = 0 }
  !skipping { print }
' "$doc" >"$tmp/configuration.md"

if [ "$mode" = "--write" ]; then
  if cmp -s "$doc" "$tmp/configuration.md"; then
    echo "config-docs: $doc already matches --help"
  else
    cp "$tmp/configuration.md" "$doc"
    echo "config-docs: $doc updated from --help"
  fi
else
  if ! diff -u --label "$doc" --label "$doc (from --help)" "$doc" "$tmp/configuration.md"; then
    echo "config-docs: $doc differs from the binaries' --help; run: bash scripts/config-docs.sh --write" >&2
    exit 1
  fi
  echo "config-docs: $doc matches --help"
fi
