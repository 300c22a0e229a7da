#!/usr/bin/env bash
# End-to-end: the quickstart stack on loopback, driven by the official `openai` Python package and
# by `curl -N`. Run by scripts/test.sh. Uses the tiny stack (SmolLM2 for both sides) to stay fast;
# SPADE_STACK=qwen runs it on the default pair. Then tool calling, which needs a chat template that
# knows tools, on the Qwen pair: the Python SDK's round trip and the `openai` npm package under node.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="${SPADE_VENV:-$HOME/.cache/spade/venv}"
if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "openai==3.57.0"
fi
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export SPADE_GATEWAY_PORT=$(free_port) SPADE_VERIFIER_PORT=$(free_port)
export SPADE_STACK="${SPADE_STACK:-tiny}" SPADE_RUN_DIR="${TMPDIR:-/tmp}/spade-sdk-e2e.$$"
trap 'bash scripts/quickstart.sh --stop >/dev/null; rm -rf "$SPADE_RUN_DIR"' EXIT
bash scripts/quickstart.sh --background >/dev/null 2>&1 || { tail -n 30 "$SPADE_RUN_DIR"/*.log >&2; exit 1; }
url="http://127.0.0.1:$SPADE_GATEWAY_PORT"

echo "sdk_e2e: openai $("$venv/bin/python" -c 'import openai; print(openai.__version__)') against $url/v1"
"$venv/bin/python" tests/openai_sdk_check.py "$url/v1" >"$SPADE_RUN_DIR/sdk.json"
echo "sdk_e2e: openai SDK: stream and non-stream parse and agree; include_usage; penalties and logit_bias; /v1/completions; n=2; /v1/models; 400 on n=0"

# curl -N: data lines must arrive over time, not all at once at the end.
body='{"model":"spade","stream":true,"temperature":0,"max_tokens":48,"messages":[{"role":"user","content":"Tell me about the sea."}]}'
curl -sN "$url/v1/chat/completions" -H 'content-type: application/json' -d "$body" |
  while IFS= read -r line; do
    if [ -n "$line" ]; then printf '%s %s\n' "$(date +%s%N)" "$line"; fi
  done >"$SPADE_RUN_DIR/curl.txt"
python3 - "$SPADE_RUN_DIR/curl.txt" <<'PY'
import json, sys
lines = [l.rstrip("\n").split(" ", 1) for l in open(sys.argv[1])]
data = [(int(t), l[len("data: "):]) for t, l in lines if l.startswith("data: ")]
assert data and data[-1][1] == "[DONE]", data[-3:]
assert sum(1 for _, d in data if d == "[DONE]") == 1
chunks = [json.loads(d) for _, d in data[:-1]]
text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
content_times = [t for (t, d), c in zip(data, chunks) if c["choices"] and c["choices"][0]["delta"].get("content")]
spread_ms = (content_times[-1] - content_times[0]) / 1e6
assert len(content_times) >= 5 and spread_ms > 50, (len(content_times), spread_ms)
print(f"sdk_e2e: curl -N: {len(content_times)} content chunks over {spread_ms:.0f} ms, [DONE] once; text {text[:60]!r}...")
PY

# Tool calling on the Qwen pair (SmolLM2's template knows no tools).
export SPADE_GATEWAY_PORT=$(free_port) SPADE_VERIFIER_PORT=$(free_port) SPADE_STACK=qwen
bash scripts/quickstart.sh --stop >/dev/null
bash scripts/quickstart.sh --background >/dev/null 2>&1 || { tail -n 30 "$SPADE_RUN_DIR"/*.log >&2; exit 1; }
url="http://127.0.0.1:$SPADE_GATEWAY_PORT"
"$venv/bin/python" tests/openai_tools_check.py "$url/v1" >"$SPADE_RUN_DIR/tools.json"
echo "sdk_e2e: openai SDK tools (Qwen pair): tool_calls -> tool message -> answer, streamed and not, equal to target-only; parallel_tool_calls; forced calls and parse(response_format=Pydantic) equal to target-only"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("sdk_e2e: parsed", json.dumps(r["parsed"]), "forced", json.dumps([v for k, v in r.items() if k.startswith("forced")]))' "$SPADE_RUN_DIR/tools.json"
# Fill-in-the-middle through the SDK's `suffix` (Qwen2.5-Coder has the FIM tokens): target-only's middle.
"$venv/bin/python" - "$url/v1" <<'PY'
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=300)
ask = dict(model="spade", prompt="def is_even(n):\n    ", suffix="\n\nprint(is_even(4))\n", max_tokens=24, temperature=0)
middle = client.completions.create(**ask).choices[0].text
target_only = client.completions.create(**ask, extra_body={"spade": {"draft_len": 0}}).choices[0].text
assert middle and middle == target_only, (middle, target_only)
print(f"sdk_e2e: openai SDK completions with suffix (fill-in-the-middle): {middle!r}, equal to target-only")
PY
node_dir="${SPADE_NODE_DIR:-$HOME/.cache/spade/node}"
if [ ! -d "$node_dir/node_modules/openai" ]; then
  mkdir -p "$node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" "openai@7.59.0" >/dev/null
fi
# ES modules resolve packages next to the script, so it runs from the folder that has them.
cp tests/openai_js_check.mjs "$node_dir/"
node "$node_dir/openai_js_check.mjs" "$url/v1" >"$SPADE_RUN_DIR/js.json"
echo "sdk_e2e: openai npm $(node -p "require('$node_dir/node_modules/openai/package.json').version") under node $(node --version): streamed completion and tool call"
