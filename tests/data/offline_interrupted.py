"""A script that is interrupted (SIGINT) in the middle of an ``engine.LLM`` batch, for
tests/test_offline.py: ``python offline_interrupted.py MODEL [ENGINE_CORE]``.

It prints ``running`` once the first prompt of the batch is done; on the interrupt it
prints, as JSON lines, the engine's statistics once its requests are gone (and a new
call's output length), then the threads and child processes left once the LLM is closed,
and lets KeyboardInterrupt end it as it would end any script.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

from engine import LLM, SamplingParams

PROMPTS = 40
# Each prompt but the first runs for this many tokens: the batch cannot finish before the
# test interrupts it (4 at a time, ~2,000 steps for all).
LONG = 200


class FirstDone:
    """A tqdm stand-in (``use_tqdm`` takes one) that says when the first prompt is done."""

    def __init__(self, **_: object) -> None:
        self.n = 0
        self.postfix = ""

    def update(self, count: int) -> None:
        self.n += count
        if self.n == 1:
            print("running", flush=True)

    def close(self) -> None:
        pass


def children() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended since the listing
            continue
    return pids


def main() -> None:
    options = {"engine_core": sys.argv[2]} if len(sys.argv) > 2 else {}
    llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              block_size=16, kv_cache_memory=4 * 1024 * 1024, **options)
    params = [SamplingParams(temperature=0, max_tokens=1 if i == 0 else LONG, ignore_eos=True)
              for i in range(PROMPTS)]
    prompts = [[5 + i, 6, 7, 8] for i in range(PROMPTS)]
    try:
        llm.generate(prompts, params, use_tqdm=FirstDone)
        print("finished", flush=True)
    except KeyboardInterrupt:
        # The aborted requests leave the scheduler before its next step.
        deadline = time.monotonic() + 30
        while True:
            stats = llm.statistics()
            idle = stats.running == 0 and stats.waiting == 0
            if idle and stats.kv_blocks_free == stats.kv_blocks_total:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # The LLM stays usable after an interrupted call.
        (again,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3,
                                                            ignore_eos=True), use_tqdm=False)
        print(json.dumps({"running": stats.running, "waiting": stats.waiting,
                          "kv_blocks_free": stats.kv_blocks_free,
                          "kv_blocks_total": stats.kv_blocks_total,
                          "requests_finished": stats.requests_finished,
                          "steps": stats.steps, "children": children(),
                          "again": len(again.outputs[0].token_ids)}), flush=True)
        llm.close()
        print(json.dumps({"threads": [[t.name, t.daemon] for t in threading.enumerate()],
                          "children": children()}), flush=True)
        raise


if __name__ == "__main__":
    main()
