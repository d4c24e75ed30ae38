#!/usr/bin/env bash
# Run 39: main at 4a26fa8 (main's rank/thread dispatch read once): the example on NCCL as a
# process (--nproc 1) and as a thread (--ranks 1), each with --trace and --memory-map.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_4a26fa8
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== process"; timeout 120 $b --nproc 1 --backend nccl --compare --quiet --trace $OUT/tp.json --memory-map $OUT/mp.svg; echo "rc=$?"
echo "== thread"; timeout 120 $b --ranks 1 --backend nccl --compare --quiet --trace $OUT/tt.json --memory-map $OUT/mt.svg; echo "rc=$?"
ls $OUT; python3 -c "import json,sys; [json.load(open(f)) for f in sys.argv[1:]]; print('json ok')" $OUT/tp.json $OUT/tt.json
} 2>&1 | grep -E "^(ring|auto|none|symm|ce) |t/none \(|^== |rc=|json ok|memory map|^trace:|\.json|\.svg|UTC|H200" | tee $OUT/example.log
rm -f $OUT/*.json $OUT/*.svg
