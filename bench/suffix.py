"""Suffix decoding (``--speculative-config`` method ``suffix``) on requests that come back:
decode speed without speculation, with prompt lookup (``ngram``) and with ``suffix``, in
the same process and minutes.

    .venv/bin/python bench/suffix.py [--model PATH] [--max-tokens 128] [--rounds 2]

Without ``--model``: the bundled SmolLM2-135M GGUF. Concurrency 1, greedy, through the
embedded engine's chat. Each round, for each engine in turn (``plain``, ``ngram`` with 4
tokens from 4..1-token suffixes, ``suffix`` at vLLM's defaults), eight questions are asked
twice: the first pass is what a request meets the first time (suffix decoding has only the
context to draw from), the second what an agent, an evaluation or a retry meets when the
same request comes back (the first answers are in suffix decoding's cache). Printed per
engine and pass (medians over the rounds): decode tokens/s (tokens after each answer's
first over the time after it, summed over the questions), the tokens proposed and the
share accepted; and every answer checked against the plain engine's (greedy: they must
be equal).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio

import engine
from engine.params import SamplingParams

QUESTIONS = [
    "Explain what a hash table is and how collisions are handled.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a process and a thread?",
    "Describe how HTTPS protects data in transit.",
    "Write a SQL query that finds the ten most recent orders per customer.",
    "Summarize the causes of the French Revolution in a few sentences.",
    "How does garbage collection work in Python?",
]

ENGINES = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 1},
    "suffix": {"method": "suffix"},
}


async def ask(eng: Any, question: str, max_tokens: int) -> tuple[list[int], float, int]:
    """One chat answer: its tokens, the seconds after its first token, and their count."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    stream = await eng.submit([{"role": "user", "content": question}], params)
    tokens: list[int] = []
    first = last = 0.0
    async with stream:
        async for out in stream:
            now = time.perf_counter()
            if not tokens:
                first = now
            tokens.extend(out.token_ids)
            last = now
    return tokens, last - first, len(tokens) - 1


async def main(args: argparse.Namespace) -> None:
    rows: dict[tuple[str, int], list[tuple[float, int, int]]] = {}
    answers: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name, spec in ENGINES.items():
            options = {} if spec is None else {"speculative_config": spec}
            async with engine.open_engine(model=args.model, **options) as eng:
                for pass_ in (1, 2):
                    before = eng.statistics()
                    seconds, tokens, got = 0.0, 0, []
                    for question in QUESTIONS:
                        ids, t, n = await ask(eng, question, args.max_tokens)
                        got.append(ids)
                        seconds, tokens = seconds + t, tokens + n
                    after = eng.statistics()
                    proposed = after.spec_draft_tokens - before.spec_draft_tokens
                    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
                    rows.setdefault((name, pass_), []).append((tokens / seconds, proposed, accepted))
                    reference = answers.setdefault(f"{pass_}", got) if name == "plain" else answers[f"{pass_}"]
                    same = got == reference
                    print(f"round {r + 1} {name:6s} pass {pass_}: {tokens / seconds:7.1f} tok/s, "
                          f"proposed {proposed:5d}, accepted {accepted:5d}, answers as plain: {same}",
                          flush=True)
                    await eng.reset_prefix_cache()
    print(f"\n{'engine':7s} {'pass':>4s} {'decode tok/s':>13s} {'vs plain':>9s} {'proposed':>9s} "
          f"{'accepted':>9s}")
    for pass_ in (1, 2):
        base = statistics.median(x[0] for x in rows[("plain", pass_)])
        for name in ENGINES:
            speed = statistics.median(x[0] for x in rows[(name, pass_)])
            proposed = statistics.median(x[1] for x in rows[(name, pass_)])
            accepted = statistics.median(x[2] for x in rows[(name, pass_)])
            share = f"{accepted / proposed:8.0%}" if proposed else "       -"
            print(f"{name:7s} {pass_:4d} {speed:13.1f} {speed / base:8.2f}x {proposed:9.0f} {share}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    trio.run(main, parser.parse_args())
