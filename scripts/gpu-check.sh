#!/usr/bin/env bash
# The project's GPU check, in two halves:
#
#   bash scripts/gpu-check.sh build   # here (build machine, no GPU): build and bundle
#   bash scripts/gpu-check.sh run     # on the two-GPU machine: run everything, logs to $OUT
#
# `build` puts the GPU tests (a nextest archive, with cargo-nextest to run it), stripped
# release binaries of the GPU benchmark and the example, and the raw-NCCL anchor
# benchmark (from $ANCHORS, when present) into gpu-bundle/ (git ignores it). Ship that
# folder to the GPU machine and run `run` there from the repo root; it writes at most
# 8 log files into $OUT (default ./gpu-out). GPUS=1 runs what one GPU can check.
# NCCL_CHECK=1 sets NCCL_CHECK_MODE=DEBUG_GLOBAL (NCCL >= 2.29.7 only).
#
# Sections of `run` (default all): tests paths bench example anchor procs nodes python
#   procs:  the example as two processes (`--nproc 2`), `--balanced --compare`, three
#           sittings, then its no-communication mode
#   nodes:  two simulated nodes on one host (each rank its own NCCL_HOSTID, under
#           torchrun), with NCCL's own log of what it selected
#   python: the wheel from gpu-bundle/wheels: pytest's GPU tests, test_gpu_world.py as
#           two NCCL ranks on one GPU (simulated nodes), then with two GPUs FSDP2
#           three ways (python/bench/fsdp2_compare.py under torchrun)
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-bundle

build() {
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin"
  # The GPU tests as a nextest archive (nextest finds and packs the executables), and
  # nextest itself to run it there (the GPU machine has no Rust toolchain).
  cargo nextest archive --release --test gpu --test gpu_paths \
    --archive-file "$BUNDLE/tests.tar.zst"
  cp "$(command -v cargo-nextest)" "$BUNDLE/bin/"
  # The benchmark and the example: jq reads their paths from cargo's messages.
  local example=()
  [ -f examples/fsdp_step/main.rs ] && example=(--example fsdp_step)
  cargo build --release --bench gpu_collectives "${example[@]}" --message-format=json |
    jq -r 'select(.executable != null) | .executable' |
    while read -r exe; do cp "$exe" "$BUNDLE/bin/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
  # The Python package, for the `python` section (maturin from $MATURIN or PATH).
  if command -v "${MATURIN:-maturin}" >/dev/null; then
    (cd python && "${MATURIN:-maturin}" build --release --out "../$BUNDLE/wheels")
  fi
  strip "$BUNDLE"/bin/gpu_collectives "$BUNDLE"/bin/fsdp_step 2>/dev/null || true
  # The raw-NCCL anchor benchmark, when a copy is given in $ANCHORS.
  local anchors="${ANCHORS:-}"
  if [ -n "$anchors" ] && [ -d "$anchors" ]; then mkdir -p "$BUNDLE/anchors" && cp "$anchors"/* "$BUNDLE/anchors/"; fi
  ls -la "$BUNDLE" "$BUNDLE/bin"
  du -sh "$BUNDLE"
}

run() {
  local out="${OUT:-./gpu-out}"
  mkdir -p "$out"
  local want=("$@")
  [ ${#want[@]} -eq 0 ] && want=(tests paths bench example anchor procs nodes python)
  has() { local x; for x in "${want[@]}"; do [ "$x" = "$1" ] && return 0; done; return 1; }
  # Keep NVLink multicast off (it can take a shared host down).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # NCCL's own per-collective check across ranks (registration and offsets; not
  # skipped calls), NCCL >= 2.29.7 only: set NCCL_CHECK=1 when the machine's NCCL has
  # it (the two-GPU machine has 2.28.3, so it is off by default). symmpool's checked
  # collectives (`--check` of the example) work on every version.
  if [ "${NCCL_CHECK:-0}" = 1 ]; then export NCCL_CHECK_MODE=DEBUG_GLOBAL; fi
  local bin="$BUNDLE/bin"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m || true
    ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null || true
  } > "$out/machine.txt" 2>&1
  local status=0
  # Every GPU test must run: a skip for want of GPUs is a failure here. Tests that need
  # more GPUs than the machine has are left out by name (GPUS=1 on a one-GPU machine).
  export SYMMPOOL_REQUIRE_GPU=1
  local tests='binary(gpu)'
  [ "${GPUS:-2}" -lt 2 ] && tests='binary(gpu) & test(/\(1 GPU\)$/)'
  # TESTS: another nextest filter expression, to run a few trials again.
  [ -n "${TESTS:-}" ] && tests="$TESTS"

  local nextest=("$bin/cargo-nextest" nextest run --archive-file "$BUNDLE/tests.tar.zst"
    --workspace-remap . --test-threads 1 --no-fail-fast --success-output immediate)
  if has tests; then
    "${nextest[@]}" -E "$tests" > "$out/tests.log" 2>&1 || status=1
    tail -n 15 "$out/tests.log"
  fi
  if has paths && [ "${GPUS:-2}" -ge 2 ]; then
    # The test sets NCCL_DEBUG itself; a copy-engine call on NCCL 2.28 is reported
    # "unverifiable" (ignored), which SYMMPOOL_REQUIRE_GPU does not turn into a failure.
    SYMMPOOL_REQUIRE_GPU=1 "${nextest[@]}" -E 'binary(gpu_paths)' > "$out/paths.log" 2>&1 || status=1
    tail -n 15 "$out/paths.log"
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
  if has procs; then
    # One process per GPU, as users run it: three sittings of the comparison, then
    # the same step without communication (auto ÷ none is the share not hidden).
    { for sitting in 1 2 3; do echo "== sitting $sitting"
        "$bin/fsdp_step" --nproc 2 --backend nccl --balanced --compare --quiet || return 1; done
      echo "== no communication"
      "$bin/fsdp_step" --nproc 2 --backend nccl --balanced --comm none --quiet; } \
      > "$out/procs.log" 2>&1 || status=1
    grep -A8 '^== \|^summary' "$out/procs.log" | grep -v '^--$' | tail -n 60
  fi
  if has nodes; then
    # Two "nodes" on one host: NCCL hashes NCCL_HOSTID as the host, so the ranks see
    # each other across a node boundary (no P2P/NVLink, no symmetric kernels, no copy
    # engine); the crate counts nodes the same way and must choose the ring.
    { NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING python3 -m torch.distributed.run \
        --standalone --nproc-per-node 2 --no-python bash -c \
        'NCCL_HOSTID=simnode$LOCAL_RANK exec "$0" "$@"' "$bin/fsdp_step" --compare --quiet
    } > "$out/nodes-full.log" 2>&1 || status=1
    grep -v 'NCCL INFO' "$out/nodes-full.log" > "$out/nodes.log" || true
    grep -E 'NCCL INFO (Channel 00|.*via |.*[Ss]ymmetric|.*nNodes|.*NET/)' "$out/nodes-full.log" \
      | sort | uniq -c | sort -rn | head -n 40 >> "$out/nodes.log" || true
    rm -f "$out/nodes-full.log"
    cat "$out/nodes.log"
  fi
  if has python; then
    # The wheel, then each step on its own (a failure of any fails the section):
    # pytest's one-GPU tests; python/tests/test_gpu_world.py as two NCCL ranks on one
    # GPU, each rank its own NCCL_HOSTID (two simulated nodes linked over NET/Socket:
    # collectives against torch.distributed, adopt, FSDP2 parity), every rank's lines
    # prefixed [defaultN]; with two GPUs, FSDP2 three ways (fsdp2_compare.py).
    local site=/tmp/symmpool-site
    rm -rf "$site" && python3 -m pip install -q --no-index --no-deps --target "$site" "$BUNDLE"/wheels/symmpool-*.whl
    local gpu="${CUDA_VISIBLE_DEVICES:-0}"
    {
      PYTHONPATH="$site" python3 -m pytest -ra -q -p no:cacheprovider python/tests/test_gpu.py || status=1
      echo "== test_gpu_world.py: 2 NCCL ranks on one GPU"
      PYTHONPATH="$site" CUDA_VISIBLE_DEVICES="${gpu%%,*}" timeout -k 30 600 python3 -m torch.distributed.run \
        --standalone --nproc-per-node 2 --tee 3 --no-python bash -c \
        'NCCL_HOSTID=simnode$LOCAL_RANK exec python3 -m pytest -rA -q -p no:cacheprovider "$@"' \
        pytest python/tests/test_gpu_world.py || status=1
      if [ "${GPUS:-2}" -ge 2 ]; then
        echo "== fsdp2_compare"
        PYTHONPATH="$site" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
          python/bench/fsdp2_compare.py --json "$out/fsdp2.json" || status=1
      fi
    } > "$out/python.log" 2>&1
    tail -n 40 "$out/python.log"
  fi
  return $status
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [tests] [paths] [bench] [example] [anchor] [procs] [nodes] [python]" >&2; exit 2 ;;
esac
