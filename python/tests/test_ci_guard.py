"""CI's guard against torch tests that pass by being skipped: with
``SYMMPOOL_REQUIRE_TORCH=1`` (``python/ci.sh`` sets it) a skip in the torch test files
(``conftest.TORCH_TESTS``) is a failure. Checked here on a Python where torch cannot
be imported (a ``torch`` package that raises ModuleNotFoundError first on the path)."""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def _pytest_without_torch(tmp_path, require):
    blocked = tmp_path / "torch"
    blocked.mkdir()
    (blocked / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\' (blocked)", name="torch")\n'
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env["SYMMPOOL_REQUIRE_TORCH"] = "1" if require else "0"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(HERE / "test_torch_cpu.py"), str(HERE / "test_fsdp_cpu.py")],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


def test_a_skipped_torch_test_fails_when_torch_is_required(tmp_path):
    out = _pytest_without_torch(tmp_path, require=True)
    assert out.returncode not in (0, 5), out.stdout + out.stderr
    assert "SYMMPOOL_REQUIRE_TORCH=1 requires it to run" in out.stdout, out.stdout + out.stderr


def test_without_the_requirement_they_are_skipped(tmp_path):
    out = _pytest_without_torch(tmp_path, require=False)
    assert out.returncode in (0, 5), out.stdout + out.stderr
    assert "torch is not installed" in out.stdout, out.stdout + out.stderr
