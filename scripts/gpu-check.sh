#!/usr/bin/env bash
# The project's GPU check, in two halves:
#
#   bash scripts/gpu-check.sh build   # here (build machine, no GPU): build and bundle
#   bash scripts/gpu-check.sh run     # on the two-GPU machine: run everything, logs to $OUT
#
# `build` puts stripped release binaries of the GPU tests, the GPU benchmark and the
# example, plus shared/anchors (the raw-NCCL anchor benchmark), into gpu-bundle/ (git
# ignores it). Ship that folder to the GPU machine and run `run` there from the repo
# root; it writes at most 8 log files into $OUT (default ./gpu-out).
#
# Sections of `run` (default all): tests paths bench example anchor
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-bundle

# Copies the executables of the named targets, read from cargo's JSON messages on
# stdin, into the bundle.
copy_executables() {
  python3 -c '
import json, sys
names = sys.argv[1:]
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    exe = m.get("executable")
    if exe and m.get("target", {}).get("name") in names:
        print(m["target"]["name"], exe)
' "$@" | while read -r name exe; do cp "$exe" "$BUNDLE/bin/$name"; done
}

build() {
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin"
  # Test executables: cargo lists them in the "executable" fields.
  cargo test --release --no-run --message-format=json --test gpu --test gpu_paths 2>/dev/null |
    copy_executables gpu gpu_paths
  local example=()
  [ -f examples/fsdp_step.rs ] && example=(--example fsdp_step)
  cargo build --release --bench gpu_collectives "${example[@]}" --message-format=json 2>/dev/null |
    copy_executables gpu_collectives fsdp_step
  strip "$BUNDLE"/bin/*
  local anchors="${ANCHORS:-../shared/anchors}"
  mkdir -p "$BUNDLE/anchors" && cp "$anchors"/* "$BUNDLE/anchors/"
  ls -la "$BUNDLE/bin"
  du -sh "$BUNDLE"
}

run() {
  local out="${OUT:-./gpu-out}"
  mkdir -p "$out"
  local want=("$@")
  [ ${#want[@]} -eq 0 ] && want=(tests paths bench example anchor)
  has() { local x; for x in "${want[@]}"; do [ "$x" = "$1" ] && return 0; done; return 1; }
  # Keep NVLink multicast off (it can take a shared host down).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  local bin="$BUNDLE/bin"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m || true
    ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null || true
  } > "$out/machine.txt" 2>&1
  local status=0
  if has tests; then
    "$bin/gpu" --test-threads=1 --nocapture > "$out/tests.log" 2>&1 || status=1
    tail -n 5 "$out/tests.log"
  fi
  if has paths; then
    rm -f "$out/nccl-debug.log"
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING NCCL_DEBUG_FILE="$out/nccl-debug.log" \
      "$bin/gpu_paths" --test-threads=1 --nocapture > "$out/paths.log" 2>&1 || status=1
    tail -n 5 "$out/paths.log"
  fi
  if has bench; then
    "$bin/gpu_collectives" ${BENCH_SECTIONS:-} > "$out/bench.log" 2>&1 || status=1
    cat "$out/bench.log"
  fi
  if has example; then
    # The default GPU configuration, the balanced one the step-time floor uses
    # (communication about equal to computation), and a compute-heavier one.
    { "$bin/fsdp_step" --compare && echo && "$bin/fsdp_step" --balanced --compare \
        && echo && "$bin/fsdp_step" --balanced --batch 2048 --compare; } \
      > "$out/example.log" 2>&1 || status=1
    grep -A7 '^summary' "$out/example.log" || tail -n 20 "$out/example.log"
  fi
  if has anchor; then
    bash "$BUNDLE/anchors/run_anchor.sh" ${ANCHOR_SECTIONS:-} > "$out/anchor.log" 2>&1 || status=1
    cat "$out/anchor.log"
  fi
  return $status
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [tests] [paths] [bench] [example] [anchor]" >&2; exit 2 ;;
esac
