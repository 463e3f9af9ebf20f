#!/usr/bin/env bash
# Every check a change must pass: formatting, lints, all tests, the embedding example.
# This is the README's test command, and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

checks=0
step() {
  checks=$((checks + 1))
  printf '\n==> %s\n' "$*"
}

# NVRTC lets the tests compile every kernel for real GPUs without one.
nvrtc_lib="$(./scripts/install-nvrtc.sh)"
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "example: embedding FulmenContext"
cargo run --locked -q -p fulmen-engine --example embed

step "benchmark smoke runs: TPC-H and SSB at SF 0.01, every engine, answers checked against DataFusion"
# DuckDB comes from PyPI into a private folder (the runner skips it, with a note, if absent).
duckdb_dir="${FULMEN_PYTHON_DIR:-$HOME/.cache/fulmen/python}"
if ! PYTHONPATH="$duckdb_dir" python3 -c 'import duckdb' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$duckdb_dir" "duckdb==2.0.1"
fi
for benchmark in tpch ssb; do
  PYTHONPATH="$duckdb_dir" cargo run --locked -q -p fulmen-benches --bin fulmen-bench -- \
    "$benchmark" --sf 0.01 --iterations 1 --output "${CARGO_TARGET_DIR:-target}/bench-smoke"
done

step "benchmark smoke run: Kafka ingest and window-close-to-alert latency (mock cluster)"
cargo run --locked -q -p fulmen-benches --bin fulmen-bench -- \
  stream --events 20000 --latency-seconds 3 --output "${CARGO_TARGET_DIR:-target}/bench-smoke"

step "kernel micro-benchmarks compile (cargo bench --no-run)"
cargo bench --locked --no-run -p fulmen-kernels

# Every step above stops the script on failure, so reaching here means all passed.
printf '\nchecks: %d passed, 0 failed\n' "$checks"
