"""The encoder budget: a step encodes at most ``max_num_encoder_input_tokens`` image
placeholder tokens, never part of an image, and a chunk whose next image cannot be encoded
this step stops before that image's placeholders. The scheduler is driven against a real
BlockPool; the images are ImageInput messages with no pixels (the scheduler never reads
them)."""

from __future__ import annotations

from engine.core import BlockPool, Scheduler, SchedulerConfig, run_with_pool
from engine.messages import ImageInput, SampledToken, SchedulerRequest, StepPlan, StepResult
from engine.params import SamplingParams

IMAGE_ID = 9  # the placeholder token; the images' keys tell them apart


def _setup(*, budget: int, encoder: int, blocks: int = 64, caching: bool = True):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, block_size=4,
                             max_model_len=1024, num_kv_blocks=blocks,
                             enable_prefix_caching=caching, max_num_encoder_input_tokens=encoder)
    return Scheduler(config), BlockPool(blocks, 4, enable_prefix_caching=caching)


def _add(sched: Scheduler, rid: str, base: int,
         layout: list[int | tuple[int, int] | list[int]]) -> None:
    """``layout``: text runs (a count of tokens, or the tokens) and images ``(key,
    length)`` in order."""
    prompt: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, list):
            prompt += part
        elif isinstance(part, tuple):
            key, length = part
            images.append(ImageInput(len(prompt), length, key, b"", (0,)))
            prompt += [IMAGE_ID] * length
        else:
            prompt += range(base + len(prompt), base + len(prompt) + part)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    sched.add_request(SchedulerRequest(rid, tuple(prompt), params, (0,), 4, 0, 0.0, None, None,
                                       images=tuple(images)))


def _step(sched: Scheduler, pool: BlockPool) -> list[tuple[str, int, int]]:
    plan: StepPlan = run_with_pool(sched.schedule(), pool)
    sampled = tuple(SampledToken(c.sample_id, 5, -0.5, ()) for c in plan.chunks if c.sample)
    update = sched.update_from_output(plan, StepResult(plan.step_id, sampled, 0.0))
    for call in update.allocator_calls:
        pool.handle(call)
    return [(c.sample_id, c.start, c.num_tokens) for c in plan.chunks]


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take() -> None:
    sched, pool = _setup(budget=64, encoder=6)
    _add(sched, "a", 1000, [3, (1, 6), 2])
    _add(sched, "b", 2000, [5, (2, 6), 2])
    # a's image spends the step's encoder budget: b runs its text up to its image.
    assert _step(sched, pool) == [("a", 0, 11), ("b", 0, 5)]
    assert _step(sched, pool) == [("a", 11, 1), ("b", 5, 8)]


def test_two_images_of_one_prompt_go_one_per_step_when_only_one_fits() -> None:
    sched, pool = _setup(budget=64, encoder=6)
    _add(sched, "a", 1000, [2, (1, 6), 1, (2, 6), 3])
    assert _step(sched, pool) == [("a", 0, 9)]
    assert _step(sched, pool) == [("a", 9, 9)]


def test_an_image_split_across_chunks_is_encoded_once_so_its_rest_costs_nothing() -> None:
    # a's image straddles the token budget's cut: its second chunk finds the encoder
    # output held by the runner, so b's image is encoded beside it in the same step.
    sched, pool = _setup(budget=8, encoder=6)
    _add(sched, "a", 1000, [4, (1, 6), 2])
    _add(sched, "b", 2000, [(2, 6), 1])
    assert _step(sched, pool) == [("a", 0, 8)]
    assert _step(sched, pool) == [("a", 8, 4), ("b", 0, 4)]
    # b's image is held (its chunk ended inside it) and its rest needs no encoder budget.
    assert _step(sched, pool) == [("a", 12, 1), ("b", 4, 3)]


def test_an_image_larger_than_the_budget_runs_alone() -> None:
    sched, pool = _setup(budget=64, encoder=4)
    _add(sched, "a", 1000, [1, (1, 6), 1])
    _add(sched, "b", 2000, [2, (2, 3), 1])
    assert _step(sched, pool) == [("a", 0, 8), ("b", 0, 2)]
    assert _step(sched, pool) == [("a", 8, 1), ("b", 2, 4)]


def test_the_same_image_in_two_requests_of_one_step_is_encoded_once() -> None:
    sched, pool = _setup(budget=64, encoder=6, caching=False)
    _add(sched, "a", 1000, [2, (7, 6), 1])
    _add(sched, "b", 2000, [3, (7, 6), 1])
    _add(sched, "c", 3000, [1, (8, 6), 1])
    assert _step(sched, pool) == [("a", 0, 9), ("b", 0, 10), ("c", 0, 1)]


def test_the_budget_defaults_to_the_token_budget() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
                             max_model_len=1024, num_kv_blocks=16)
    assert config.encoder_budget == 32
    sched, pool = Scheduler(config), BlockPool(16, 4)
    _add(sched, "a", 1000, [1, (1, 20), 1])
    _add(sched, "b", 2000, [1, (2, 20), 1])
    assert _step(sched, pool) == [("a", 0, 22), ("b", 0, 1)]


def test_blocks_are_shared_up_to_an_image_only_when_the_image_is_the_same() -> None:
    """The prefix cache keys an image's placeholders by its content hash: the same text
    with another image shares only the blocks wholly before the image, the same image
    every full block (the pool's own tables are the oracle)."""
    sched, pool = _setup(budget=64, encoder=64)
    layout = [6, (1, 8), 5]  # blocks of 4: [0, 4) is text only, the image is 6..14
    _add(sched, "a", 1000, layout)
    while sched.get_request("a") is not None:
        _step(sched, pool)
    for rid, key in (("other", 2), ("same", 1)):
        _add(sched, rid, 1000, [6, (key, 8), 5])
        _step(sched, pool)
    table = {rid: pool.block_table(rid) for rid in ("other", "same")}
    assert sched.get_request("other").num_cached_tokens == 4
    assert sched.get_request("same").num_cached_tokens == 16  # 4 full blocks of 19 tokens
    assert set(table["other"]).isdisjoint(table["same"][1:])
    assert table["other"][0] == table["same"][0]


def test_a_prefix_hit_ending_inside_an_image_pays_for_the_image() -> None:
    """A cache hit can end inside an image (its later blocks hold other text): the runner
    has no encoder output for it, so the rest of the image needs the encoder budget; with
    none left this step, the request holds its blocks and starts in the next step."""
    sched, pool = _setup(budget=64, encoder=8)
    _add(sched, "a", 0, [[1, 2], (1, 8), [3, 4]])
    while sched.get_request("a") is not None:
        _step(sched, pool)
    _add(sched, "c", 3000, [1, (3, 8), 1])
    _add(sched, "b", 0, [[1, 2], (1, 8), [5, 6, 7]])  # blocks [0, 4) and [4, 8) are a's
    assert _step(sched, pool) == [("c", 0, 10)]
    assert sched.get_request("b").num_computed_tokens == 8
    assert _step(sched, pool) == [("c", 10, 1), ("b", 8, 5)]
