"""The CPU op set's own error (engine.ops.cpu re-exports it)."""

from __future__ import annotations


class CpuKernelError(RuntimeError):
    """A C kernel refused its arguments (a position or block id out of range)."""


__all__ = ["CpuKernelError"]
