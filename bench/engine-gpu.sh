#!/usr/bin/env bash
# spade-verifier --engine over vLLM on an NVIDIA GPU: speed against vLLM target-only.
#
#   bash bench/engine-gpu.sh [7b|1.5b] [RTT_MS…]      (default 7b, RTTs 0 50 100)
#
# Needs a GPU machine with network access to the Python package registry and Hugging Face: installs
# vLLM (pip, into $SPADE_CACHE_DIR/vllm-gpu-venv), serves Qwen/Qwen2.5-Coder-{7B,1.5B}-Instruct (HF
# weights, bf16, prefix caching), puts spade-verifier --engine --engine-kind vllm (parallel calls) in
# front, and runs bench/engine-bench.py's modes against it: a gateway drafting with Qwen2.5-Coder-0.5B
# (GGUF, on the CPU) at each RTT, target-only through the same gateway (--draft-len 0) beside it.
# Prints tokens/s, the ratio, and vLLM's GPU busy time per committed token (nvidia-smi).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
size=${1:-7b}
shift || true
rtts=${*:-0 50 100}
case $size in
  7b) model=Qwen/Qwen2.5-Coder-7B-Instruct ;;
  1.5b) model=Qwen/Qwen2.5-Coder-1.5B-Instruct ;;
  *) echo "usage: $0 [7b|1.5b] [RTT_MS…]" >&2; exit 2 ;;
esac
command -v nvidia-smi >/dev/null || { echo "engine-gpu: no NVIDIA GPU here (nvidia-smi missing)" >&2; exit 1; }
cache=${SPADE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
venv=$cache/vllm-gpu-venv
[ -x "$venv/bin/vllm" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet vllm; }
bin=${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}/release
[ -x "$bin/spade-verifier" ] || (cd "$root" && bash scripts/patch-crates.sh && cargo build --release --locked)
bash "$root/scripts/fetch-models.sh" pair
draft=$root/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
out=$root/bench/results/engine-gpu-$size-$(date +%Y%m%d-%H%M)
mkdir -p "$out"
"$venv/bin/vllm" serve "$model" --served-model-name target --port 18000 --enable-prefix-caching \
  --max-model-len 8192 >"$out/vllm.log" 2>&1 &
pids=($!)
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
until curl -fsS http://127.0.0.1:18000/health >/dev/null 2>&1; do sleep 2; done
"$bin/spade-verifier" --engine http://127.0.0.1:18000 --engine-kind vllm --engine-model target \
  --engine-calls parallel --model "$draft" --port 18081 >"$out/verifier.log" 2>&1 &
pids+=($!)
until curl -fsS http://127.0.0.1:18081/health/ready >/dev/null 2>&1; do sleep 1; done
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 200 >"$out/gpu.csv" &
pids+=($!)
python3 - "$out" "$draft" "$bin" $rtts <<'PY'
import json, subprocess, sys, time, urllib.request
out, draft, bin_dir, rtts = sys.argv[1], sys.argv[2], sys.argv[3], [int(r) for r in sys.argv[4:]]
prompts = [json.loads(l) for l in open(f"{out}/../../prompts.jsonl")][:8]
def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.monotonic(); answer = json.load(urllib.request.urlopen(req, timeout=600)); return answer, time.monotonic() - t
rows = []
for rtt in rtts:
    procs, ports = [], {}
    for i, (mode, flags) in enumerate((("target-only", ["--draft-len", "0"]), ("match", ["--draft-len", "auto"]))):
        proxy, port = 19000 + 10 * rtt + i, 18100 + 10 * rtt + i
        procs.append(subprocess.Popen([f"{bin_dir}/spade-delay-proxy", "--listen", f"127.0.0.1:{proxy}", "--upstream", "127.0.0.1:18081", "--rtt-ms", str(rtt)]))
        procs.append(subprocess.Popen([f"{bin_dir}/spade-gateway", "--draft-model", draft, "--verifier-url", f"http://127.0.0.1:{proxy}", "--port", str(port), *flags]))
        ports[mode] = port
    for port in ports.values():
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready").status == 200: break
            except Exception: time.sleep(1)
    for p in prompts:
        for mode, port in ports.items():
            answer, secs = post(port, {"messages": p["messages"], "max_tokens": 128, "temperature": 0})
            rows.append({"rtt": rtt, "mode": mode, "id": p["id"], "seconds": secs, "tokens": answer["usage"]["completion_tokens"],
                         "text": answer["choices"][0]["message"]["content"], "calls": answer["usage"]["spade"]["verify_calls"]})
    for p in procs: p.terminate()
json.dump(rows, open(f"{out}/results.json", "w"), indent=1)
for rtt in rtts:
    r = {m: [x for x in rows if x["rtt"] == rtt and x["mode"] == m] for m in ("target-only", "match")}
    tps = {m: sum(x["tokens"] for x in v) / sum(x["seconds"] for x in v) for m, v in r.items()}
    same = sum(a["text"] == b["text"] for a, b in zip(r["match"], r["target-only"]))
    print(f"RTT {rtt} ms: target-only {tps['target-only']:.1f} tok/s, match {tps['match']:.1f} tok/s, "
          f"{tps['match'] / tps['target-only']:.2f}x, identical {same}/{len(r['match'])}")
PY
echo "engine-gpu: GPU utilisation samples in $out/gpu.csv, results in $out/results.json"
