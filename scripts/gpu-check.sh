#!/usr/bin/env bash
# GPU check: the kernel tests on a real GPU, then kernel micro-benchmarks, as one short run.
#
#   scripts/gpu-check.sh pack            on a machine with Rust: builds the release kernel test
#                                        binary and the benchmark, strips and compresses them
#                                        into target-gpu/ (carry that folder to the GPU machine)
#   scripts/gpu-check.sh run [--emulated]  on the GPU machine (no Rust, no network needed):
#                                        finds NVRTC, runs the tests with VOLLEY_TEST_DEVICE=cuda
#                                        and the benchmarks over 100M rows, prints a table.
#                                        --emulated does the same on the emulated device (a dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle="target-gpu"

pack() {
  local target="${CARGO_TARGET_DIR:-target}"
  cargo build --release --locked -p volley-kernels --bin volley-kernel-bench
  local tests
  tests=$(cargo test --release --locked -p volley-kernels --test kernels --no-run --message-format=json \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kernels":
        print(m["executable"])' | tail -n 1)
  rm -rf "$bundle" && mkdir -p "$bundle"
  cp "$tests" "$bundle/kernel-tests"
  cp "$target/release/volley-kernel-bench" "$bundle/volley-kernel-bench"
  strip "$bundle/kernel-tests" "$bundle/volley-kernel-bench"
  gzip -9 "$bundle/kernel-tests" "$bundle/volley-kernel-bench"
  ls -l "$bundle"
}

# Puts a libnvrtc.so.12 on LD_LIBRARY_PATH: the machine's CUDA, its Python packages, or any
# libnvrtc.so.* found (a newer major version is linked under the name cudarc asks for).
find_nvrtc() {
  local candidates=() d
  [ -n "${NVRTC_DIR:-}" ] && candidates+=("$NVRTC_DIR")
  candidates+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib "$HOME/.cache/volley/nvrtc/nvidia/cuda_nvrtc/lib")
  if command -v python3 >/dev/null; then
    while read -r d; do candidates+=("$d/nvidia/cuda_nvrtc/lib" "$d/nvidia/cu13/lib"); done < <(
      python3 -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  fi
  local lib=""
  for d in "${candidates[@]}"; do
    lib=$(ls "$d"/libnvrtc.so.1[0-9]* 2>/dev/null | grep -v builtins | head -n 1 || true)
    [ -n "$lib" ] && break
  done
  if [ -z "$lib" ]; then
    lib=$(find / -xdev -name 'libnvrtc.so.1[0-9]*' -not -name '*builtins*' 2>/dev/null | head -n 1 || true)
  fi
  [ -n "$lib" ] || { echo "gpu-check: NVRTC (libnvrtc.so) not found; set NVRTC_DIR" >&2; return 1; }
  local dir shim
  dir=$(dirname "$lib")
  shim=$(mktemp -d)
  ln -sf "$lib" "$shim/libnvrtc.so.12"
  export LD_LIBRARY_PATH="$shim:$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "NVRTC: $lib"
}

run() {
  local device="cuda" bench_device="cuda:0" rows="${ROWS:-100000000}"
  if [ "${1:-}" = "--emulated" ]; then device="emulated" bench_device="emulated" rows="${ROWS:-1000000}"; fi
  local work
  work=$(mktemp -d)
  for f in kernel-tests volley-kernel-bench; do
    gzip -dc "$bundle/$f.gz" > "$work/$f" && chmod +x "$work/$f"
  done
  find_nvrtc
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  export VOLLEY_KERNEL_CACHE="$work/kernel-cache"
  echo "== kernel tests on $device"
  local status=0
  VOLLEY_TEST_DEVICE=$device "$work/kernel-tests" --test-threads=1 2>&1 | tee "$work/tests.log" || status=$?
  echo "== kernel benchmarks on $bench_device"
  "$work/volley-kernel-bench" --device "$bench_device" --rows "$rows" --iterations 5 | tee "$work/bench.log" || status=$?
  echo
  echo "| check | result |"
  echo "|---|---|"
  echo "| kernel tests ($device) | $(grep -E '^test result' "$work/tests.log" | tail -n 1) |"
  grep -E '^\| (device copy|filter|gather)' "$work/bench.log" | sed 's/^| /| bench: /' || true
  return $status
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: scripts/gpu-check.sh pack | run [--emulated]" >&2; exit 2 ;;
esac
