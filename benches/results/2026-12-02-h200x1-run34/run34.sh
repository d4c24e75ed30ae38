#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_final
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
{ for s in 1 2 3; do
  echo "== sitting $s default"; timeout 60 $b --nproc 1 --backend nccl --compare --quiet ${T:+--trace $OUT/trace_default.json}
  echo "== sitting $s balanced"; timeout 60 $b --nproc 1 --backend nccl --compare --quiet --balanced --trace $OUT/trace_balanced.json
  done
  echo "== margin 0 default"; timeout 60 $b --nproc 1 --backend nccl --compare --quiet --sm-margin 0
  echo "== margin 0 balanced"; timeout 60 $b --nproc 1 --backend nccl --compare --quiet --sm-margin 0 --balanced
  echo "== margin 999"; timeout 60 $b --nproc 1 --backend nccl --steps 2 --quiet --sm-margin 999; echo "rc=$?"
} > $OUT/example.log 2>&1
grep -E "^==|t/none \(|^rc=|sm-margin|error" $OUT/example.log | cut -c1-160
timeout 60 $b --nproc 1 --backend nccl --compare --quiet --trace $OUT/trace_default.json > $OUT/trace_default.log 2>&1
rm -f $OUT/*.svg.gz; gzip -f $OUT/*.json
