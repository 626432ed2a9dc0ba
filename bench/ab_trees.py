"""Run one benchmark against two source trees of the engine, alternated, in the same minutes.

    python bench/ab_trees.py --trees before=/path/to/old,after=. --rounds 3 \\
        --pattern 'gguf .* 1 +([0-9.]+)' -- bench/decode.py --batches 1 --no-hf

Each round runs the command once per tree, in the order given, as ``python TREE/SCRIPT
ARGS...`` with ``PYTHONPATH=TREE`` and the tree as the working directory, so each tree runs
its own benchmark script against its own ``engine`` package (a refactor may move the
modules a script imports). The C kernels are not rebuilt: each tree needs its own compiled
``engine/ops/cpu/_kernels*.so`` (copy it from an installed tree when the C sources are the
same). Servers a benchmark launches inherit ``PYTHONPATH`` and so run that tree too.

Alternating cancels the slow drift of a shared machine; comparing the two trees' figures
round by round says whether they differ by more than the machine's own noise. With
``--pattern`` (a regular expression with one group per figure) each run's figures are
pulled from its output and a table of every round and the median per tree is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(tree: Path, command: list[str]) -> str:
    script, *rest = command
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(tree / script), *rest], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(command)} exited {done.returncode}\n"
                         f"{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="NAME=DIR,NAME=DIR")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pattern", default=None,
                   help="a regex whose groups are the figures to collect from each run's output")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no benchmark command given")
    trees = [(name, Path(where).resolve()) for name, _, where in
             (item.partition("=") for item in args.trees.split(","))]
    pattern = re.compile(args.pattern) if args.pattern else None
    figures: dict[str, list[list[float]]] = {name: [] for name, _ in trees}
    for round_ in range(1, args.rounds + 1):
        for name, tree in trees:
            out = run_once(tree, command)
            print(f"=== round {round_}, {name} ({tree})\n{out.rstrip()}", flush=True)
            if pattern is not None:
                found = [float(g) for m in pattern.finditer(out) for g in m.groups()]
                figures[name].append(found)
    if pattern is not None:
        print("\nfigures per round (pattern groups in output order):")
        for name, rows in figures.items():
            for i, row in enumerate(rows, 1):
                print(f"  {name:>10} round {i}: " + "  ".join(f"{x:.1f}" for x in row))
        print("median per figure:")
        medians = {}
        for name, rows in figures.items():
            width = min((len(r) for r in rows), default=0)
            medians[name] = [statistics.median(r[i] for r in rows) for i in range(width)]
            print(f"  {name:>10}: " + "  ".join(f"{x:.1f}" for x in medians[name]))
        first, *others = medians
        for other in others:
            ratios = [b / a if a else float("nan")
                      for a, b in zip(medians[first], medians[other], strict=False)]
            print(f"  {other}/{first}: " + "  ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
