#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_x
pat="^(ring|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
one() { local label=$1; local size=$2; shift; shift; local extra=""; [ $size = balanced ] && extra=--balanced
    echo "== $label $size"; env "$@" timeout 60 $b --nproc 1 --backend nccl --compare --quiet $extra 2>&1 | grep -E "$pat"; }
{ for s in 1 2; do for m in 0 8 12 16 20; do one "s$s margin $m" default EXP_ROTATE=1 EXP_SM_MARGIN=$m; done; done
  for s in 1 2; do for m in 8 12 16 20; do one "s$s margin $m" balanced EXP_ROTATE=1 EXP_SM_MARGIN=$m; done; done
} 2>&1 | tee $OUT/example.log
