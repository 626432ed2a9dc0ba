"""IncrementalDetokenizer streams exactly the text of a full decode, and stops cleanly.

The oracle is ``Tokenizer.decode`` of all output ids at once (itself checked against
transformers in test_tokenizer.py), and, for stop strings, that text cut at the first stop
string to complete.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from text_fixtures import TEXTS, smollm2_folder, tiny_folder

from engine.core.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from engine.errors import InvalidParamError
from engine.models.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@functools.cache
def _load(folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _load(smollm2_folder(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _load(tiny_folder(tmp_path_factory.getbasetemp()))


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue("tiny" if request.param == "tiny" else "smol")


def _prompt(tok: Tokenizer) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None
) -> list[DetokenizerUpdate]:
    """Push ``ids`` in pieces of the given sizes (one by one by default), then finish."""
    updates, i = [], 0
    for size in chunks or [1] * len(ids):
        updates.append(detok.push(ids[i : i + size]))
        i += size
    assert i >= len(ids)
    updates.append(detok.finish())
    return updates


def _text(updates: Sequence[DetokenizerUpdate]) -> str:
    return "".join(u.text for u in updates)


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while sum(chunks) < n:
        chunks.append(rng.randint(1, 4))  # a step yields 1 token; more with async/spec decoding
    return chunks


# -- text equals the full decode --------------------------------------------------------


def test_streamed_text_equals_full_decode_and_never_holds_half_a_character(
    tok: Tokenizer,
) -> None:
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        updates = _stream(IncrementalDetokenizer(tok, _prompt(tok), skip_special_tokens=False), ids)
        assert _text(updates) == tok.decode(ids, skip_special_tokens=False) == text
        assert not any(REPLACEMENT in u.text for u in updates), text
        assert not any(u.stopped for u in updates)


def test_emoji_split_across_tokens_is_emitted_whole(smol: Tokenizer) -> None:
    text = "I feel 😀 and 👩‍👩‍👧 today"
    ids = smol.encode(text)
    # Precondition: the tokenizer really does cut the emoji into byte pieces.
    assert any(smol.decode([i]).endswith(REPLACEMENT) for i in ids)
    detok = IncrementalDetokenizer(smol, _prompt(smol))
    seen = ""
    for i in ids:
        update = detok.push([i])
        assert REPLACEMENT not in update.text
        seen += update.text
        # Everything sent so far is a prefix of the final text.
        assert text.startswith(seen)
    assert seen + detok.finish().text == text
    assert "😀" in seen  # sent as soon as complete, not only at finish


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_equal_full_decode(
    tok: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    specials = sorted(tok.skipped_special_ids)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        # Sprinkle special tokens so skipping them is exercised mid-stream.
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tok, _prompt(tok), skip_special_tokens=skip_special_tokens)
        updates = _stream(detok, ids, _random_chunks(rng, len(ids)))
        assert _text(updates) == expected, ids
        # Nothing sent mid-stream is ever revised by what follows.
        sent = ""
        for u in updates:
            sent += u.text
            assert expected.startswith(sent), ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_in_output_follow_skip_special_tokens(
    tok: Tokenizer, skip_special_tokens: bool
) -> None:
    ids = tok.encode("Hello<|im_end|><|im_start|>world<|endoftext|>", add_special_tokens=False)
    updates = _stream(
        IncrementalDetokenizer(tok, _prompt(tok), skip_special_tokens=skip_special_tokens), ids
    )
    expected = (
        "Helloworld" if skip_special_tokens else "Hello<|im_end|><|im_start|>world<|endoftext|>"
    )
    assert _text(updates) == expected == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_empty_prompt_and_empty_pushes(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push([]) == DetokenizerUpdate("")
    ids = tok.encode(" leading space kept")
    assert _text(_stream(detok, ids)) == " leading space kept"


def test_each_push_decodes_a_bounded_window(smol: Tokenizer) -> None:
    # A long output with emoji and runs of skipped special tokens: if any step decoded
    # the whole output so far, the longest window would grow with the output.
    piece = smol.encode("Some text 😀 with emoji 🎉 and more words. ")
    specials = [2] * 20  # <|im_end|>, dropped when skipping special tokens
    ids = (piece + specials) * 40
    recording = _RecordingTokenizer(smol)
    detok = IncrementalDetokenizer(recording, list(range(100)))  # type: ignore[arg-type]
    assert _text(_stream(detok, ids)) == smol.decode(ids)
    assert len(ids) > 1000
    assert max(map(len, recording.calls)) <= 10  # prompt context (5) + an emoji's byte tokens



class _CountingSet(frozenset):
    """A frozenset that counts its membership tests."""

    lookups = 0

    def __contains__(self, item: object) -> bool:
        type(self).lookups += 1
        return super().__contains__(item)


class _RecordingTokenizer:
    """Wraps a Tokenizer: records each decode call's ids, counts special-id lookups."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.skipped_special_ids = _CountingSet(inner.skipped_special_ids)
        self.calls: list[list[int]] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(list(ids))
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_request_that_ends_without_tokens_never_decodes(smol: Tokenizer) -> None:
    # A pooling request's one delta carries no token; nor does a request aborted before
    # its first: neither has text, so neither should pay for decoding the prompt.
    recording = _RecordingTokenizer(smol)
    detok = IncrementalDetokenizer(recording, _prompt(smol))  # type: ignore[arg-type]
    assert detok.push([]) == DetokenizerUpdate("")
    assert detok.finish() == DetokenizerUpdate("")
    assert recording.calls == []


@pytest.mark.parametrize("skip", [True, False])
def test_the_prompt_context_is_its_last_kept_tokens_read_from_the_end(
    smol: Tokenizer, skip: bool
) -> None:
    rng = random.Random(7)
    special = sorted(smol.skipped_special_ids)
    words = smol.encode(" the cat sat on a mat", add_special_tokens=False)
    # 100,000 prompt ids ending in a run of special tokens between words.
    prompt = [rng.choice(words) for _ in range(100_000)]
    prompt[-12:] = [words[0], special[0], words[1], special[0], special[-1], words[2],
                    special[0], words[3], special[-1], special[-1], words[4], special[0]]
    recording = _RecordingTokenizer(smol)
    _CountingSet.lookups = 0
    detok = IncrementalDetokenizer(recording, prompt, skip_special_tokens=skip)  # type: ignore[arg-type]
    out = smol.encode(" and slept", add_special_tokens=False)
    assert _text(_stream(detok, out)) == smol.decode(out, skip_special_tokens=skip)
    # The oracle: the prompt with skipped specials dropped, its last five ids (all of the
    # prompt's ids kept when specials are not skipped).
    kept = [i for i in prompt if not (skip and i in set(special))]
    # The window decoded alone (the prefix text), and under the first output token.
    assert kept[-5:] in recording.calls
    assert recording.calls[0][:5] == kept[-5:]
    # Reading from the end: a dozen lookups for the prompt, not one for each of its ids.
    assert _CountingSet.lookups < 100


# -- stop strings -----------------------------------------------------------------------


def _expected_stop(
    text: str, stops: Sequence[str], include: bool, protected: int = 0
) -> tuple[str, str | None]:
    """The spec: cut at the stop string that completes first (the longest on a tie),
    counting only matches that end after the first ``protected`` characters (min_tokens)."""
    found = [(text.find(s, max(0, protected - len(s) + 1)), s) for s in stops]
    hits = [(start + len(s), start, s) for start, s in found if start >= 0]
    if not hits:
        return text, None
    end, start, stop = min(hits)
    return (text[:end] if include else text[:start]), stop


def _run_stop(
    tok: Tokenizer,
    text: str,
    stops: Sequence[str],
    include: bool,
    chunks: Sequence[int] | None = None,
) -> tuple[list[DetokenizerUpdate], list[int]]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tok, _prompt(tok), stop=stops, include_stop_str_in_output=include
    )
    return _stream(detok, ids, chunks), ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok: Tokenizer, include: bool) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    stop = "brown fox j"
    ids = tok.encode(text, add_special_tokens=False)
    assert not any(stop in tok.decode([i]) for i in ids)  # precondition: spans tokens
    updates, _ = _run_stop(tok, text, [stop], include)
    assert _text(updates) == ("The quick brown fox j" if include else "The quick ")
    stopped = [u for u in updates if u.stopped]
    assert stopped and all(u.stop_reason == stop for u in stopped)
    # The update that stops is the first one reporting it; nothing after it carries text.
    first = updates.index(stopped[0])
    assert all(u.text == "" for u in updates[first + 1 :])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_at_the_very_start(tok: Tokenizer, include: bool) -> None:
    updates, _ = _run_stop(tok, "Hello world", ["Hel"], include)
    assert _text(updates) == ("Hel" if include else "")
    assert all(u.text == "" for u in updates if not u.stopped)  # "H", "He" were held
    assert updates[-1].stopped and updates[-1].stop_reason == "Hel"


def test_possible_stop_start_is_held_until_disproved(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, _prompt(tok), stop=["\n\nEND"])
    sent = ""
    for i in tok.encode("line one\n\nEN", add_special_tokens=False):
        sent += detok.push([i]).text
    assert sent == "line one"  # "\n\nEN" could still become the stop string
    sent += detok.push(tok.encode("D", add_special_tokens=False)).text
    assert sent == "line one" and detok.stopped


def test_held_tail_is_released_when_disproved_or_finished(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, _prompt(tok), stop=["\n\nEND"])
    sent = "".join(detok.push([i]).text for i in tok.encode("a\n\nEN", add_special_tokens=False))
    assert sent == "a"
    sent += detok.push(tok.encode("ough", add_special_tokens=False)).text
    assert sent == "a\n\nENough"
    sent += "".join(detok.push([i]).text for i in tok.encode(" done\n", add_special_tokens=False))
    assert sent == "a\n\nENough done"
    final = detok.finish()
    assert sent + final.text == "a\n\nENough done\n" and not final.stopped


def test_first_stop_to_complete_wins(tok: Tokenizer) -> None:
    # "fox" completes before "quick brown fox jumps" would; "row" completes before "fox".
    updates, _ = _run_stop(
        tok, "The quick brown fox jumps", ["fox", "quick brown fox jumps", "row"], False
    )
    assert _text(updates) == "The quick b"
    assert updates[-1].stop_reason == "row"


def test_push_after_stop_returns_no_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, _prompt(tok), stop=["o"])
    first = detok.push(tok.encode("Hello world", add_special_tokens=False))
    assert first == DetokenizerUpdate("Hell", stopped=True, stop_reason="o")
    assert detok.push(tok.encode(" more")) == DetokenizerUpdate("", True, "o")
    assert detok.finish() == DetokenizerUpdate("", True, "o")


def test_stop_string_made_of_a_special_token(tok: Tokenizer) -> None:
    ids = tok.encode("answer<|im_end|>junk", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tok, _prompt(tok), skip_special_tokens=False, stop=["<|im_end|>"]
    )
    assert _text(_stream(detok, ids)) == "answer"


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_match_the_spec_and_never_leak(tok: Tokenizer, include: bool) -> None:
    rng = random.Random(99)
    alphabet = ["a", "b", " ", "\n", "é", "😀", "ab", "the "]
    for _ in range(120):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7 and text:  # a substring of the text: it will match
                i = rng.randrange(len(text))
                stops.append(text[i : i + rng.randint(1, 6)])
            else:
                stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))))
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        expected, reason = _expected_stop(full, stops, include)
        updates, _ = _run_stop(tok, text, stops, include, _random_chunks(rng, len(ids)))
        sent = ""
        for u in updates:
            sent += u.text
            assert expected.startswith(sent), (text, stops)  # no text past the stop, ever
        assert sent == expected, (text, stops)
        assert updates[-1].stopped == (reason is not None)
        assert updates[-1].stop_reason == reason


def test_min_tokens_keeps_a_stop_string_from_ending_their_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world", add_special_tokens=False)
    shield = next(k for k in range(1, len(ids) + 1) if "Hello" in tok.decode(ids[:k]))
    detok = IncrementalDetokenizer(tok, _prompt(tok), stop=["o"], min_tokens=shield)
    assert _text(_stream(detok, ids)) == "Hello w"  # the "o" of "Hello" did not stop it
    assert detok.stopped


def test_a_stop_string_that_starts_in_the_min_tokens_text_and_ends_after_it_stops(
    tok: Tokenizer,
) -> None:
    ids = tok.encode("Hello world", add_special_tokens=False)
    shield = next(k for k in range(1, len(ids) + 1) if "Hello" in tok.decode(ids[:k]))
    detok = IncrementalDetokenizer(tok, _prompt(tok), stop=["lo w"], min_tokens=shield)
    assert _text(_stream(detok, ids)) == "Hel"
    assert detok.stopped


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_respect_min_tokens(tok: Tokenizer, include: bool) -> None:
    rng = random.Random(5)
    alphabet = ["a", "b", " ", "\n", "é", "😀", "ab", "the "]
    for _ in range(120):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        ids = tok.encode(text, add_special_tokens=False)
        min_tokens = rng.randint(0, len(ids))
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 6)])
        full = tok.decode(ids)
        # The text of the first min_tokens ids; an unfinished character is not text yet.
        protected = len(tok.decode(ids[:min_tokens]).rstrip(REPLACEMENT)) if min_tokens else 0
        expected, reason = _expected_stop(full, stops, include, protected)
        detok = IncrementalDetokenizer(
            tok, _prompt(tok), stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens
        )
        updates = _stream(detok, ids, _random_chunks(rng, len(ids)))
        sent = ""
        for u in updates:
            sent += u.text
            assert expected.startswith(sent), (text, stops, min_tokens)
        assert sent == expected, (text, stops, min_tokens)
        assert updates[-1].stop_reason == reason


@pytest.mark.parametrize("stop", [[""], [None], [3]])
def test_invalid_stop_raises(tiny: Tokenizer, stop: list[object]) -> None:
    with pytest.raises(InvalidParamError) as info:
        IncrementalDetokenizer(tiny, [], stop=stop)  # type: ignore[arg-type]
    assert info.value.param == "stop"


def test_a_40000_character_stop_string_costs_linear_memory(tiny: Tokenizer) -> None:
    # Regression: every prefix of every stop string was stored (~800 MB for 40,000
    # characters; an 80 KB one ended in MemoryError). SamplingParams now caps stop strings
    # at 512 characters; the matcher itself stays linear whatever it is given.
    import tracemalloc

    ids = tiny.encode("xx" + "ab" * 30, add_special_tokens=False)
    tail = tiny.encode("c", add_special_tokens=False)
    tracemalloc.start()
    try:
        det = IncrementalDetokenizer(tiny, [], stop=["ab" * 20_000])
        sent = "".join(det.push([i]).text for i in ids)
        after = det.push(tail).text + det.finish().text
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The "ab" run is held back while it could still grow into the stop string.
    assert sent == "xx" and after == "ab" * 30 + "c"
    assert peak < 2_000_000
