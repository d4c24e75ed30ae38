#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_x
pat="^(ring|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
one() { # label env...
  local label=$1; shift
  for size in default balanced; do
    local extra=""; [ $size = balanced ] && extra=--balanced
    echo "== $label $size"; env "$@" timeout 60 $b --nproc 1 --backend nccl --compare --quiet $extra 2>&1 | grep -E "$pat"
  done
}
{ one base A=1
  one rotate EXP_ROTATE=1
  for m in 8 16 24 32 48; do one "rotate margin $m" EXP_ROTATE=1 EXP_SM_MARGIN=$m; done
  one base2 A=1
  one rotate2 EXP_ROTATE=1
  for m in 16 32; do one "rotate2 margin $m" EXP_ROTATE=1 EXP_SM_MARGIN=$m; done
  EXP_ROTATE=1 EXP_SM_MARGIN=16 timeout 60 $b --nproc 1 --backend nccl --compare --quiet --balanced --trace $OUT/trace_m16.json > /dev/null 2>&1; echo trace rc=$?
} 2>&1 | tee $OUT/example.log
gzip -f $OUT/*.json
