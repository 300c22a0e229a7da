#!/usr/bin/env bash
# The benchmark of issue 8: cloud calls saved, losslessness, speed, and the network's effect.
#
#   bash scripts/bench.sh [spade-bench options]      e.g. --dry-run, --quick, --draft-lens 1,2,4,6,8, --reps 5
#
# Two machines emulated on one: spade-bench pins the verifier to one core (`taskset -c`, --threads 1)
# and every gateway to another (`taskset -c`, RAYON_NUM_THREADS=1), in every mode, target-only
# included (--no-pin turns that off; without taskset or a second CPU it warns and runs unpinned). The
# link between them is spade-bench's in-process delay proxy: RTTs 0, 20, 50, 100 and 200 ms, and a
# drift case where the RTT goes from 20 to 150 ms halfway through the output. Speed is measured on the
# long prompts (>= 128 output tokens); --quick is a run of under 10 minutes.
#
# Fetches the Qwen2.5-Coder 0.5B/1.5B pair if missing, builds the workspace (dev profile: every
# dependency is optimised, see Cargo.toml), runs spade-bench (it starts spade-verifier and one
# spade-gateway per mode on loopback), and plots the results with bench/plot.py (matplotlib, put into
# a virtual environment in $SPADE_CACHE_DIR/venv if missing). Results go to bench/results/<UTC time>/
# unless --out says otherwise: results.json, results.md, plot.png and the servers' logs.
# `bash scripts/bench.sh --help` lists the options. Exits with spade-bench's status: 1 when a greedy
# speculative output differed from target-only's, 2 when the run failed.
#
# This script's own option, --compute-floor-rounds N: first run bench/compute-floor.sh with N rounds at
# one thread (our kernels against llama.cpp's; builds llama.cpp once, ~12 minutes) and give its output
# to spade-bench (--compute-floor), so the report shows it beside the verifier's pass times.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command_line="bash scripts/bench.sh $*"
args=()
floor_rounds=""
while [ $# -gt 0 ]; do
  case "$1" in
    --compute-floor-rounds) floor_rounds=${2:?--compute-floor-rounds needs a number}; shift 2 ;;
    --compute-floor-rounds=*) floor_rounds=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
cache_dir=${SPADE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
venv=$cache_dir/venv

bash scripts/fetch-models.sh pair

command -v cargo >/dev/null || { echo "bench: cargo is required (install a Rust toolchain >= 1.90)" >&2; exit 1; }
echo "bench: building (the first build compiles mistral.rs: about 20 minutes on 2 cores)"
bash scripts/patch-crates.sh
cargo build --workspace --locked --bins

# Before the long run, so a missing plotting library is found early. The plot is not worth failing
# a 25-minute benchmark over: without matplotlib the tables are still written.
plot_python=""
if [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >/dev/null 2>&1; then
  if "$venv/bin/python" -c 'import matplotlib' 2>/dev/null || "$venv/bin/python" -m pip install --quiet matplotlib; then
    plot_python=$venv/bin/python
  fi
fi
[ -n "$plot_python" ] || echo "bench: warning: no matplotlib (could not set up $venv); the plot will be skipped" >&2

if ! command -v taskset >/dev/null; then
  echo "bench: warning: no taskset (util-linux): verifier and gateway will share every core (see results.md)" >&2
elif [ "$(nproc)" -lt 2 ]; then
  echo "bench: warning: $(nproc) CPU: verifier and gateway cannot get a core each (see results.md)" >&2
fi

log=$(mktemp) floor=$(mktemp)
trap 'rm -f "$log" "$floor"' EXIT
if [ -n "$floor_rounds" ]; then
  echo "bench: the compute floor first (bench/compute-floor.sh --rounds $floor_rounds 1)"
  bash bench/compute-floor.sh --rounds "$floor_rounds" 1 | tee "$floor"
  args+=(--compute-floor "$floor")
fi
status=0
SPADE_BENCH_COMMAND="$command_line" "$CARGO_TARGET_DIR/debug/spade-bench" ${args[@]+"${args[@]}"} 2>&1 | tee "$log" || status=${PIPESTATUS[0]}

results=$(sed -n 's/^results: //p' "$log" | tail -n1)
if [ -z "$results" ] || [ ! -f "$results/results.json" ]; then
  exit "$status"
fi
if [ -n "$plot_python" ]; then
  "$plot_python" bench/plot.py "$results" || echo "bench: warning: plotting failed" >&2
fi
echo
echo "bench: results in $results (results.md, results.json, plot.png, server logs)"
exit "$status"
