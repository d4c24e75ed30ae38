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
# Sections of `run` (default all): tests paths bench example anchor procs nodes world same python
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
#           WORLD_REPEAT=N runs the kill and SIGSTOP trials N times; WORLD_ONLY=REGEX
#           runs only the worlds whose names match (in `same` too, and python's
#           one-GPU FSDP2 comparison, named fsdp2)
#   python: the wheel from gpu-bundle/wheels: pytest's GPU tests, test_gpu_world.py as
#           two NCCL ranks on one GPU (simulated nodes) and as one node (NCCL 2.32.6),
#           then FSDP2 with symmpool against FSDP2 as it comes
#           (python/bench/fsdp2_compare.py under torchrun): with two GPUs three ways, on
#           one GPU as two ranks of one node
#   same:   two NCCL ranks on this one GPU as ONE node (NCCL >= 2.30,
#           NCCL_MULTI_RANK_GPU_ENABLE=1, no NCCL_HOSTID; the NCCL 2.32.6 of the wheel, below):
#           NCCL links them by P2P, so windows, the symmetric kernels and the copy-engine
#           all-gather run with a real peer. The `world` trials there (collectives, two
#           pools, CUDA graph, host cost, `paths`: crate vs raw NCCL path by path), kill -9
#           and SIGSTOP inside a symmetric kernel, inside a copy-engine all-gather and inside
#           a registration, fsdp_step in every mode and check mode, a shrink from 2 to 1;
#           then 2.32 with one NCCL_HOSTID per rank (NCCL answers windows with NULL there:
#           handled, logged, never used). world-same.log says which paths NCCL logged.
#           The python section runs test_gpu_world.py in this world too.
#
# NCCL 2.32.6 (the machine has 2.28 only). `build` downloads the registry's wheel
# nvidia-nccl-cu13==2.32.6 (206.6 MB) with pip, checks its sha256 and splits it into
# pieces of at most NCCL_PIECE_MB MiB (default 50: four) in gpu-nccl/ (git ignores it).
# The GPU machine takes in at most 64 MiB a transfer (at times less: 14 MiB pieces, two
# or three a transfer, went where 50 MiB failed) but keeps /tmp while it stays warm, so
# send the pieces over several transfers, one right after another, each with
#   bash scripts/gpu-check.sh receive      # moves gpu-nccl/* there into /tmp/symmpool-nccl
# and `run` joins the pieces, checks the sha256 and extracts libnccl.so.2 (once). The crate
# loads it through SYMMPOOL_NCCL_LIBRARY, PyTorch through LD_PRELOAD. Without every
# piece the `same` section is reported as not run (a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-bundle
NCCL_WHEEL=nvidia_nccl_cu13-2.32.6-py3-none-manylinux_2_27_x86_64.whl
NCCL_SHA256=76e7aad00482092baf01e13e66f441d54c96b5cf1e3f143dee27db7f731d41ba
NCCL_PIECES=gpu-nccl NCCL_TMP=/tmp/symmpool-nccl

# The NCCL wheel in pieces (see the top); the download is skipped when its pieces exist.
nccl_pieces() {
  [ -f "$NCCL_PIECES/SHA256" ] && [ "$(cat "$NCCL_PIECES/SHA256")" = "$NCCL_SHA256" ] \
    && [ "$(cat "$NCCL_PIECES"/piece.* 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$NCCL_SHA256" ] && return 0
  rm -rf "$NCCL_PIECES" && mkdir -p "$NCCL_PIECES"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$NCCL_PIECES" nvidia-nccl-cu13==2.32.6
  echo "$NCCL_SHA256  $NCCL_PIECES/$NCCL_WHEEL" | sha256sum -c -
  split -b "${NCCL_PIECE_MB:-50}M" -d "$NCCL_PIECES/$NCCL_WHEEL" "$NCCL_PIECES/piece."
  rm "$NCCL_PIECES/$NCCL_WHEEL"
  echo "$NCCL_SHA256" >"$NCCL_PIECES/SHA256"
  ls -l "$NCCL_PIECES"
}

# On the GPU machine: keep the pieces that came with this transfer.
receive() {
  mkdir -p "$NCCL_TMP"
  local f n=0
  for f in "$NCCL_PIECES"/piece.*; do [ -f "$f" ] && mv -f "$f" "$NCCL_TMP/" && n=$((n + 1)); done
  echo "received $n piece(s); $NCCL_TMP has: $(cd "$NCCL_TMP" && ls piece.* 2>/dev/null | tr '\n' ' ')"
}

# On the GPU machine: the path of NCCL 2.32.6's libnccl.so.2, joined, checked and
# extracted from the pieces once; fails when a piece is missing or the sum is wrong.
nccl232() {
  local lib="$NCCL_TMP/nvidia/nccl/lib/libnccl.so.2"
  if [ ! -f "$lib" ]; then
    # Joined and checked (a missing piece fails the sum), extracted aside, then moved
    # into place: an interrupted extraction leaves no library behind.
    cat "$NCCL_TMP"/piece.* >"$NCCL_TMP/$NCCL_WHEEL" 2>/dev/null
    echo "$NCCL_SHA256  $NCCL_TMP/$NCCL_WHEEL" | sha256sum -c - >&2 \
      || { echo "gpu-check: NCCL 2.32.6: the pieces in $NCCL_TMP do not make the wheel" >&2; return 1; }
    rm -rf "$NCCL_TMP/x" && python3 -m zipfile -e "$NCCL_TMP/$NCCL_WHEEL" "$NCCL_TMP/x" >&2 || return 1
    rm -rf "$NCCL_TMP/nvidia" && mv "$NCCL_TMP/x/nvidia" "$NCCL_TMP/nvidia" && rm -rf "$NCCL_TMP/x" "$NCCL_TMP/$NCCL_WHEEL"
  fi
  echo "$lib"
}

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
    # Its tests as they were when the wheel was built: the run uses these.
    cp -r python/tests "$BUNDLE/python-tests"
  fi
  strip "$BUNDLE"/bin/gpu_collectives "$BUNDLE"/bin/fsdp_step "$BUNDLE"/bin/nccl_world 2>/dev/null || true
  # The raw-NCCL anchor benchmark, when a copy is given in $ANCHORS.
  local anchors="${ANCHORS:-}"
  if [ -n "$anchors" ] && [ -d "$anchors" ]; then mkdir -p "$BUNDLE/anchors" && cp "$anchors"/* "$BUNDLE/anchors/"; fi
  ls -la "$BUNDLE" "$BUNDLE/bin"
  du -sh "$BUNDLE"
  # Without the pieces the `same` section reports itself not run.
  nccl_pieces || echo "gpu-check: NCCL 2.32.6 could not be fetched: the same-node world will not run" >&2
}

run() {
  local out="${OUT:-./gpu-out}"
  mkdir -p "$out"
  local want=("$@")
  [ ${#want[@]} -eq 0 ] && want=(tests paths bench example anchor procs nodes world same python)
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
  if has same; then
    world "$out" same || status=1
    cat "$out/world-same.log"
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
      PYTHONPATH="$site" python3 -m pytest -ra -q -p no:cacheprovider "$BUNDLE/python-tests/test_gpu.py" || status=1
      echo "== test_gpu_world.py: 2 NCCL ranks on one GPU"
      PYTHONPATH="$site" CUDA_VISIBLE_DEVICES="${gpu%%,*}" timeout -k 30 600 python3 -m torch.distributed.run \
        --standalone --nproc-per-node 2 --tee 3 --no-python bash -c \
        'NCCL_HOSTID=simnode$LOCAL_RANK exec python3 -m pytest -rA -q -p no:cacheprovider "$@"' \
        pytest "$BUNDLE/python-tests/test_gpu_world.py" || status=1
      # The same as one node on NCCL 2.32.6 (PyTorch loads it first, through
      # LD_PRELOAD; the crate uses the NCCL its process already has): P2P, windows,
      # symmetric kernels under PyTorch's communicators too.
      local lib
      if lib="$(nccl232)"; then
        echo "== test_gpu_world.py: 2 NCCL ranks on one GPU as one node, NCCL 2.32.6"
        PYTHONPATH="$site" CUDA_VISIBLE_DEVICES="${gpu%%,*}" LD_PRELOAD="$lib" NCCL_MULTI_RANK_GPU_ENABLE=1 \
          NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING timeout -k 30 600 python3 -m torch.distributed.run \
          --standalone --nproc-per-node 2 --tee 3 --no-python python3 -m pytest -rA -q -p no:cacheprovider \
          "$BUNDLE/python-tests/test_gpu_world.py" >"/tmp/symmpool-pysame.log" 2>&1 || status=1
        grep -v 'NCCL INFO' /tmp/symmpool-pysame.log || true
        echo "-- NCCL on rank 0: $(grep -c '^\[default0\].*NCCL INFO.* via P2P' /tmp/symmpool-pysame.log) P2P channel lines;" \
          "$(grep '^\[default0\]' /tmp/symmpool-pysame.log | grep -oE '(AllGather|ReduceScatter|AllReduce) \[(Symmetric|Copy Engine|Hierarchical CE)\]' | sort | uniq -c | tr -s ' \n' ' ')"
      else
        echo "== test_gpu_world.py as one node: not run (no NCCL 2.32.6)"; status=1
      fi
      # WORLD_ONLY set and not matching "fsdp2" leaves the comparison out.
      if [ "${GPUS:-2}" -lt 2 ] && { [ -z "${WORLD_ONLY:-}" ] || [[ fsdp2 =~ $WORLD_ONLY ]]; } && lib="$(nccl232)"; then
        # FSDP2 with symmpool against FSDP2 as it comes, two ranks on this GPU as one
        # node, interleaved twice (time slicing: compare the modes, not with NVLink).
        echo "== fsdp2_compare: 2 ranks on one GPU as one node, NCCL 2.32.6"
        PYTHONPATH="$site" CUDA_VISIBLE_DEVICES="${gpu%%,*}" LD_PRELOAD="$lib" NCCL_MULTI_RANK_GPU_ENABLE=1 \
          timeout -k 30 400 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
          python/bench/fsdp2_compare.py --modes default,symmpool,default,symmpool --json "$out/fsdp2-same.json" || status=1
      fi
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

# The `world` and `same` sections: NCCL ranks sharing this machine's one GPU (see the
# top). `world OUT` runs them as simulated nodes (one NCCL_HOSTID each) on torch's NCCL,
# `world OUT same` as one node on NCCL 2.32.6. Writes OUT/world[-same].log (what ran,
# each check's verdict, the figures, the paths NCCL logged) and OUT/world[-same]-ranks.log
# (every rank's output but NCCL's INFO lines, each world under a header).
world() (
  local out="$1" same="${2:-}" bin="$BUNDLE/bin" dir=/tmp/symmpool-world start=$SECONDS status=0
  local tag="" budget="${WORLD_BUDGET_S:-0}" sn=()
  if [ "$same" = same ]; then
    tag=-same sn=(--same-node) dir=/tmp/symmpool-world-same
    local lib
    lib="$(nccl232)" || { echo "== world (same node): not run: no NCCL 2.32.6" | tee "$out/world$tag.log"; exit 1; }
    # Two ranks per GPU (experimental in NCCL 2.30+), and NCCL's own account of each
    # call's path (`[Symmetric]`, `[Copy Engine]`, `Algo RING`) in every rank's log.
    export SYMMPOOL_NCCL_LIBRARY="$lib" NCCL_MULTI_RANK_GPU_ENABLE=1 \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING
  fi
  local log="$out/world$tag.log" ranks="$out/world$tag-ranks.log"
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
  echo "== world${same:+ (one node, NCCL_MULTI_RANK_GPU_ENABLE=1)}: $(date -u), NCCL ${SYMMPOOL_NCCL_LIBRARY:-from the system path}" | tee -a "$log"
  # One world: a name, then the script's options and command. Its summary lines and
  # the ranks' RESULT/HOSTCOST/PATHBENCH/FAILED lines go to the log, all output but
  # NCCL's INFO lines to the ranks' log, and, where NCCL logged them, how many of
  # rank 0's calls took each path; a failed world fails the section.
  one() {
    local name="$1"; shift
    # WORLD_ONLY: a regular expression; worlds whose names do not match are left out.
    [ -z "${WORLD_ONLY:-}" ] || [[ $name =~ $WORLD_ONLY ]] || return 0
    if [ "$budget" -gt 0 ] && [ $((SECONDS - start)) -ge "$budget" ]; then
      echo "-- $name: not run (WORLD_BUDGET_S=$budget spent)" | tee -a "$log"; status=1; return
    fi
    local t0=$SECONDS code=0 w="$dir/$name" f
    rm -rf "$w"
    bash scripts/nccl-world.sh "${sn[@]}" -d "$w" "$@" >"$w.out" 2>&1 || code=$?
    {
      echo "-- $name: exit $code in $((SECONDS - t0)) s"
      grep '^nccl-world: \(SIG\|rank\|the world\)' "$w.out"
      cat "$w"/rank*.log 2>/dev/null | grep -E 'RESULT|TEARDOWN|FAILED|HOSTCOST|PATHBENCH|calibrat|^ +[0-9]+ KiB|^size/rank|^floor|ranks on Nccl|registered pool|NULL window|^(lost|shrink|summary|heal|healed):|^  the newcomer|^losses at|^  (parameters|gradients|data|mode) |^ *(ring|symm|ce|auto|none) ' | sed 's/^/   /'
      if grep -q 'NCCL INFO' "$w/rank0.log" 2>/dev/null; then
        echo "   NCCL on rank 0: $(grep -c 'NCCL INFO.* via P2P' "$w/rank0.log") P2P and $(grep -c 'NCCL INFO.* via NET' "$w/rank0.log") NET channel lines; calls:" \
          "$(grep -oE '(AllGather|ReduceScatter|AllReduce) \[(Symmetric|Copy Engine|Hierarchical CE)\]|(AllGather|ReduceScatter|AllReduce): .*Algo [A-Z_]+' "$w/rank0.log" \
            | sed -E 's/: .*Algo ([A-Z_]+)/ [\1]/' | sort | uniq -c | awk '{c=$1; $1=""; printf "%s%s %d", (n++ ? ", " : ""), substr($0, 2), c}')"
        grep -ohE '\[(Symmetric|Copy Engine|Hierarchical CE)\].*(Kernel|cudaMemcpy|CE)[^ ]*( [A-Za-z_]+)?' "$w/rank0.log" | sed -E 's/.*(Kernel [A-Za-z_]+|cudaMemcpy[A-Za-z]*).*/\1/' | sort | uniq -c | sed 's/^/     /' | head -n 12
      fi
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
    [ -z "${WORLD_ONLY:-}" ] || [[ fsdp-$n =~ $WORLD_ONLY ]] || return 0
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
  local f r reps="${WORLD_REPEAT:-1}" faults
  faults=(collective:KILL:1 collective:KILL:0 collective:STOP:1 registration:KILL:1 registration:KILL:0 registration:STOP:1)
  if [ "$same" = same ]; then
    # Every path with a real peer; the crate against raw NCCL path by path (`paths`).
    one trials-2 -n 2 -t 100 -- "$bin/nccl_world" collectives two-pools graph
    # Timings without NCCL's line per call (rank 0 writes one under TUNING).
    NCCL_DEBUG=WARN one bench-2 -n 2 -t 400 -- "$bin/nccl_world" hostcost paths
    # The example at its GPU sizes, every mode interleaved: auto (calibrated on this
    # machine) against the best fixed path.
    NCCL_DEBUG=WARN one example-compare -n 2 -t 300 -- "$bin/fsdp_step" --backend nccl --compare
    # The survivor inside a symmetric kernel (the default path of the trial's 1 MiB
    # all-gather) and inside a copy-engine all-gather.
    faults+=(collective-ce:KILL:1 collective-ce:STOP:1)
  else
    one trials-2 -n 2 -t 100 -- "$bin/nccl_world" collectives two-pools graph hostcost
  fi
  for r in $(seq "$reps"); do
    for f in "${faults[@]}"; do
      local trial="${f%%:*}" path=()
      [ "$trial" = collective-ce ] && trial=collective path=(--path ce)
      one "fault-${f//:/-}$([ "$reps" = 1 ] || echo "-$r")" -n 2 -t 45 --fault "${f#*:}" \
        -- "$bin/nccl_world" "${path[@]}" "fault-$trial"
    done
  done
  fsdp 2 off async strict
  if [ "$same" = same ]; then
    # A rank killed in an all-gather; the survivor shrinks to a world of one.
    one fault-shrink-KILL-1 -n 2 -t 90 --fault KILL:1 -- "$bin/nccl_world" fault-shrink
    # Then a newcomer replaces it: the world grows back to two (2 -> 1 -> 2).
    one fault-grow-KILL-1 -n 2 -t 120 --fault KILL:1 -- "$bin/nccl_world" fault-grow
    # The example heals: rank 3 lost, three go on, its replacement joins (4 -> 3 -> 4).
    SYMMPOOL_FSDP_HEAL_STATE="$out/heal-same.state" one fsdp-heal-4 -n 4 -t 200 --dies 3 --replace \
      -- "$bin/fsdp_step" --backend nccl --survive --heal --layers 2 --hidden 384 --batch 64 --steps 8 --quiet
    # NCCL 2.32 across simulated nodes: windows come back NULL, and are never used.
    sn=()
    one nodes-2.32 -n 2 -t 100 -- "$bin/nccl_world" collectives
  else
    one trials-3 -n 3 -t 100 -- "$bin/nccl_world" collectives two-pools graph
    # A rank killed in a collective; the two survivors shrink and all-gather again.
    one fault-shrink-KILL-1 -n 3 -t 90 --fault KILL:1 -- "$bin/nccl_world" fault-shrink
    # Then a newcomer replaces it: 2 -> 1 -> 2 and 3 -> 2 -> 3.
    one fault-grow-2-KILL-1 -n 2 -t 120 --fault KILL:1 -- "$bin/nccl_world" fault-grow
    one fault-grow-3-KILL-1 -n 3 -t 120 --fault KILL:1 -- "$bin/nccl_world" fault-grow
    SYMMPOOL_FSDP_HEAL_STATE="$out/heal.state" one fsdp-heal-4 -n 4 -t 200 --dies 3 --replace \
      -- "$bin/fsdp_step" --backend nccl --survive --heal --layers 2 --hidden 384 --batch 64 --steps 8 --quiet
    # The example loses rank 3 of 4 in a reduce-scatter; the three survivors shrink their
    # pools and train on at world size 3.
    one fsdp-survive-4 -n 4 -t 150 --dies 3 -- "$bin/fsdp_step" --backend nccl --survive \
      --layers 2 --hidden 384 --batch 64 --steps 6 --quiet
    fsdp 3 off
  fi
  echo "== world$tag: $([ "$status" = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s" | tee -a "$log"
  exit $status
)

case "${1:-}" in
  build) build ;;
  receive) receive ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | receive | run [tests] [paths] [bench] [example] [anchor] [procs] [nodes] [world] [same] [python]" >&2; exit 2 ;;
esac
