#!/usr/bin/env bash
# The README's first command: fetch the models if missing, build, start spade-verifier and
# spade-gateway on loopback, and print where to point an OpenAI SDK.
#
#   bash scripts/quickstart.sh               # foreground; Ctrl-C stops both servers
#   bash scripts/quickstart.sh --background  # leave them running (logs and pids in $SPADE_RUN_DIR)
#   bash scripts/quickstart.sh --stop        # stop a background stack
#
# Environment: SPADE_STACK=qwen (default: Qwen2.5-Coder 0.5B drafts for 1.5B) or tiny (SmolLM2-135M
# for both, for a fast smoke test); SPADE_GATEWAY_PORT (8080), SPADE_VERIFIER_PORT (8081);
# SPADE_VERIFIER_API_KEY (random when unset); SPADE_RUN_DIR (~/.cache/spade/run).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
run_dir="${SPADE_RUN_DIR:-$HOME/.cache/spade/run}"
gport="${SPADE_GATEWAY_PORT:-8080}"
vport="${SPADE_VERIFIER_PORT:-8081}"
mode="${1:-}"

stop() {
  for name in gateway verifier; do
    if [ -f "$run_dir/$name.pid" ]; then
      kill "$(cat "$run_dir/$name.pid")" 2>/dev/null || true
      rm -f "$run_dir/$name.pid"
    fi
  done
}

if [ "$mode" = "--stop" ]; then
  stop
  echo "quickstart: stopped"
  exit 0
fi

case "${SPADE_STACK:-qwen}" in
  qwen)
    bash scripts/fetch-models.sh pair
    draft=models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    target=models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ;;
  tiny)
    bash scripts/fetch-models.sh tiny
    draft=models/SmolLM2-135M-Instruct-Q4_1.gguf
    target=$draft ;;
  *) echo "quickstart: SPADE_STACK must be qwen or tiny" >&2; exit 2 ;;
esac

command -v cargo >/dev/null || { echo "quickstart: cargo is required (install a Rust toolchain >= 1.90)" >&2; exit 1; }
for port in "$gport" "$vport"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "quickstart: port $port is in use (set SPADE_GATEWAY_PORT / SPADE_VERIFIER_PORT)" >&2
    exit 1
  fi
done
echo "quickstart: building (the first build compiles mistral.rs: about 20 minutes on 2 cores)"
bash scripts/patch-crates.sh
cargo build --workspace --locked --bins
bin="$CARGO_TARGET_DIR/debug"

mkdir -p "$run_dir"
export SPADE_VERIFIER_API_KEY="${SPADE_VERIFIER_API_KEY:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
"$bin/spade-verifier" --model "$target" --port "$vport" >"$run_dir/verifier.log" 2>&1 &
echo $! >"$run_dir/verifier.pid"
"$bin/spade-gateway" --draft-model "$draft" --verifier-url "http://127.0.0.1:$vport" --port "$gport" >"$run_dir/gateway.log" 2>&1 &
echo $! >"$run_dir/gateway.pid"
[ "$mode" = "--background" ] || trap 'stop; echo; echo "quickstart: stopped"' EXIT

echo "quickstart: loading models (logs in $run_dir)"
for _ in $(seq 1 600); do
  if curl -sf "http://127.0.0.1:$gport/health" >/dev/null; then
    ready=1
    break
  fi
  for name in verifier gateway; do
    if ! kill -0 "$(cat "$run_dir/$name.pid")" 2>/dev/null; then
      echo "quickstart: spade-$name exited; its log:" >&2
      tail -n 20 "$run_dir/$name.log" >&2
      exit 1
    fi
  done
  sleep 0.5
done
if [ -z "${ready:-}" ]; then
  echo "quickstart: not ready after 5 minutes; see $run_dir/*.log" >&2
  exit 1
fi

cat <<MSG

SPADE is running: draft $(basename "$draft") on the edge, verifier $(basename "$target").
Point any OpenAI SDK at  http://127.0.0.1:$gport/v1  (any api_key; model "spade").

  curl -N http://127.0.0.1:$gport/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"spade","stream":true,"messages":[{"role":"user","content":"Write a haiku about Rust."}]}'

  python3 -c 'from openai import OpenAI; c = OpenAI(base_url="http://127.0.0.1:$gport/v1", api_key="-");
print(c.chat.completions.create(model="spade", messages=[{"role": "user", "content": "Hi!"}]).choices[0].message.content)'

MSG
if [ "$mode" = "--background" ]; then
  echo "Stop with: bash scripts/quickstart.sh --stop"
else
  echo "Ctrl-C stops both servers."
  wait
fi
