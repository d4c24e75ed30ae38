#!/usr/bin/env bash
# CI for the Python package (no GPU, no torch needed): build the wheel with maturin,
# install it into a fresh virtual environment, run python/tests with pytest.
# Tests that need torch or CUDA are reported as skipped, with their reason.
# python/tests/test_shm_ranks.py runs python/examples/train_cpu.py as 4 processes
# (torchrun where torch is installed in the venv, `python -m symmpool.launch`
# otherwise), each job under a timeout, every rank killed when its launcher returns.
#
#   bash python/ci.sh                 # from the repository root (or anywhere)
#   PYTHON=python3.12 bash python/ci.sh
#   SYMMPOOL_CI_RELEASE=1 bash python/ci.sh   # build the release wheel instead
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

echo "== cargo test: PyTorch's snapshot format (python/src/torch.rs, no Python needed)"
(cd "$root" && cargo test -p symmpool-python --test torch_snapshot)

echo "== pytest"
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
