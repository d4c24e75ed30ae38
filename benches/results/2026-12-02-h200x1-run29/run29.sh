#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cat .device-out/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv
timeout 300 python3 .device-out/probe29.py 2>&1 | tee $OUT/probe29.log | grep -v Warning
b=.device-out/exp/fsdp_step
pat="^(ring|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
{ for s in 1 2; do
  for v in "" 1; do
   echo "== sitting $s noreg=$v default"; env -u EXP_NOREG ${v:+EXP_NOREG=1} timeout 60 .device-out/exp/fsdp_step_noreg --nproc 1 --backend nccl --compare --quiet 2>&1 | grep -E "$pat"
   echo "== sitting $s noreg=$v balanced"; env -u EXP_NOREG ${v:+EXP_NOREG=1} timeout 60 .device-out/exp/fsdp_step_noreg --nproc 1 --backend nccl --balanced --compare --quiet 2>&1 | grep -E "$pat"
  done; done; } 2>&1 | tee $OUT/example.log
