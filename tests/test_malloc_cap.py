"""The server's glibc arena cap (engine/process/malloc.py), seen through malloc_info.

Each case runs in a fresh interpreter: the cap must be set before the threads exist.
glibc's own report (``malloc_info``, one ``<heap nr=...>`` per arena) is the oracle.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, os, re, sys, tempfile, threading
from engine.process.malloc import cap_arenas
capped = cap_arenas() if sys.argv[1] == "cap" else False
barrier = threading.Barrier(8)
def churn():
    # 1 KiB blocks go to malloc (pymalloc keeps only objects of 512 bytes or less); the
    # barrier keeps every thread alive, holding its arena, until all have allocated.
    keep = [bytearray(1024) for _ in range(2000)]
    barrier.wait()
    del keep
threads = [threading.Thread(target=churn) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
text = open(path).read()
os.unlink(path)
print(capped, len(re.findall(r"<heap nr=", text)))
"""

pytestmark = pytest.mark.skipif(
    not (ctypes.util.find_library("c") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")),
    reason="arenas are glibc's")


def arenas(mode: str, **env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         env=environ, check=True).stdout.split()
    return out[0], int(out[1])


def test_cap_holds_threads_to_two_arenas() -> None:
    assert arenas("cap") == ("True", 2)


def test_without_the_cap_threads_spread_over_more_arenas() -> None:
    # The case the cap is for: this is what a server's threads do uncapped.
    capped, count = arenas("none")
    assert capped == "False" and count > 2


def test_environment_wins_over_the_cap() -> None:
    assert arenas("cap", MALLOC_ARENA_MAX="4") == ("False", 4)
