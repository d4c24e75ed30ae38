#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_x
pat="^(ring|symm|ce|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
timeout 200 python3 .device-out/probe31.py 2>&1 | grep -v Warn | tee $OUT/probe31.log
one() { local label=$1; shift
  for size in default balanced; do local extra=""; [ $size = balanced ] && extra=--balanced
    echo "== $label $size"; env "$@" timeout 60 $b --nproc 1 --backend nccl --compare --quiet $extra 2>&1 | grep -E "$pat"; done; }
{ one shuffle EXP_ROTATE=1; one "shuffle margin 16" EXP_ROTATE=1 EXP_SM_MARGIN=16; one "shuffle margin 12" EXP_ROTATE=1 EXP_SM_MARGIN=12; } 2>&1 | tee $OUT/example.log
