"""Suffix decoding (``--speculative-config`` method ``suffix``, vLLM's): proposals from the
request's own context and from earlier requests' answers.

The proposer against a brute-force reading of its rule (every occurrence of every suffix
looked up by scanning, the path walked by counting), over random corpora; the answers'
first-in first-out cache and the probability floor; the engine's tokens against
transformers' greedy ones, with proposals from an earlier answer accepted; and vLLM's keys."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest
from engine_helpers import collect, greedy, token_ids
from test_parity import _hf_greedy, _hf_model

import engine
from engine.config import EngineConfig
from engine.core.suffix import SuffixCache
from engine.errors import ConfigError
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _walk(live: list[tuple[list[int], int]], length: int, min_prob: float) -> tuple[tuple[int, ...], float]:
    """From the occurrences of a match, each (sequence, index after it): the path of the
    most common continuations while its probability holds, and its worth."""
    out: list[int] = []
    prob, expected = 1.0, 0.0
    while len(out) < length and live:
        counts = collections.Counter(seq[e] for seq, e in live if e < len(seq))
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        prob *= count / len(live)
        if prob < min_prob:
            break
        out.append(token)
        expected += prob
        live = [(seq, e + 1) for seq, e in live if e < len(seq) and seq[e] == token]
    return tuple(out), expected


def _reference(corpora: list[list[int]], context: list[int], k: int, depth: int, factor: float,
               min_prob: float, min_match: int, own: bool) -> tuple[tuple[int, ...], float]:
    """The rule by brute force: for every suffix of ``context`` (``min_match`` to
    ``depth - 1`` tokens, fewer than the context's), every occurrence found by scanning
    (in the context itself, not its own end), walked; the best worth, a longer match
    winning ties."""
    best: tuple[tuple[int, ...], float] = ((), 0.0)
    for m in range(min_match, min(depth - 1, len(context) - 1) + 1):
        suffix = context[-m:]
        last = len(context) - 1 if own else None
        occ = [(seq, e) for seq in corpora for e in range(m, (last or len(seq)) + 1)
               if seq[e - m:e] == suffix]
        if not occ:
            break
        walk = _walk(occ, min(k, int(factor * m + 1e-6), depth - m), min_prob)
        if walk[1] >= best[1]:
            best = walk
    return best


@pytest.mark.parametrize("seed", range(6))
def test_proposals_follow_the_rule_over_random_corpora(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])  # small vocabularies: many repeats, ties and long matches
    depth, factor, min_prob = rng.choice([(8, 1.0, 0.1), (12, 2.0, 0.3), (24, 0.5, 0.0)])
    cache = SuffixCache(depth, 1000, factor, min_prob)
    answers = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    for answer in answers:
        cache.add_answer(answer)
    proposed = 0
    for _ in range(40):
        context = [rng.randrange(vocab) for _ in range(rng.randint(2, 30))]
        k = rng.randint(1, 16)
        own = _reference([context], context, k, depth, factor, min_prob, 1, own=True)
        other = _reference(answers, context, k, depth, factor, min_prob, 2, own=False)
        expected = own[0] if own[1] >= other[1] else other[0]
        assert cache.propose(context, k) == expected, (context, k)
        proposed += bool(expected)
    assert proposed >= 20  # the corpora are small and repetitive: most contexts match


def test_the_answers_are_kept_first_in_first_out_and_a_weak_path_is_not_proposed() -> None:
    cache = SuffixCache(24, 2, 4.0, 0.5)
    cache.add_answer([1, 2, 3, 4, 5, 6])
    assert cache.propose([9, 9, 2, 3], 8) == (4, 5, 6)
    cache.add_answer([7, 8, 9, 10])
    cache.add_answer([11, 12, 13, 14])  # the third: the first goes
    assert len(cache) == 2 and cache.propose([9, 9, 2, 3], 8) == ()
    # Two answers go on differently after (20, 21): each way has probability 1/2.
    split = SuffixCache(24, 10, 4.0, 0.5)
    split.add_answer([20, 21, 30, 31])
    split.add_answer([20, 21, 40, 41])
    assert len(split.propose([5, 20, 21], 4)) == 2  # 1/2, then 1/2 x 1 for the next
    stricter = SuffixCache(24, 10, 4.0, 0.6)
    stricter.add_answer([20, 21, 30, 31])
    stricter.add_answer([20, 21, 40, 41])
    assert stricter.propose([5, 20, 21], 4) == ()
    off = SuffixCache(24, 0, 4.0, 0.1)  # no answers kept: the context alone
    off.add_answer([1, 2, 3, 4, 5, 6])
    assert len(off) == 0 and off.propose([9, 2, 3], 4) == ()


def test_vllms_keys() -> None:
    spec = EngineConfig(speculative_config={"method": "suffix"}).speculative
    assert (spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    given = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32,
             "suffix_decoding_max_cached_requests": 100, "suffix_decoding_max_spec_factor": 2.0,
             "suffix_decoding_min_token_prob": 0.05}
    spec = EngineConfig(speculative_config=json.dumps(given)).speculative
    assert json.loads(spec.to_json()) == given
    for bad in ({"suffix_decoding_max_tree_depth": 1}, {"suffix_decoding_min_token_prob": 1.5},
                {"suffix_decoding_max_spec_factor": 0}, {"suffix_decoding_max_cached_requests": -1},
                {"prompt_lookup_max": 4}):
        with pytest.raises(ConfigError, match=next(iter(bad))) as info:
            EngineConfig(speculative_config={"method": "suffix", **bad})
        assert info.value.field == "speculative_config"


async def test_answers_match_transformers_and_an_earlier_answer_is_proposed(tmp_path: Path) -> None:
    """The same prompt twice: the second request's proposals come from the first's answer
    (the cache off, the context alone proposes less), and every answer is transformers'
    greedy one."""
    folder = write_tiny_model(tmp_path / "llama", "llama")
    hf = _hf_model(folder)
    prompt = [(13 * i + 7) % 250 + 3 for i in range(40)]
    expected = _hf_greedy(hf, prompt, 40)[0]
    accepted = {}
    for cached in (0, 100):
        spec = {"method": "suffix", "suffix_decoding_max_cached_requests": cached}
        async with engine.open_engine(model=str(folder), dtype="float32", speculative_config=spec) as eng:
            assert token_ids(await collect(eng, prompt, greedy(40))) == expected
            before = eng.statistics().spec_accepted_tokens
            assert token_ids(await collect(eng, prompt, greedy(40))) == expected
            accepted[cached] = eng.statistics().spec_accepted_tokens - before
    assert accepted[100] > accepted[0]
    assert accepted[100] >= 30  # most of the 39 tokens after the first come proposed


def test_after_many_evictions_only_the_kept_answers_propose() -> None:
    """Answers dropped first in first out (their index entries pruned on the way) leave
    the cache proposing exactly as one that only ever saw the kept ones."""
    rng = random.Random(7)
    answers = [[rng.randrange(6) for _ in range(rng.randint(3, 30))] for _ in range(200)]
    churned, fresh = SuffixCache(12, 3, 2.0, 0.1), SuffixCache(12, 3, 2.0, 0.1)
    for answer in answers:
        churned.add_answer(answer)
    for answer in answers[-3:]:
        fresh.add_answer(answer)
    assert len(churned) == 3
    for _ in range(50):
        context = [rng.randrange(6) for _ in range(rng.randint(2, 20))]
        assert churned.propose(context, 8) == fresh.propose(context, 8)
