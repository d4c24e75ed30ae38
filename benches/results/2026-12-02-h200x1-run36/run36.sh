#!/usr/bin/env bash
# Run 36: per-phase SM margins (forward:backward), serial gathers, Williams order.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
b=.device-out/exp/fsdp_step_x
pat="^(ring|auto|none)  +[0-9.]+ +[0-9.]+ +[0-9.-]+ +[0-9.e-]+|t/none \("
one() { local label=$1; local size=$2; shift; shift; local extra=""; [ $size = balanced ] && extra=--balanced
    echo "== $label $size"; env "$@" timeout 60 $b --nproc 1 --backend nccl --compare --quiet $extra 2>&1 | grep -E "$pat"; }
{
for s in 1 2; do
  one "s$s base(12:12) williams" balanced EXP_ORDER=williams
  for fb in 4:12 4:16 0:16 8:16; do one "s$s F:B $fb williams" balanced EXP_ORDER=williams EXP_SM_MARGIN_F=${fb%:*} EXP_SM_MARGIN_B=${fb#*:}; done
  for fb in 0:12 0:16; do one "s$s F:B $fb fwd-serial williams" balanced EXP_ORDER=williams EXP_FWD_SERIAL=1 EXP_SM_MARGIN_F=${fb%:*} EXP_SM_MARGIN_B=${fb#*:}; done
  one "s$s F:B 0:0 fwd+bwd-serial williams" balanced EXP_ORDER=williams EXP_FWD_SERIAL=1 EXP_BWD_SERIAL=1 EXP_SM_MARGIN_F=0 EXP_SM_MARGIN_B=0
done
for s in 1 2; do
  one "s$s base(12:12) williams" default EXP_ORDER=williams
  for fb in 4:4 4:8 4:12 0:4 8:8; do one "s$s F:B $fb williams" default EXP_ORDER=williams EXP_SM_MARGIN_F=${fb%:*} EXP_SM_MARGIN_B=${fb#*:}; done
  one "s$s F:B 0:12 fwd-serial williams" default EXP_ORDER=williams EXP_FWD_SERIAL=1 EXP_SM_MARGIN_F=0 EXP_SM_MARGIN_B=12
  one "s$s F:B 0:0 fwd+bwd-serial williams" default EXP_ORDER=williams EXP_FWD_SERIAL=1 EXP_BWD_SERIAL=1 EXP_SM_MARGIN_F=0 EXP_SM_MARGIN_B=0
done
} 2>&1 | tee $OUT/example.log
