#!/usr/bin/env bash
# The compute floor side by side with llama.cpp: the same GGUF files, the same thread count, one run.
#
#   bash bench/compute-floor.sh [--rounds N] [THREADS ...]        (default: 1 round; threads 1 2)
#
# For each thread count, llama.cpp's llama-bench (prompt processing and token generation, 3
# repetitions) and ours: the draft model through mistral.rs (engine/examples/draft_speed: a 512-token
# prompt, decode inside a block, a d = 4 round) and the target through our scorer
# (engine/examples/scorer_speed: single-step decode, a 5-position verify block). One thread runs
# pinned to CPU 1 (`taskset`), as the two-machine emulation does; more run unpinned.
#
# This host's speed wanders by ±15% over minutes, so each round runs llama.cpp and ours back to back
# and the ratios are taken per round; with --rounds N the summary gives each ratio's median over the
# rounds (and its range). A ratio > 1 means ours is faster for rates, slower for the block's time.
# llama.cpp is built by bench/llama-cpp.sh (about 12 minutes on 2 cores, once).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
models=${SPADE_MODELS_DIR:-$root/models}
draft=$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
target=$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
rounds=1
if [ "${1:-}" = --rounds ]; then
  rounds=$2
  shift 2
fi
threads=("$@")
[ ${#threads[@]} -gt 0 ] || threads=(1 2)

bin=$(bash bench/llama-cpp.sh --build-only | tail -n1)
bash scripts/patch-crates.sh
cargo build --locked --workspace --examples
examples=$CARGO_TARGET_DIR/debug/examples
ratios=$(mktemp)
trap 'rm -f "$ratios"' EXIT

# llama_ts CSV N_PROMPT N_GEN -> llama-bench's mean tokens/s for that test.
llama_ts() {
  awk -v p="$2" -v g="$3" 'NR == 1 { n = split($0, h, ","); for (i = 1; i <= n; i++) col[h[i]] = i; next }
    { gsub(/^"|"$/, ""); split($0, f, "\",\"") }
    f[col["n_prompt"]] == p && f[col["n_gen"]] == g { print f[col["avg_ts"]] }' "$1"
}
# field TEXT REGEX -> the first number after REGEX in TEXT.
field() { grep -oE "$2 [0-9.]+" <<<"$1" | head -n1 | grep -oE '[0-9.]+$'; }

for round in $(seq "$rounds"); do
  for t in "${threads[@]}"; do
    pin=()
    [ "$t" = 1 ] && command -v taskset >/dev/null && pin=(taskset -c 1)
    echo "## round $round/$rounds, $t thread(s) ${pin[*]:+(pinned: ${pin[*]})}"
    echo
    draft_csv=$(mktemp) target_csv=$(mktemp)
    "${pin[@]}" "$bin/llama-bench" -m "$draft" -p 512 -n 64 -t "$t" -r 3 --poll 0 -o csv 2>/dev/null >"$draft_csv"
    "${pin[@]}" "$bin/llama-bench" -m "$target" -p 5 -n 64 -t "$t" -r 3 --poll 0 -o csv 2>/dev/null >"$target_csv"
    l_pp512=$(llama_ts "$draft_csv" 512 0) l_dtg=$(llama_ts "$draft_csv" 0 64)
    l_pp5=$(llama_ts "$target_csv" 5 0) l_ttg=$(llama_ts "$target_csv" 0 64)
    rm -f "$draft_csv" "$target_csv"
    ours_draft=$(RAYON_NUM_THREADS=$t "${pin[@]}" "$examples/draft_speed" "$draft" 2>/dev/null)
    ours_target=$(RAYON_NUM_THREADS=$t "${pin[@]}" "$examples/scorer_speed" "$target" 1x1 2>/dev/null | sed -n 1p)
    echo "llama.cpp (llama-bench, -r 3): 0.5B pp512 $l_pp512 tok/s, tg64 $l_dtg tok/s; 1.5B pp5 $l_pp5 tok/s, tg64 $l_ttg tok/s"
    echo "ours:"
    echo "$ours_draft"
    echo "$ours_target"
    o_pp512=$(field "$ours_draft" "prompt 512 tokens") o_dtg=$(field "$ours_draft" "^decode")
    o_ttg=$(field "$ours_target" "decode") o_block=$(field "$ours_target" "5-position block")
    awk -v t="$t" -v a="$o_dtg" -v b="$l_dtg" -v c="$o_pp512" -v d="$l_pp512" -v e="$o_block" -v f="$l_pp5" \
      -v g="$o_ttg" -v h="$l_ttg" 'BEGIN {
        printf "%s 0.5B-decode %.3f\n%s 0.5B-prompt512 %.3f\n%s 1.5B-block5-time %.3f\n%s 1.5B-decode %.3f\n",
          t, a / b, t, c / d, t, e / (5000 / f), t, g / h }' | tee -a "$ratios" |
      awk '{ printf "ratio (ours / llama.cpp), %s thread(s): %s %.2fx\n", $1, $2, $3 }'
    echo
  done
done

echo "## summary: median ratio over $rounds round(s) [min, max]"
sort -k1,1n -k2,2 -k3,3g "$ratios" | awk '
  { key = $1 " thread(s) " $2; v[key, ++n[key]] = $3; if (!(key in seen)) { seen[key] = 1; order[++k] = key } }
  END { for (i = 1; i <= k; i++) { key = order[i]; c = n[key]
          med = (c % 2) ? v[key, (c + 1) / 2] : (v[key, c / 2] + v[key, c / 2 + 1]) / 2
          printf "%-36s %.2fx [%.2f, %.2f]\n", key, med, v[key, 1], v[key, c] } }'
