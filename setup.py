"""Builds the C kernels of the CPU path (engine/ops/cpu/kernels.c) through cffi.

Everything else about the package is in pyproject.toml. The extension is optional: where
it does not compile, the package installs without it and the engine runs the torch
reference ops instead (engine.ops.get_ops says which).
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine" / "ops" / "cpu"))
from _build import ffibuilder  # noqa: E402

extension = ffibuilder.distutils_extension(tmpdir="build/cffi")
extension.optional = True
setup(ext_modules=[extension])
