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
# Sections of `run` (default all): tests paths bench example anchor procs nodes world python
#   procs:  the example as two processes (`--nproc 2`), `--balanced --compare`, three
#           sittings, then its no-communication mode
#   nodes:  two simulated nodes on one host (each rank its own NCCL_HOSTID, under
#           torchrun), with NCCL's own log of what it selected
#   world:  several NCCL ranks on one GPU (each its own NCCL_HOSTID, started by
#           scripts/nccl-world.sh): examples/nccl_world.rs's trials on 2 and 3 ranks
#           (collectives, two pools, CUDA graph, host cost per call), kill -9 of rank 1
#           and of rank 0 inside a collective and inside a registration, SIGSTOP of a
#           rank, and fsdp_step in every mode and check mode, its losses compared with
#           the host backend's, and `fsdp_step --survive` on 4 ranks (one lost, three
#           shrink and train on); fails if any check fails. On torch's NCCL when it is
#           installed (WORLD_NCCL=system keeps the system's); WORLD_BUDGET_S skips what
#           would start after that many seconds (reported as not run, a failure);
#           WORLD_REPEAT=N runs the kill and SIGSTOP trials N times
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
  [ -f examples/nccl_world.rs ] && example+=(--example nccl_world)
  cargo build --release --bench gpu_collectives "${example[@]}" --message-format=json |
    jq -r 'select(.executable != null) | .executable' |
    while read -r exe; do cp "$exe" "$BUNDLE/bin/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
  # The Python package, for the `python` section (maturin from $MATURIN or PATH).
  if command -v "${MATURIN:-maturin}" >/dev/null; then
    (cd python && "${MATURIN:-maturin}" build --release --out "../$BUNDLE/wheels")
  fi
  strip "$BUNDLE"/bin/gpu_collectives "$BUNDLE"/bin/fsdp_step "$BUNDLE"/bin/nccl_world 2>/dev/null || true
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
  [ ${#want[@]} -eq 0 ] && want=(tests paths bench example anchor procs nodes world python)
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
  if has world; then
    world "$out" || status=1
    cat "$out/world.log"
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

# The `world` section: NCCL ranks sharing this machine's one GPU (see the top). Writes
# $1/world.log (what ran, each check's verdict, the figures) and $1/world-ranks.log
# (every rank's output, each world under a header).
world() (
  local out="$1" bin="$BUNDLE/bin" dir=/tmp/symmpool-world start=$SECONDS status=0
  local log="$out/world.log" ranks="$out/world-ranks.log" budget="${WORLD_BUDGET_S:-0}"
  : >"$log"; : >"$ranks"
  # One GPU for every rank (the first visible one).
  local visible="${CUDA_VISIBLE_DEVICES:-0}"
  export CUDA_VISIBLE_DEVICES="${visible%%,*}"
  if [ "${WORLD_NCCL:-torch}" != system ] && [ -z "${SYMMPOOL_NCCL_LIBRARY:-}" ]; then
    # torch's NCCL (2.28.9 here: ncclCommRevoke, which ends a thread blocked inside
    # NCCL); the system's otherwise.
    local torch_nccl
    torch_nccl="$(python3 -c 'import glob, site
for d in site.getsitepackages():
    for f in sorted(glob.glob(d + "/nvidia/**/libnccl.so.2", recursive=True)):
        print(f); raise SystemExit' 2>/dev/null)" || true
    [ -n "$torch_nccl" ] && export SYMMPOOL_NCCL_LIBRARY="$torch_nccl"
  fi
  echo "== world: $(date -u), NCCL ${SYMMPOOL_NCCL_LIBRARY:-from the system path}" | tee -a "$log"
  # One world: a name, then the script's options and command. Its summary lines and
  # the ranks' RESULT/HOSTCOST/FAILED lines go to world.log, all output to
  # world-ranks.log; a failed world fails the section.
  one() {
    local name="$1"; shift
    if [ "$budget" -gt 0 ] && [ $((SECONDS - start)) -ge "$budget" ]; then
      echo "-- $name: not run (WORLD_BUDGET_S=$budget spent)" | tee -a "$log"; status=1; return
    fi
    local t0=$SECONDS code=0 w="$dir/$name" f
    rm -rf "$w"
    bash scripts/nccl-world.sh -d "$w" "$@" >"$w.out" 2>&1 || code=$?
    {
      echo "-- $name: exit $code in $((SECONDS - t0)) s"
      grep '^nccl-world: \(SIG\|rank\|the world\)' "$w.out"
      cat "$w"/rank*.log 2>/dev/null | grep -E 'RESULT|FAILED|HOSTCOST|^ +[0-9]+ KiB|^size/rank|^floor|ranks on Nccl|registered pool|^(lost|shrink|summary):|^losses at|^  (parameters|gradients|data) ' | sed 's/^/   /'
    } | tee -a "$log"
    { echo "==== $name (exit $code)"; cat "$w.out"
      for f in "$w"/rank*.log; do echo "---- $(basename "$f")"; grep -v 'NCCL INFO' "$f"; done
    } >>"$ranks"
    [ "$code" = 0 ] || status=1
  }
  mkdir -p "$dir"
  # The example: every mode, each check mode, losses against the host backend's at
  # the same sizes (hidden² splits over 2 and 3 ranks).
  fsdp() {
    local n="$1" check files=()
    shift
    local sizes=(--layers 2 --hidden 384 --batch 64 --steps 6 --compare --json --quiet)
    "$bin/fsdp_step" --backend host --ranks "$n" --check off "${sizes[@]}" >"$dir/host-$n.log" 2>&1 \
      || { echo "-- fsdp_step host $n ranks: failed" | tee -a "$log"; status=1; }
    files+=(--losses "$dir/host-$n.log")
    for check in "$@"; do
      one "fsdp-$n-$check" -n "$n" -t 120 -- "$bin/fsdp_step" --backend nccl --check "$check" "${sizes[@]}"
      files+=(--losses "$dir/fsdp-$n-$check/rank0.log")
    done
    "$bin/nccl_world" compare-losses --tolerance 0.1 "${files[@]}" 2>&1 | sed 's/^/   /' | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  }
  one trials-2 -n 2 -t 100 -- "$bin/nccl_world" collectives two-pools graph hostcost
  local f r reps="${WORLD_REPEAT:-1}"
  for r in $(seq "$reps"); do
    for f in collective:KILL:1 collective:KILL:0 collective:STOP:1 registration:KILL:1 \
      registration:KILL:0 registration:STOP:1; do
      one "fault-${f//:/-}$([ "$reps" = 1 ] || echo "-$r")" -n 2 -t 45 --fault "${f#*:}" \
        -- "$bin/nccl_world" "fault-${f%%:*}"
    done
  done
  fsdp 2 off async strict
  one trials-3 -n 3 -t 100 -- "$bin/nccl_world" collectives two-pools graph
  # A rank killed in a collective; the two survivors shrink and all-gather again.
  one fault-shrink-KILL-1 -n 3 -t 90 --fault KILL:1 -- "$bin/nccl_world" fault-shrink
  # The example loses rank 3 of 4 in a reduce-scatter; the three survivors shrink their
  # pools and train on at world size 3.
  one fsdp-survive-4 -n 4 -t 150 --dies 3 -- "$bin/fsdp_step" --backend nccl --survive \
    --layers 2 --hidden 384 --batch 64 --steps 6 --quiet
  fsdp 3 off
  echo "== world: $([ "$status" = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s" | tee -a "$log"
  exit $status
)

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [tests] [paths] [bench] [example] [anchor] [procs] [nodes] [world] [python]" >&2; exit 2 ;;
esac
