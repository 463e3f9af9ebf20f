#!/usr/bin/env bash
# Every check a change must pass: formatting, lints, all tests, the embedding example.
# This is the README's test command, and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# NVRTC lets the tests compile every kernel for real GPUs without one.
nvrtc_lib="$(./scripts/install-nvrtc.sh)"
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "example: embedding VolleyContext"
cargo run --locked -q -p volley-engine --example embed
