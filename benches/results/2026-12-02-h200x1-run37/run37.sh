#!/usr/bin/env bash
# Run 37: traces of the base schedule and of serial forward gathers, balanced.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=.device-out/exp/fsdp_step_x
pat="^(ring|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
one() { local label=$1; shift; echo "== $label"; env "$@" timeout 90 $b --nproc 1 --backend nccl --compare --quiet --balanced --trace $OUT/$label.json 2>&1 | grep -E "$pat"; gzip $OUT/$label.json; }
{
one base EXP_ORDER=williams
one fs0-12 EXP_ORDER=williams EXP_FWD_SERIAL=1 EXP_SM_MARGIN_F=0 EXP_SM_MARGIN_B=12
one m0 EXP_ORDER=williams EXP_SM_MARGIN_F=0 EXP_SM_MARGIN_B=0
} 2>&1 | tee $OUT/example.log
