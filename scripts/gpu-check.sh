#!/usr/bin/env bash
# GPU check: one prepared run, under 10 minutes, of everything a lent GPU can tell us.
#
#   scripts/gpu-check.sh pack          on a machine with Rust: release-builds the test binaries
#                                      (kernels, the engine's GPU tests, the DataFusion suite),
#                                      fulmen-kernel-bench and fulmen-bench, with the kernels
#                                      built ahead for sm_80/sm_90 (NVRTC at build time), and
#                                      strips and compresses them, DataFusion's test files and
#                                      the stand-in driver into target-gpu/ (carry that folder)
#   scripts/gpu-check.sh run           on the GPU machine (no Rust, no network, no NVRTC
#                                      needed), each step under a time cap:
#                                        1. kernel tests on cuda:0
#                                        2. the engine's GPU tests on cuda:0 and cuda:0,1
#                                        3. TPC-H SF 1 with the GPU forced on cuda:0, answers
#                                           checked against DataFusion
#                                        4. kernel micro-benchmarks over 100M rows
#                                        5. TPC-H SF 10: fulmen-gpu (auto) against DataFusion
#                                        6. DataFusion's sqllogictest suite, GPU forced on cuda:0
#                                      and ends in a table (also written to $OUT or target-gpu/).
#   scripts/gpu-check.sh run --standin the same through the stand-in CUDA driver, at small
#                                      sizes: the dry run that must pass before a GPU is used.
#
# Sizes and caps: ROWS, SF_FORCED, SF, DF_SLT_LIMIT; CAP_SCALE (an integer) multiplies every
# time cap. The caps add up to 9 minutes on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle="target-gpu"

pack() {
  local target="${CARGO_TARGET_DIR:-target}"
  # NVRTC where the build finds it, so that the kernels are embedded (gpu-kernels/build.rs).
  ./scripts/install-nvrtc.sh >/dev/null
  # Every build names the whole workspace, and the binaries are built with the examples
  # (which, like tests, see dev-dependencies), so that features resolve once for tests and
  # binaries alike and DataFusion is built once.
  local tests
  tests=$(cargo test --release --locked --workspace --lib --test kernels --test datafusion_slt \
    --no-run --message-format=json | python3 -c 'import json, sys
want = {"kernels": "kernel-tests", "fulmen_engine": "engine-tests", "datafusion_slt": "datafusion-slt"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        print(want[m["target"]["name"]], m["executable"])')
  cargo build --release --locked --workspace --lib --bins --examples
  rm -rf "$bundle" && mkdir -p "$bundle/standin"
  local name path
  while read -r name path; do
    cp "$path" "$bundle/$name"
  done <<<"$tests"
  for name in kernel-tests engine-tests datafusion-slt; do
    [ -f "$bundle/$name" ] || { echo "gpu-check pack: no $name binary was built" >&2; exit 1; }
  done
  cp "$target/release/fulmen-kernel-bench" "$target/release/fulmen-bench" "$bundle/"
  cp "$target/release/libfulmen_cuda_standin.so" "$bundle/standin/libcuda.so"
  local suite
  suite=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/datafusion-sqllogictest-55.2.0 | head -n 1)
  tar czf "$bundle/datafusion-slt-files.tar.gz" -C "$suite" test_files data
  local binaries=(kernel-tests engine-tests datafusion-slt fulmen-kernel-bench fulmen-bench standin/libcuda.so)
  # LEAVE_OUT="datafusion-slt …" leaves binaries out (run reports their steps as not in the
  # bundle): a device run carries at most 64 MiB.
  local kept=() name
  for name in "${binaries[@]}"; do
    if [[ " ${LEAVE_OUT:-} " == *" $name "* ]]; then rm -f "$bundle/$name"; else kept+=("$name"); fi
  done
  # xz halves what gzip leaves of these binaries; run unpacks either.
  (cd "$bundle" && strip "${kept[@]}" && if command -v xz >/dev/null; then xz -9 -T0 "${kept[@]}"; else gzip -9 "${kept[@]}"; fi)
  ls -l "$bundle" "$bundle/standin"
  local kib
  kib=$(du -sk --exclude=standin "$bundle" | cut -f1)
  echo "bundle: $((kib / 1024)) MiB without the stand-in (a device run carries at most 64 MiB)"
  if [ "$kib" -gt $((64 * 1024)) ]; then
    echo "gpu-check pack: WARNING: over 64 MiB; leave something out, e.g. LEAVE_OUT=datafusion-slt" >&2
  fi
}

# unpack NAME DEST: the bundle's NAME (.xz or .gz) decompressed to DEST; false if absent.
unpack() {
  if [ -f "$bundle/$1.xz" ]; then
    if command -v xz >/dev/null; then
      xz -dc "$bundle/$1.xz" >"$2"
    else
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$bundle/$1.xz" "$2"
    fi
  elif [ -f "$bundle/$1.gz" ]; then
    gzip -dc "$bundle/$1.gz" >"$2"
  else
    return 1
  fi
  chmod +x "$2"
}

results=()
status=0
# step NAME CAP_SECONDS LOG COMMAND...: runs COMMAND under the cap, logging to LOG.
step() {
  local name="$1" cap="$2" log="$3"
  shift 3
  cap=$((cap * ${CAP_SCALE:-1}))
  echo
  echo "== $name (cap ${cap}s)"
  # The program: the first word that is not `env` or a VAR=value.
  local program="" word
  for word in "$@"; do
    if [ "$word" != env ] && [[ "$word" != *=* ]]; then program="$word" && break; fi
  done
  if [ ! -x "$program" ]; then
    echo "== $name: not in the bundle"
    results+=("| $name | not in the bundle | — |")
    return 0
  fi
  local started=$SECONDS rc=0
  # Through the stand-in, each step's driver calls are written beside its log.
  if [ -n "${STANDIN:-}" ]; then export FULMEN_STANDIN_COUNTS="${log%.log}-counts.json"; fi
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  local took=$((SECONDS - started)) outcome
  case $rc in
    0) outcome="passed" ;;
    124 | 137) outcome="TIMED OUT after ${cap}s" ;;
    *) outcome="FAILED (exit $rc)" ;;
  esac
  [ "$rc" = 0 ] || status=1
  results+=("| $name | $outcome | ${took}s |")
}

run() {
  local mode="gpu"
  if [ "${1:-}" = "--standin" ]; then
    mode="standin"
  elif [ -n "${1:-}" ]; then
    echo "usage: scripts/gpu-check.sh run [--standin]" >&2
    exit 2
  fi
  local rows="${ROWS:-100000000}" sf_forced="${SF_FORCED:-1}" sf="${SF:-10}"
  local df_limit="${DF_SLT_LIMIT:-}"
  local work
  work=$(mktemp -d)
  for f in kernel-tests engine-tests datafusion-slt fulmen-kernel-bench fulmen-bench; do
    unpack "$f" "$work/$f" || echo "gpu-check: $f is not in the bundle"
  done
  mkdir -p "$work/suite" && tar xzf "$bundle/datafusion-slt-files.tar.gz" -C "$work/suite"
  if [ "$mode" = standin ]; then
    # The stand-in driver plays the GPUs; small sizes, since its kernels run on the CPU.
    rows="${ROWS:-1000000}" sf_forced="${SF_FORCED:-0.01}" sf="${SF:-0.01}" df_limit="${DF_SLT_LIMIT:-25}"
    CAP_SCALE="${CAP_SCALE:-4}"
    mkdir -p "$work/driver" && unpack standin/libcuda.so "$work/driver/libcuda.so"
    export LD_LIBRARY_PATH="$work/driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    STANDIN=1
    echo "gpu-check: through the stand-in CUDA driver ($work/driver/libcuda.so)"
  fi
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  fi
  # The kernels are built ahead (sm_80, sm_90, PTX): NVRTC is not needed. The kernel tests'
  # NVRTC checks ran where the bundle was built.
  export FULMEN_SKIP_NVRTC=1
  export FULMEN_KERNEL_CACHE="$work/kernel-cache"
  export FULMEN_TEST_DEVICE=cuda
  local started=$SECONDS

  step "kernel tests (cuda:0)" 45 "$work/kernels.log" \
    "$work/kernel-tests" --test-threads=4
  step "engine GPU tests (cuda:0, and cuda:0,1 where there are two)" 90 "$work/engine.log" \
    "$work/engine-tests" gpu::tests
  step "TPC-H SF $sf_forced, GPU forced on cuda:0, answers = DataFusion's" 75 "$work/forced.log" \
    env FULMEN_DEVICES=cuda:0 "$work/fulmen-bench" tpch --sf "$sf_forced" \
    --engines fulmen-gpu,datafusion --gpu-mode force --iterations 1 \
    --data-dir "$work/data" --output "$work/tpch-forced"
  step "kernel micro-benchmarks, $rows rows (cuda:0)" 60 "$work/bench.log" \
    "$work/fulmen-kernel-bench" --device cuda:0 --rows "$rows" --iterations 5
  step "TPC-H SF $sf: fulmen-gpu (auto) against DataFusion" 180 "$work/tpch.log" \
    env FULMEN_DEVICES=auto "$work/fulmen-bench" tpch --sf "$sf" \
    --engines fulmen-gpu,datafusion --iterations 1 --data-dir "$work/data" --output "$work/tpch"
  step "DataFusion sqllogictest suite, GPU forced on cuda:0${df_limit:+ (first $df_limit files)}" \
    100 "$work/dfslt.log" \
    env FULMEN_DF_SLT_DIR="$work/suite" FULMEN_DF_SLT_WORK="$work" \
    ${df_limit:+FULMEN_DF_SLT_LIMIT=$df_limit} "$work/datafusion-slt"

  local table="$work/gpu-check.md"
  {
    echo "## gpu-check ($mode), $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - started)) s"
    echo
    echo "| step | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${results[@]}"
    echo
    echo "| figure | value |"
    echo "|---|---|"
    grep -hE '^test result' "$work/kernels.log" "$work/engine.log" | sed 's/^/| tests | /; s/$/ |/' || true
    grep -E '^\| (device copy|filter|gather)' "$work/bench.log" | sed 's/^| /| bench: /' || true
    grep -E '^\| \*\*geometric mean' "$work/tpch.log" | sed "s/^| /| TPC-H SF $sf (datafusion, fulmen-gpu): /" || true
    grep -E 'passed|regression' "$work/dfslt.log" | tail -n 2 | sed 's/^/| DataFusion suite | /; s/$/ |/' || true
    for counts in "$work"/*-counts.json; do
      if [ -f "$counts" ]; then
        echo "| stand-in driver calls, $(basename "$counts" -counts.json) | $(tr -d '\n' <"$counts") |"
      fi
    done
  } >"$table"
  echo
  cat "$table"
  local out="${OUT:-$bundle}"
  mkdir -p "$out" && cp "$table" "$work"/*.log "$out/" 2>/dev/null || true
  if [ -d "$work/tpch" ]; then cp -r "$work/tpch" "$out/" 2>/dev/null || true; fi
  return $status
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: scripts/gpu-check.sh pack | run [--standin]" >&2; exit 2 ;;
esac
