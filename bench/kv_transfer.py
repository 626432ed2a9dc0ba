"""The KV store (``--kv-transfer-config``, vLLM's folder connector): time to the first token
of a prompt computed, of the same prompt computed while its blocks are written to the
folder, and of the same prompt read back from the folder, in the same process and minutes.

    .venv/bin/python bench/kv_transfer.py [--model PATH] [--lengths 512 2048 4096] [--rounds 3]

Without ``--model``: the bundled SmolLM2-135M GGUF (its Q4_1 blocks kept). Two engines are
open side by side (steps never overlap: they share the process's model thread): one
without a store, one with ``kv_both`` on a temporary folder. Each round, for each prompt
length, alternating:

1. ``plain``: a prompt never seen, on the engine without a store: prefill and one token;
2. ``written``: another prompt never seen, on the engine with the store: the same work,
   and every full block written to the folder after the step (what a prefill engine,
   ``kv_producer``, pays);
3. ``read``: the prefix cache dropped (``reset_prefix_cache``), that prompt again: its
   blocks read from the folder and copied into the pool, the last partial block and one
   token computed (what a decode engine, ``kv_consumer``, pays, or an engine restarted).

The folder's files are fresh in the OS page cache, as on one machine right after the
prefill; a shared network folder adds its own transfer time. Printed: medians over the
rounds, ``written`` over ``plain`` (the cost of writing) and ``plain`` over ``read`` (how
much sooner the first token comes from the folder), and the folder's bytes per token.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from sleep_mode import first_token  # bench/'s: submit to the first (and only) token

import engine


def folder_size(folder: Path) -> tuple[int, int]:
    """The folder's block files and their bytes."""
    files = list(folder.rglob("*.kv"))
    return len(files), sum(f.stat().st_size for f in files)


def prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


async def main(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="kv-store-"))
    options: dict[str, Any] = dict(model=args.model, max_model_len=max(args.lengths) + 64)
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    rng = random.Random(0)
    times: dict[tuple[str, int], list[float]] = {}
    async with engine.open_engine(**options) as plain, \
            engine.open_engine(**options, kv_transfer_config=kv) as stored:
        vocab = args.vocab
        await first_token(plain, prompt(rng, 64, vocab))  # warm both
        await first_token(stored, prompt(rng, 64, vocab))
        for r in range(args.rounds):
            for length in args.lengths:
                t_plain = await first_token(plain, prompt(rng, length, vocab))
                shared = prompt(rng, length, vocab)
                t_written = await first_token(stored, shared)
                await stored.reset_prefix_cache()
                before = stored.statistics().external_prefix_cache_hits
                t_read = await first_token(stored, shared)
                hits = stored.statistics().external_prefix_cache_hits - before
                if hits != (length - 1) // 16 * 16:
                    sys.exit(f"expected the prompt's full blocks read, got {hits} tokens")
                for mode, t in (("plain", t_plain), ("written", t_written), ("read", t_read)):
                    times.setdefault((mode, length), []).append(t)
                print(f"round {r + 1} {length:5d} tokens: plain {t_plain * 1e3:8.1f} ms  written "
                      f"{t_written * 1e3:8.1f} ms  read {t_read * 1e3:7.1f} ms", flush=True)
    files, size = folder_size(folder)
    per_token = size / (files * 16)
    print(f"\nfolder: {files} blocks, {per_token / 1024:.1f} KiB a token ({folder})")
    print(f"\n{'tokens':>7} {'plain ms':>9} {'written ms':>11} {'read ms':>8} {'written/plain':>14} "
          f"{'plain/read':>11}")
    for length in args.lengths:
        p, w, r = (statistics.median(times[(m, length)]) for m in ("plain", "written", "read"))
        print(f"{length:7d} {p * 1e3:9.1f} {w * 1e3:11.1f} {r * 1e3:8.1f} {w / p:13.2f}x {p / r:10.1f}x")
    shutil.rmtree(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=30000, help="prompt ids are drawn below this")
    trio.run(main, parser.parse_args())
