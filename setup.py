"""Builds the C kernels of the CPU path (engine/ops/cpu/kernels.c) through cffi.

Everything else about the package is in pyproject.toml. The extension is optional: where
it does not compile, the package installs without it and the engine runs the torch
reference ops instead (engine.ops.get_ops says which). Two things keep that from hiding a
broken build: a failed build removes the library an earlier build left beside the source
(an editable install's), so the old binary does not go on running in place of an edited
kernel that no longer compiles; and with ``ENGINE_REQUIRE_KERNELS=1`` in the environment (the Makefile
sets it) the failure stops the install.
"""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "engine" / "ops" / "cpu"))
from _build import ffibuilder  # noqa: E402

REQUIRE_ENV = "ENGINE_REQUIRE_KERNELS"


class BuildKernels(build_ext):
    def build_extension(self, ext):
        if os.environ.get(REQUIRE_ENV) == "1":
            ext.optional = False
        try:
            super().build_extension(ext)
        except Exception:
            # The library beside the source (where an editable install puts the one the
            # engine imports) no longer matches it.
            stale = HERE / self.get_ext_filename(ext.name)
            if stale.exists():
                stale.unlink()
                self.warn(f"removed {stale}: it was built from an earlier source")
            raise


extension = ffibuilder.distutils_extension(tmpdir="build/cffi")
extension.optional = True
setup(ext_modules=[extension], cmdclass={"build_ext": BuildKernels})
