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

# Binaries and examples are built for the whole workspace at once, as the tests were: a
# `cargo run -p NAME` resolves features for that package alone and rebuilds DataFusion.
target="${CARGO_TARGET_DIR:-target}"
# `--lib` makes the stand-in driver's .so (a cdylib: `cargo test` does not build it).
cargo build --workspace --lib --bins --examples --locked -q
bin="$target/debug"

step "example: embedding FulmenContext"
"$bin/examples/embed"

step "the CUDA backend through the stand-in driver: kernel tests on cuda:0, the engine's GPU tests and TPC-H on cuda:0 and cuda:0,1, a sticky fault mid-query, kernels built ahead without NVRTC"
standin="$target/standin"
rm -rf "$standin" && mkdir -p "$standin" && cp "$bin/libfulmen_cuda_standin.so" "$standin/libcuda.so"
through_standin() {
  LD_LIBRARY_PATH="$standin:$LD_LIBRARY_PATH" FULMEN_TEST_DEVICE=cuda "$@"
}
through_standin cargo test --workspace --locked -q --test kernels
FULMEN_STANDIN_COUNTS="$standin/engine-counts.json" through_standin \
  cargo test --workspace --locked --lib -- gpu::tests
echo "stand-in driver calls during the engine's GPU tests: $(cat "$standin/engine-counts.json")"
# TPC-H Q1 forced on cuda:0 (10 launches, its aggregation in one stage) with its 6th launch
# faulting when it runs: the answer is DataFusion's, the fault is found by the wait that ran
# it (launches queued before that wait were accepted, as a GPU accepts them), and the device
# is quarantined after it.
q1="$(cat engine/src/tpch_queries/q01.sql)"
fulmen=("$bin/fulmen" --demo 0.01 -q --format csv)
want="$("${fulmen[@]}" --devices none -c "$q1")"
got="$(FULMEN_STANDIN_STICKY_LAUNCH=6 FULMEN_STANDIN_COUNTS="$standin/sticky-counts.json" \
  through_standin "${fulmen[@]}" --devices cuda:0 -c "SET fulmen.gpu.mode = 'force'" -c "$q1" \
  2>"$standin/sticky.log")" || { cat "$standin/sticky.log"; exit 1; }
if [ "$got" != "$want" ]; then
  printf 'sticky fault: wrong answer\n--- want\n%s\n--- got\n%s\n' "$want" "$got"
  exit 1
fi
if ! python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); sys.exit(not (c["launches"] >= 6 and c["sticky_errors"] == 1))' \
  "$standin/sticky-counts.json" || ! grep -q 'context poisoned (CUDA_ERROR_ILLEGAL_ADDRESS): launch 6 ' "$standin/sticky.log"; then
  echo "sticky fault: expected launch 6 to poison the context, once"
  cat "$standin/sticky-counts.json" "$standin/sticky.log"
  exit 1
fi
echo "sticky fault at launch 6 of TPC-H Q1: DataFusion's answer, found by the next wait ($(cat "$standin/sticky-counts.json"))"
# No NVRTC at run time (only the stand-in on the library path, an empty kernel cache): a
# compute 9.0 GPU loads the sm_90 cubins built ahead, a compute 8.6 one the sm_80 cubins,
# and a compute 12.0 one (no cubin built for it) the PTX, which its driver compiles. Each
# run ends with Fulmen's own count of its device work (fulmen_devices()), which must equal
# the calls the driver received; and TPC-H Q1 forced on the emulated device counts the same
# launches, syncs and copies as through the CUDA backend.
counted="launches, syncs, stream_waits, h2d_copies, h2d_bytes, d2h_copies, d2h_bytes, d2d_copies, d2d_bytes, driver_allocations"
listing="SELECT $counted FROM fulmen_devices()"
emulated="$("${fulmen[@]}" --devices emulated:1 -c "SET fulmen.gpu.mode = 'force'" \
  -c "SET fulmen.gpu.on_error = 'fail'" -c "$q1" -c "$listing" | tail -n 1)"
for compute in 9.0:0 8.6:0 12.0:all; do
  cc="${compute%%:*}" ptx="${compute##*:}"
  counts="$standin/no-nvrtc-$cc.json"
  got="$(FULMEN_STANDIN_COMPUTE=$cc FULMEN_KERNEL_CACHE="$standin/empty-cache-$cc" \
    FULMEN_STANDIN_COUNTS="$counts" LD_LIBRARY_PATH="$standin" "${fulmen[@]}" --devices cuda:0 \
    -c "SET fulmen.gpu.mode = 'force'" -c "SET fulmen.gpu.on_error = 'fail'" -c "$q1" \
    -c "$listing" 2>"$standin/no-nvrtc.log")" || { cat "$standin/no-nvrtc.log"; exit 1; }
  # The last two lines are the device listing's header and row.
  mine="$(tail -n 1 <<<"$got")"
  got="$(head -n -2 <<<"$got")"
  if [ "$got" != "$want" ]; then
    printf 'compute %s without NVRTC: wrong answer\n--- want\n%s\n--- got\n%s\n' "$cc" "$want" "$got"
    exit 1
  fi
  python3 - "$counts" "$ptx" "$counted" "$mine" "$emulated" <<'PY'
import json, sys
driver, ptx = json.load(open(sys.argv[1])), sys.argv[2]
names = [n.strip() for n in sys.argv[3].split(",")]
mine = dict(zip(names, map(int, sys.argv[4].split(","))))
emulated = dict(zip(names, map(int, sys.argv[5].split(","))))
expected = driver["modules"] if ptx == "all" else 0
assert driver["launches"] > 0 and driver["modules"] > 0, driver
assert driver["ptx_modules"] == expected, f"expected {expected} PTX modules: {driver}"
theirs = {"syncs": "stream_syncs", "driver_allocations": "allocations"}
for name in names:
    assert mine[name] == driver[theirs.get(name, name)], \
        f"{name}: Fulmen counted {mine[name]}, the driver {driver}"
# Pool reuse (so driver allocations) depends on how partitions interleave; the work does not.
for name in names[:-1]:
    assert mine[name] == emulated[name], f"{name}: {mine[name]} through CUDA, {emulated[name]} emulated"
PY
done
echo "without NVRTC: TPC-H Q1 right on compute 9.0 and 8.6 (cubins built ahead) and 12.0 (PTX); Fulmen's counts of launches, syncs, stream waits, copies, bytes and allocations equal the driver's, and the emulated device's"

step "benchmark smoke runs: TPC-H and SSB at SF 0.01, every engine, answers checked against DataFusion; TPC-H and SSB over cached tables; TPC-H on a local cluster"
# DuckDB comes from PyPI into a private folder (the runner skips it, with a note, if absent).
duckdb_dir="${FULMEN_PYTHON_DIR:-$HOME/.cache/fulmen/python}"
if ! PYTHONPATH="$duckdb_dir" python3 -c 'import duckdb' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$duckdb_dir" "duckdb==2.0.1"
fi
for benchmark in tpch ssb; do
  PYTHONPATH="$duckdb_dir" "$bin/fulmen-bench" \
    "$benchmark" --sf 0.01 --iterations 1 --output "$target/bench-smoke"
done
# Every table cached on two emulated devices, the GPU forced: the answers are DataFusion's.
for benchmark in tpch ssb; do
  FULMEN_DEVICES=emulated:2 "$bin/fulmen-bench" "$benchmark" --sf 0.01 --iterations 1 \
    --engines fulmen-gpu --gpu-mode force --resident --output "$target/bench-smoke/resident"
done
# A local Ballista cluster of two executors (the fulmen binary beside fulmen-bench), each on
# its own emulated device, the GPU forced: the answers are DataFusion's.
FULMEN_DEVICES=emulated:1 "$bin/fulmen-bench" tpch --sf 0.01 --iterations 1 --engines fulmen-gpu \
  --gpu-mode force --cluster 2 --output "$target/bench-smoke/cluster"

step "benchmark smoke run: Kafka ingest, window-close-to-alert latency, the fraud pipeline end to end (mock cluster)"
"$bin/fulmen-bench" stream --events 20000 --latency-seconds 3 --fraud-cards 300 --fraud-minutes 90 \
  --output "$target/bench-smoke"

step "kernel micro-benchmarks compile (cargo bench --no-run)"
cargo bench --locked --no-run -p fulmen-kernels

# Every step above stops the script on failure, so reaching here means all passed.
printf '\nchecks: %d passed, 0 failed\n' "$checks"
