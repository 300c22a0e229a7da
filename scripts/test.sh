#!/usr/bin/env bash
# The project's test command (README "Tests"; .ci/run calls it): fetch the real test models if they
# are missing, then run every test of the workspace against them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# The same target folder as scripts/quickstart.sh: after it, the tests compile only what they add.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/spade/target}"
bash scripts/fetch-models.sh all
bash scripts/patch-crates.sh
# Real-model tests are CPU-heavy; two at a time keeps a 2-core machine responsive.
cargo test --workspace --locked -- --test-threads "${SPADE_TEST_THREADS:-2}" "$@"
# The quickstart stack driven by the official openai package and curl -N.
bash tests/sdk_e2e.sh
