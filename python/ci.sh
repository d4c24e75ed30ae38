#!/usr/bin/env bash
# CI for the Python package (no GPU): build the wheel with maturin, install it into a
# virtual environment with PyTorch (the registry's CPU-capable `torch` wheel; it runs
# without a GPU), run python/tests with pytest. The torch tests (FSDP2 on CPU over
# gloo: test_fsdp_cpu.py, test_torch_cpu.py) must run: SYMMPOOL_REQUIRE_TORCH=1 makes
# a skip in them a failure. Tests that need CUDA are reported as skipped, with their
# reason. python/tests/test_shm_ranks.py runs python/examples/train_cpu.py as 4
# processes (torchrun, as torch is installed), each job under a timeout, every rank
# killed when its launcher returns.
#
# The venv is kept in target/python-ci/venv and reused: torch (about 4.8 GB installed
# with its CUDA runtime packages) is installed once, then found already satisfied.
#
#   bash python/ci.sh                 # from the repository root (or anywhere)
#   PYTHON=python3.12 bash python/ci.sh
#   SYMMPOOL_CI_RELEASE=1 bash python/ci.sh   # build the release wheel instead
#   SYMMPOOL_CI_TORCH=0 bash python/ci.sh     # no torch (a machine without the
#                                             # registry): the torch tests are skipped
#   SYMMPOOL_CI_TORCH_SPEC='torch==2.12.0' bash python/ci.sh   # another torch
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
py="${PYTHON:-python3}"
work="$root/target/python-ci"
venv="$work/venv"
wheels="$work/wheels"
mkdir -p "$work"
rm -rf "$wheels"

if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null
"$venv/bin/python" -m pip install --quiet "maturin>=1.5,<2" pytest

# PyTorch, pinned to the version the GPU check runs (scripts/gpu-check.sh), and numpy
# (torch warns on import without it).
torch_spec="${SYMMPOOL_CI_TORCH_SPEC:-torch==2.11.0}"
if [ "${SYMMPOOL_CI_TORCH:-1}" = 1 ]; then
    echo "== $torch_spec (CPU use; kept in $venv)"
    t0=$SECONDS
    "$venv/bin/python" -m pip install --quiet "$torch_spec" numpy
    "$venv/bin/python" -c "import torch, torch.distributed as d; assert d.is_gloo_available(); print('   torch', torch.__version__, '(gloo)')"
    echo "   torch install step: $((SECONDS - t0)) s"
    export SYMMPOOL_REQUIRE_TORCH=1
else
    echo "== no torch (SYMMPOOL_CI_TORCH=0): the torch tests are skipped"
    export SYMMPOOL_REQUIRE_TORCH=0
fi

profile=()
if [ "${SYMMPOOL_CI_RELEASE:-0}" = 1 ]; then profile=(--release); fi
echo "== maturin build ${profile[*]:-(debug)}"
(cd "$here" && "$venv/bin/maturin" build "${profile[@]}" --interpreter "$venv/bin/python" --out "$wheels")

echo "== the C functions are exported"
whl="$(ls "$wheels"/symmpool-*.whl | head -n1)"
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$whl"
so="$("$venv/bin/python" -c 'import symmpool._ext as e; print(e.__file__)')"
for sym in symmpool_alloc symmpool_free PyInit__ext; do
    if command -v nm >/dev/null; then
        nm -D --defined-only "$so" | grep -qw "$sym" || { echo "missing symbol $sym in $so"; exit 1; }
    fi
done
echo "   $(basename "$whl"): symmpool_alloc, symmpool_free exported"

echo "== cargo test: the binding's unit tests (errors' attributes and words) and PyTorch's snapshot format (python/src/torch.rs)"
(cd "$root" && PYO3_PYTHON="$venv/bin/python" cargo test -p symmpool-python --lib --test torch_snapshot)

echo "== pytest (SYMMPOOL_REQUIRE_TORCH=$SYMMPOOL_REQUIRE_TORCH)"
cd "$root"
set +e
"$venv/bin/python" -m pytest -ra -q python/tests
rc=$?
set -e
# pytest exits 5 when no test ran at all (everything skipped or deselected): not a failure.
if [ "$rc" = 5 ]; then
    echo "no test ran (all skipped): ok"
    rc=0
fi
exit "$rc"
