"""setup.py's build of the C kernels when the source no longer compiles: the library an
earlier in-place build left is removed (else the engine would import the old binary and
run it as if the edit were in), and with ENGINE_REQUIRE_KERNELS=1, as the Makefile
installs, the build fails instead of installing without the kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["_build.py", "kernels.c", "quant.c", "fused.c", "fused.h", "simd.h"]


@pytest.fixture
def broken_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of setup.py and the kernels' sources with kernels.c broken, and a stale
    library where an in-place build puts the extension."""
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")
    cpu = tmp_path / "engine" / "ops" / "cpu"
    cpu.mkdir(parents=True)
    for name in SOURCES:
        shutil.copy(REPO / "engine" / "ops" / "cpu" / name, cpu / name)
    kernels = cpu / "kernels.c"
    kernels.write_text("#error this edit does not compile\n" + kernels.read_text())
    stale = cpu / ("_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))
    stale.write_bytes(b"an earlier build")
    return tmp_path, stale


def _build(tree: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ENGINE_REQUIRE_KERNELS"} | env
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=environ,
                          capture_output=True, text=True, timeout=600)


def test_a_failed_build_removes_the_earlier_library(broken_tree) -> None:
    tree, stale = broken_tree
    done = _build(tree)
    assert done.returncode == 0, done.stderr  # optional: the package installs without it
    assert "this edit does not compile" in done.stdout + done.stderr
    assert not stale.exists()


def test_required_kernels_fail_the_build(broken_tree) -> None:
    tree, stale = broken_tree
    done = _build(tree, ENGINE_REQUIRE_KERNELS="1")
    assert done.returncode != 0
    assert "this edit does not compile" in done.stdout + done.stderr
    assert not stale.exists()
