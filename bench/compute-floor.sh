#!/usr/bin/env bash
# The compute floor side by side with llama.cpp: the same GGUF files, the same thread count, one run.
#
#   bash bench/compute-floor.sh [THREADS ...]        (default: 1 2)
#
# For each thread count, llama.cpp's llama-bench (prompt processing and token generation, 3
# repetitions) and ours: the draft model through mistral.rs (engine/examples/draft_speed: a 512-token
# prompt, decode inside a block, a d = 4 round) and the target through our scorer
# (engine/examples/scorer_speed: single-step decode, a 5-position verify block). One thread runs
# pinned to CPU 1 (`taskset`), as the two-machine emulation does; more run unpinned.
# llama.cpp is built by bench/llama-cpp.sh (about 12 minutes on 2 cores, once).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
models=${SPADE_MODELS_DIR:-$root/models}
draft=$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
target=$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
threads=("$@")
[ ${#threads[@]} -gt 0 ] || threads=(1 2)

bin=$(bash bench/llama-cpp.sh --build-only | tail -n1)
bash scripts/patch-crates.sh
cargo build --locked --workspace --examples
examples=$CARGO_TARGET_DIR/debug/examples

for t in "${threads[@]}"; do
  pin=()
  [ "$t" = 1 ] && command -v taskset >/dev/null && pin=(taskset -c 1)
  echo "## $t thread(s) ${pin[*]:+(pinned: ${pin[*]})}"
  echo
  echo "llama.cpp (llama-bench, -r 3):"
  "${pin[@]}" "$bin/llama-bench" -m "$draft" -p 512 -n 64 -t "$t" -r 3 --poll 0 -o md 2>/dev/null | grep -E '^\|'
  "${pin[@]}" "$bin/llama-bench" -m "$target" -p 5 -n 64 -t "$t" -r 3 --poll 0 -o md 2>/dev/null | grep -E '^\|' | tail -n +3
  echo
  echo "ours:"
  RAYON_NUM_THREADS=$t "${pin[@]}" "$examples/draft_speed" "$draft" 2>/dev/null
  RAYON_NUM_THREADS=$t "${pin[@]}" "$examples/scorer_speed" "$target" 1x1 2>/dev/null | sed -n 1p
  echo
done
