"""The startup heap kept out of the full collections (engine/process/heap.py), seen through
the collector's own accounting (``gc.get_objects``, ``gc.get_freeze_count``, a weakref's
callback). Each case runs in a fresh interpreter: freezing is process-wide, and pytest's
own heap must not be frozen by a test."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import gc, sys, weakref
from engine.process.heap import frozen_startup_heap

class Node:
    pass

if sys.argv[1] == "outer":
    gc.freeze()  # frozen before: the block must leave it so
startup = [Node() for _ in range(5000)]
ids = {id(n) for n in startup}
def tracked():
    return sum(id(o) in ids for o in gc.get_objects())
print("before", tracked())
with frozen_startup_heap() as count:
    print("frozen", count >= 5000, tracked())
    # Cyclic garbage made while frozen is still collected.
    a = Node(); a.self = a
    died = []
    ref = weakref.ref(a, lambda _: died.append(True))
    del a
    gc.collect()
    print("cycle", bool(died))
print("after", gc.get_freeze_count() > 0, tracked())
"""


def run(mode: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()}


def test_the_startup_objects_leave_the_collector_and_come_back() -> None:
    seen = run("plain")
    assert seen["before"] == ["5000"]
    assert seen["frozen"] == ["True", "0"]  # none left where a full collection walks
    assert seen["cycle"] == ["True"]
    assert seen["after"] == ["False", "5000"]


def test_a_heap_frozen_before_stays_frozen() -> None:
    seen = run("outer")
    assert seen["frozen"] == ["True", "0"] and seen["cycle"] == ["True"]
    assert seen["after"] == ["True", "0"]
