#!/usr/bin/env bash
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_x
pat="^(ring|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
one() { local label=$1; local size=$2; shift; shift; local extra=""; [ $size = balanced ] && extra=--balanced
    echo "== $label $size"; env "$@" timeout 60 $b --nproc 1 --backend nccl --compare --quiet $extra 2>&1 | grep -E "$pat"; }
{ for s in 1 2; do for fb in 16:8 16:12 20:12 12:16 16:16; do one "s$s F:B $fb" balanced EXP_ROTATE=1 EXP_SM_MARGIN_F=${fb%:*} EXP_SM_MARGIN_B=${fb#*:}; done; done
  for s in 1 2; do for fb in 12:0 12:8 0:12 12:12; do one "s$s F:B $fb" default EXP_ROTATE=1 EXP_SM_MARGIN_F=${fb%:*} EXP_SM_MARGIN_B=${fb#*:}; done; done
} 2>&1 | tee $OUT/example.log
