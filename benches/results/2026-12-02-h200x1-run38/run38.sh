#!/usr/bin/env bash
# Run 38: the one-GPU check of main (bundle): trials, the example (three sittings per size,
# one traced), --sm-margin 999, --json, pytest.
set -u
cd "$(dirname "$0")/.."
FINAL="$OUT"; OUT=/tmp/res; rm -rf $OUT; mkdir -p $OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cat .device-out/commit.txt > "$OUT/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/machine.txt" 2>&1
bin=gpu-bundle/bin
GPUS=1 SYMMPOOL_REQUIRE_GPU=1 OUT="$OUT" timeout 300 bash scripts/gpu-check.sh run tests > "$OUT/check.log" 2>&1
echo "tests rc=$?" >> "$OUT/check.log"
{ for s in 1 2 3; do echo "== sitting $s default"; timeout 120 "$bin/fsdp_step" --nproc 1 --backend nccl --compare --quiet
    echo "== sitting $s balanced"; timeout 120 "$bin/fsdp_step" --nproc 1 --backend nccl --balanced --compare --quiet; done
  echo "== traced balanced"; timeout 120 "$bin/fsdp_step" --nproc 1 --backend nccl --balanced --compare --quiet --trace "$OUT/trace_balanced.json"
  echo "== margin 999"; timeout 60 "$bin/fsdp_step" --nproc 1 --backend nccl --sm-margin 999 --quiet; echo "margin999 rc=$?"
  echo "== json"; timeout 60 "$bin/fsdp_step" --nproc 1 --backend nccl --compare --json > $OUT/summary.json; echo "json rc=$?"
  python3 -c "import json,sys; d=json.load(open('$OUT/summary.json')); print([(m.get('mode'), m.get('sm_margin')) for m in (d if isinstance(d,list) else d.get('summaries', d.get('modes', [])))])" || head -c 600 $OUT/summary.json
  true; } >> "$OUT/example.log" 2>&1
site=/tmp/symmpool-site; rm -rf $site; python3 -m pip install -q --no-index --no-deps --target $site gpu-bundle/wheels/symmpool-*.whl
PYTHONPATH=$site timeout 200 python3 -m pytest -ra -v -s -p no:cacheprovider python/tests/test_gpu.py python/tests/test_basic.py > "$OUT/python.log" 2>&1
echo "python rc=$?" >> "$OUT/python.log"
tail -n 16 "$OUT/check.log"; grep -E "rc=" "$OUT"/*.log; grep -E "^(ring|auto|none) |t/none \(|^== |rc=|sm_margin|\[\(" "$OUT/example.log" | cut -c1-110 | head -80; grep -E "passed|failed" "$OUT/python.log" | tail -3
rm -f $OUT/*.svg.gz; gzip -f $OUT/*.json 2>/dev/null
cd /tmp && tar czf "$FINAL/results.tgz" res && ls -la "$FINAL"
