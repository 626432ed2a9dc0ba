"""The KV-block pool: reference counts, eviction order and a prefix cache that is verified,
never trusted on its hash. Model-based tests check the pool against a plain bookkeeping
model of which request holds which block and what each block's KV content is."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.core import BlockPool, ProtocolError
from engine.errors import RequestError
from engine.messages import (
    AllocateSlots,
    AllocationRefused,
    BlocksCached,
    BlocksReleased,
    CacheBlocks,
    FreeRequest,
    ReadAllocatorStats,
    ReleaseBlocks,
    RequestFreed,
    SlotsAllocated,
)

BS = 4  # small blocks so short token lists span several


def _allocate(pool: BlockPool, rid: str, tokens: tuple[int, ...], budget: int = 1000, salt: str | None = None):
    return pool.handle(AllocateSlots(rid, 0, len(tokens), budget, tokens, salt))


def _prefill_and_cache(pool: BlockPool, rid: str, tokens: tuple[int, ...], salt: str | None = None) -> tuple[int, ...]:
    """A request computes all of ``tokens`` and commits its full blocks."""
    reply = _allocate(pool, rid, tokens, salt=salt)
    assert isinstance(reply, SlotsAllocated)
    cached = reply.num_cached_tokens
    full = len(tokens) // BS * BS
    pool.handle(CacheBlocks(rid, tokens[cached:full]))
    return pool.block_table(rid)


def test_a_fresh_pool_is_all_free_and_rejects_bad_sizes() -> None:
    pool = BlockPool(8, BS)
    stats = pool.handle(ReadAllocatorStats())
    assert (stats.num_blocks, stats.num_free_blocks, stats.usage) == (8, 8, 0.0)
    assert pool.free_block_ids() == tuple(range(8))
    with pytest.raises(ValueError, match="num_blocks") as info:
        BlockPool(0, BS)
    assert not isinstance(info.value, RequestError)  # a caller's misuse, not a request's


def test_allocation_covers_the_chunk_and_refusal_changes_nothing() -> None:
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    reply = pool.handle(AllocateSlots("a", 0, 10, 6))
    assert reply == SlotsAllocated("a", 0, 6, (0, 1))  # 6 of 10 tokens: two blocks
    reply = pool.handle(AllocateSlots("a", 6, 10, 100))
    assert reply == SlotsAllocated("a", 0, 4, (2,))
    before = pool.free_block_ids()
    refused = pool.handle(AllocateSlots("b", 0, 9, 9))
    assert refused == AllocationRefused("b", 3, 1)
    assert pool.free_block_ids() == before and pool.block_table("b") == ()


def test_uncached_freed_blocks_are_reused_first_so_the_touched_set_stays_compact() -> None:
    # Without prefix caching a freed block holds nothing worth keeping: it goes back to the
    # head, and the never-used blocks 3..5 (pages maybe not yet resident) stay untouched.
    pool = BlockPool(6, BS, enable_prefix_caching=False)
    pool.handle(AllocateSlots("a", 0, 12, 12))  # blocks 0, 1, 2
    assert pool.handle(FreeRequest("a")) == RequestFreed("a", 3)
    assert pool.free_block_ids() == (0, 1, 2, 3, 4, 5)
    assert pool.handle(AllocateSlots("b", 0, 8, 8)).block_ids == (0, 1)


def test_cached_freed_blocks_join_the_tail_last_block_first_and_partial_ones_the_head() -> None:
    pool = BlockPool(8, BS)
    tokens = tuple(range(100, 110))  # two full blocks and a partial third
    table = _prefill_and_cache(pool, "a", tokens)
    assert table == (0, 1, 2)
    pool.handle(FreeRequest("a"))
    # Block 2 holds no cached tokens: reused first. The cached blocks are evicted last,
    # after every never-used block, the prefix's first block last of all.
    assert pool.free_block_ids() == (2, 3, 4, 5, 6, 7, 1, 0)
    assert pool.handle(AllocateSlots("b", 0, 8, 8)).block_ids == (2, 3)


def test_freeing_an_unknown_or_freed_request_is_a_no_op() -> None:
    pool = BlockPool(4, BS)
    pool.handle(AllocateSlots("a", 0, 5, 5))
    pool.handle(FreeRequest("a"))
    assert pool.handle(FreeRequest("a")) == RequestFreed("a", 0)
    assert pool.num_free_blocks == 4


def test_a_prefix_hit_shares_blocks_and_never_covers_the_last_token() -> None:
    pool = BlockPool(8, BS)
    tokens = tuple(range(100, 108))  # exactly two blocks
    table = _prefill_and_cache(pool, "a", tokens)
    reply = _allocate(pool, "b", tokens)
    # The second block holds the last token, whose logits must be computed again.
    assert reply.num_cached_tokens == 4 and reply.num_new_tokens == 4
    assert reply.block_ids[0] == table[0] and reply.block_ids[1] != table[1]
    assert pool.ref_count(table[0]) == 2
    stats = pool.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16, 4)


def test_released_blocks_go_back_to_the_pool_once_and_stay_reusable_when_cached() -> None:
    """Sliding windows: the first blocks of a long request are given back while it runs."""
    pool = BlockPool(8, BS)
    tokens = tuple(range(100, 116))  # four full blocks
    table = _prefill_and_cache(pool, "a", tokens)
    assert pool.handle(ReleaseBlocks("a", 2)) == BlocksReleased("a", 2)
    assert pool.num_free_blocks == 6 and pool.ref_count(table[0]) == 0
    assert pool.handle(ReleaseBlocks("a", 1)) == BlocksReleased("a", 2)  # never twice
    # Cached before their release, they still serve a prefix hit.
    assert pool.lookup(tokens) == table
    assert pool.handle(FreeRequest("a")) == RequestFreed("a", 4)  # frees only the other two
    assert pool.num_free_blocks == 8
    with pytest.raises(ProtocolError):
        pool.handle(ReleaseBlocks("a", 1))  # it holds nothing any more


def test_releasing_a_block_before_it_is_cached_ends_caching_for_that_request() -> None:
    pool = BlockPool(8, BS)
    tokens = tuple(range(200, 216))
    assert isinstance(_allocate(pool, "a", tokens), SlotsAllocated)
    pool.handle(CacheBlocks("a", tokens[:4]))  # block 0 cached, block 1 not yet
    pool.handle(ReleaseBlocks("a", 2))
    # Block 1 may be reused by now: blocks after it must not chain to it.
    assert pool.handle(CacheBlocks("a", tokens[4:16])) == BlocksCached("a", 1)
    assert pool.lookup(tokens) == pool.block_table("a")[:1]
    pool.handle(FreeRequest("a"))
    assert pool.num_free_blocks == 8


def test_a_cached_free_block_is_reused_until_evicted() -> None:
    pool = BlockPool(4, BS)
    tokens = tuple(range(9))
    table = _prefill_and_cache(pool, "a", tokens)  # 3 blocks, 2 full ones cached
    pool.handle(FreeRequest("a"))
    assert pool.num_free_blocks == 4 and pool.statistics().num_cached_blocks == 2
    reply = _allocate(pool, "b", tokens)
    assert reply.num_cached_tokens == 8 and reply.block_ids[:2] == table[:2]
    assert table[0] not in pool.free_block_ids()  # taken out of the free queue
    pool.handle(FreeRequest("b"))
    # Allocating every block evicts the cached ones; the prefix is gone.
    pool.handle(AllocateSlots("c", 0, 16, 16))
    assert pool.lookup(tokens) == () and pool.statistics().num_cached_blocks == 0


def test_a_hit_taking_free_cached_blocks_counts_them_against_the_free_queue() -> None:
    pool = BlockPool(3, BS)
    tokens = tuple(range(9))
    _prefill_and_cache(pool, "a", tokens)
    pool.handle(FreeRequest("a"))
    pool.handle(AllocateSlots("x", 0, 1, 1, (), None))  # evicts the uncached tail block only
    assert pool.num_free_blocks == 2
    # b needs the 2 cached blocks plus one new block: 3 > 2 free.
    assert isinstance(_allocate(pool, "b", tokens), AllocationRefused)
    assert pool.lookup(tokens) != ()  # refusal evicted nothing


def test_cache_salt_separates_prefixes() -> None:
    pool = BlockPool(8, BS)
    tokens = tuple(range(9))
    _prefill_and_cache(pool, "a", tokens, salt="alice")
    assert _allocate(pool, "b", tokens, salt="bob").num_cached_tokens == 0
    assert _allocate(pool, "c", tokens, salt="alice").num_cached_tokens == 8


def test_duplicate_blocks_stay_private_and_the_chain_continues_from_the_cached_one() -> None:
    pool = BlockPool(8, BS)
    tokens = tuple(range(12))
    a = _prefill_and_cache(pool, "a", tokens[:9])
    # b computed the same tokens without a hit (say, concurrently), then commits them.
    pool.handle(AllocateSlots("b", 0, 12, 12))
    assert pool.handle(CacheBlocks("b", tokens[:12])) == BlocksCached("b", 3)
    hit = pool.lookup(tokens)
    b = pool.block_table("b")
    assert hit == (a[0], a[1], b[2])


@pytest.mark.parametrize("hasher", [lambda parent, salt, tokens: 0, lambda parent, salt, tokens: len(tokens)])
def test_a_hash_collision_never_gives_a_wrong_hit(hasher) -> None:
    pool = BlockPool(16, BS, hasher=hasher)
    a = _prefill_and_cache(pool, "a", (1, 2, 3, 4, 5, 6, 7, 8, 0))
    b = _prefill_and_cache(pool, "b", (9, 9, 9, 9, 5, 6, 7, 8, 0))
    assert pool.lookup((1, 2, 3, 4, 5, 6, 7, 8)) == a[:2]
    assert pool.lookup((9, 9, 9, 9, 5, 6, 7, 8)) == b[:2]
    # Same second block behind a different first block: only the first block may match.
    assert pool.lookup((1, 2, 3, 4, 9, 9, 9, 9)) == a[:1]
    assert pool.lookup((5, 6, 7, 8)) == ()
    assert pool.lookup((1, 2, 3, 4), cache_salt="other") == ()


def test_protocol_misuse_raises() -> None:
    pool = BlockPool(8, BS)
    pool.handle(AllocateSlots("a", 0, 8, 8))
    with pytest.raises(ProtocolError, match="prefix lookup"):
        pool.handle(AllocateSlots("a", 0, 8, 8, (1,) * 8))
    with pytest.raises(ProtocolError, match="whole blocks"):
        pool.handle(CacheBlocks("a", (1, 2, 3)))
    with pytest.raises(ProtocolError, match="nothing to compute"):
        pool.handle(AllocateSlots("a", 8, 8, 8))


# -- model-based -------------------------------------------------------------------------

_TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple)  # few values: many shared prefixes


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / grow / commit / free / lookup sequences against a bookkeeping model."""

    hasher = None

    @initialize()
    def start(self) -> None:
        kwargs = {"hasher": self.hasher} if self.hasher else {}
        self.pool = BlockPool(10, BS, **kwargs)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, tuple[int, ...]] = {}
        self.salts: dict[str, str | None] = {}
        self.computed: dict[str, int] = {}
        self.committed: dict[str, int] = {}
        # What each block's KV holds, once full: the salt and the whole token prefix through
        # its last slot. Committed blocks stay cached until allocation hands them out again.
        self.content: dict[int, tuple[str | None, tuple[int, ...]] | None] = {}
        self.cached: set[int] = set()
        self.next_id = 0

    def _write(self, rid: str, start: int, end: int) -> None:
        table, tokens, salt = self.tables[rid], self.tokens[rid], self.salts[rid]
        for i in range(start // BS, -(-end // BS)):
            full = (i + 1) * BS <= end
            self.content[table[i]] = (salt, tokens[: (i + 1) * BS]) if full else None

    def _check_hit(self, query: tuple[int, ...], salt: str | None, blocks: tuple[int, ...]) -> None:
        for i, block in enumerate(blocks):
            assert self.content.get(block) == (salt, query[: (i + 1) * BS]), "a hit returned a block whose tokens differ"

    def _expected_hit_length(self, query: tuple[int, ...], salt: str | None, max_blocks: int) -> int:
        """How many leading blocks of ``query`` some cached block holds: a hit must find them all."""
        cached = {self.content.get(b) for b in self.cached}
        k = 0
        while k < max_blocks and (salt, query[: (k + 1) * BS]) in cached:
            k += 1
        return k

    @rule(tokens=_TOKENS, budget=st.integers(1, 9), salt=st.sampled_from([None, "s"]))
    def admit(self, tokens: tuple[int, ...], budget: int, salt: str | None) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.pool.free_block_ids()
        expected = self._expected_hit_length(tokens, salt, (len(tokens) - 1) // BS)
        reply = self.pool.handle(AllocateSlots(rid, 0, len(tokens), budget, tokens, salt))
        if isinstance(reply, AllocationRefused):
            assert self.pool.free_block_ids() == free_before and self.pool.block_table(rid) == ()
            return
        cached = reply.num_cached_tokens
        assert cached % BS == 0 and cached < len(tokens)
        assert reply.num_new_tokens == min(budget, len(tokens) - cached)
        hit = reply.block_ids[: cached // BS]
        assert len(hit) == expected, "a cached prefix was missed"
        self._check_hit(tokens, salt, hit)
        self.cached -= set(reply.block_ids[len(hit) :])  # handed out fresh: evicted if cached
        self.tables[rid] = list(reply.block_ids)
        self.tokens[rid], self.salts[rid] = tokens, salt
        self.committed[rid] = cached // BS
        self.computed[rid] = cached + reply.num_new_tokens
        self._write(rid, cached, self.computed[rid])

    @rule(data=st.data(), budget=st.integers(1, 9))
    def grow(self, data: st.DataObject, budget: int) -> None:
        live = sorted(r for r in self.tables if self.computed[r] < len(self.tokens[r]))
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        start = self.computed[rid]
        reply = self.pool.handle(AllocateSlots(rid, start, len(self.tokens[rid]), budget))
        if isinstance(reply, AllocationRefused):
            return
        assert reply.num_new_tokens == min(budget, len(self.tokens[rid]) - start)
        self.cached -= set(reply.block_ids)
        self.tables[rid].extend(reply.block_ids)
        self.computed[rid] = start + reply.num_new_tokens
        assert len(self.tables[rid]) == -(-self.computed[rid] // BS)
        self._write(rid, start, self.computed[rid])

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        live = sorted(r for r in self.tables if self.computed[r] // BS > self.committed[r])
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        full = self.computed[rid] // BS
        tokens = self.tokens[rid]
        reply = self.pool.handle(CacheBlocks(rid, tokens[self.committed[rid] * BS : full * BS]))
        assert reply == BlocksCached(rid, full)
        self.cached |= set(self.tables[rid][self.committed[rid] : full])
        self.committed[rid] = full
        # Right after a commit, the whole committed prefix is found again.
        hit = self.pool.lookup(tokens[: full * BS], self.salts[rid])
        assert len(hit) == full
        self._check_hit(tokens, self.salts[rid], hit)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.tables:
            return
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        assert self.pool.handle(FreeRequest(rid)) == RequestFreed(rid, len(self.tables[rid]))
        del self.tables[rid]

    @rule(query=_TOKENS, salt=st.sampled_from([None, "s"]))
    def lookup(self, query: tuple[int, ...], salt: str | None) -> None:
        hit = self.pool.lookup(query, salt)
        assert len(hit) == self._expected_hit_length(query, salt, len(query) // BS)
        self._check_hit(query, salt, hit)

    @invariant()
    def bookkeeping_matches(self) -> None:
        if not hasattr(self, "pool"):
            return
        held = Counter(b for table in self.tables.values() for b in table)
        free = self.pool.free_block_ids()
        assert len(set(free)) == len(free), "a block is in the free queue twice"
        for block in range(self.pool.num_blocks):
            assert self.pool.ref_count(block) == held[block] >= 0
        assert set(free) == {b for b in range(self.pool.num_blocks) if held[b] == 0}
        assert len(free) + len(held) == self.pool.num_blocks
        for rid, table in self.tables.items():
            assert self.pool.block_table(rid) == tuple(table)

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            for rid in list(self.tables):
                self.pool.handle(FreeRequest(rid))
            assert self.pool.num_free_blocks == self.pool.num_blocks, "blocks leaked"


class CollidingPoolMachine(PoolMachine):
    # Every block of equal length shares one key: only verification keeps hits right.
    hasher = staticmethod(lambda parent, salt, tokens: len(tokens))


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPool = PoolMachine.TestCase
TestPool.settings = _SETTINGS
TestCollidingPool = CollidingPoolMachine.TestCase
TestCollidingPool.settings = _SETTINGS


# -- state checkpoints (a hybrid model's recurrent states at block boundaries) -------------


def _run(pool: BlockPool, rid: str, tokens: tuple[int, ...], budget: int = 1000) -> list[SlotsAllocated]:
    """A request computes ``tokens`` in chunks of ``budget``, caching its full blocks after
    each; the replies."""
    replies = [_allocate(pool, rid, tokens, budget)]
    done = replies[0].num_cached_tokens + replies[0].num_new_tokens
    cached = replies[0].num_cached_tokens
    while True:
        full = done // BS * BS
        if full > cached:
            pool.handle(CacheBlocks(rid, tokens[cached:full]))
            cached = full
        if done == len(tokens):
            return replies
        replies.append(pool.handle(AllocateSlots(rid, done, len(tokens), budget)))
        done += replies[-1].num_new_tokens


def test_a_chunk_keeps_the_states_at_the_last_boundary_it_crosses() -> None:
    pool = BlockPool(16, BS, state_checkpoints=4)
    tokens = tuple(range(100, 123))  # 23 tokens
    first, second = _run(pool, "a", tokens, budget=10)[:2]
    # 0..10 crosses 4 and 8: kept at 8; 10..20 crosses 12, 16 and 20: kept at 20 (its end).
    assert [o for o, _ in first.state_save] == [8] and first.state_load == -1
    assert [o for o, _ in second.state_save] == [10]
    table = pool.block_table("a")
    assert [pool.checkpoint_of(b) is not None for b in table] == [False, True, False, False, True, False]
    # A chunk crossing no boundary (20..23) keeps nothing.
    assert _run(pool, "a2", tokens[:3])[0].state_save == ()


def test_a_hit_ends_at_the_deepest_block_whose_states_were_kept() -> None:
    pool = BlockPool(16, BS, state_checkpoints=4)
    tokens = tuple(range(100, 123))
    _run(pool, "a", tokens, budget=10)
    ckpt = pool.checkpoint_of(pool.block_table("a")[4])
    pool.handle(FreeRequest("a"))
    # Six full blocks would match (24 tokens of 30 known), the states were kept at 20.
    longer = tokens + tuple(range(7))
    reply = _allocate(pool, "b", longer)
    assert (reply.num_cached_tokens, reply.state_load) == (20, ckpt)
    # Without a checkpoint the same cache gives the whole match.
    plain = BlockPool(16, BS)
    _run(plain, "a", tokens, budget=10)
    assert _allocate(plain, "b", longer).num_cached_tokens == 20 and plain.lookup(longer) == plain.block_table("a")[:5]
    shorter = tokens[:19]  # up to 16: the boundary kept at 8 is the deepest within it
    reply = _allocate(pool, "c", shorter)
    assert reply.num_cached_tokens == 8 and reply.state_load == pool.checkpoint_of(pool.block_table("c")[1])


def test_reserved_checkpoints_come_back_with_the_request_and_cached_ones_with_their_block() -> None:
    pool = BlockPool(4, BS, state_checkpoints=2)
    reply = _allocate(pool, "a", tuple(range(9)))
    assert reply.state_save and pool.num_free_checkpoints == 1
    pool.handle(FreeRequest("a"))  # failed or preempted before its blocks were cached
    assert pool.num_free_checkpoints == 2
    _run(pool, "b", tuple(range(50, 58)))
    pool.handle(FreeRequest("b"))
    assert pool.num_free_checkpoints == 1
    _run(pool, "c", tuple(range(70, 86)))  # needs all four blocks: b's cached ones are evicted
    assert pool.num_free_checkpoints == 1  # b's came back, c took one
    assert pool.handle(ReadAllocatorStats()).num_cached_blocks == 4


def test_the_least_recently_used_checkpoint_is_taken_but_never_the_one_resumed_from() -> None:
    pool = BlockPool(32, BS, state_checkpoints=2)
    a, b, c = (tuple(range(s, s + 9)) for s in (100, 200, 300))
    for rid, tokens in (("a", a), ("b", b)):
        _run(pool, rid, tokens)
        pool.handle(FreeRequest(rid))
    assert _allocate(pool, "a2", a).num_cached_tokens == 8  # a's is now the more recent
    pool.handle(FreeRequest("a2"))
    _run(pool, "c", c)  # takes b's
    assert _allocate(pool, "b2", b).num_cached_tokens == 0
    pool.handle(FreeRequest("b2"))
    pool.handle(FreeRequest("c"))
    # One checkpoint: a request resuming from it keeps it, and keeps nothing of its own.
    one = BlockPool(32, BS, state_checkpoints=1)
    _run(one, "a", a)
    one.handle(FreeRequest("a"))
    reply = _allocate(one, "a2", a + tuple(range(10)))
    assert reply.num_cached_tokens == 8 and reply.state_save == ()


def test_past_its_prompt_a_request_keeps_only_its_latest_checkpoint() -> None:
    pool = BlockPool(32, BS, state_checkpoints=4)
    tokens = list(range(100, 110))  # a 10-token prompt: its states kept at 8
    _run(pool, "a", tuple(tokens))
    assert pool.num_free_checkpoints == 3
    kept = []
    for step in range(10):  # ten decode steps, one token each, crossing 12, 16 and 20
        tokens.append(200 + step)
        reply = pool.handle(AllocateSlots("a", len(tokens) - 1, len(tokens), 1, past_prompt=True))
        if reply.state_save:
            kept.append(len(tokens))
        if len(tokens) % BS == 0:
            pool.handle(CacheBlocks("a", tuple(tokens[-BS:])))
    assert kept == [12, 16, 20]
    table = pool.block_table("a")
    # The prompt's and the latest decode boundary's: two held, the two before freed.
    assert [i for i, b in enumerate(table) if pool.checkpoint_of(b) is not None] == [1, 4]
    assert pool.num_free_checkpoints == 2
    pool.handle(FreeRequest("a"))
    assert pool.num_free_checkpoints == 2  # the latest stays, for a next turn


def test_a_match_past_the_kept_states_keeps_them_at_its_end_too() -> None:
    """Two prompts share 13 tokens (a system prompt) and then differ: the second matches
    the first's three cached blocks but no kept states (the first's were kept at 16,
    past the shared part), so it recomputes them and keeps its states at the junction,
    12, as well as at its own last boundary; a third prompt sharing the part resumes at 12."""
    pool = BlockPool(32, BS, state_checkpoints=8)
    shared = tuple(range(100, 113))
    _run(pool, "a", shared + (1, 2, 3, 4, 5))
    second = _run(pool, "b", shared + (6, 7, 8, 9, 10, 11))[0]
    assert second.num_cached_tokens == 0
    assert [o for o, _ in second.state_save] == [12, 16]
    third = _allocate(pool, "c", shared + (20, 21, 22))
    assert third.num_cached_tokens == 12 and third.state_load == second.state_save[0][1]
    # A chunk that stops short of the junction keeps it for the chunk that reaches it.
    pool2 = BlockPool(32, BS, state_checkpoints=8)
    _run(pool2, "a", shared + (1, 2, 3, 4, 5))
    chunks = _run(pool2, "b", shared + (6, 7, 8, 9, 10, 11), budget=10)
    assert [[o for o, _ in c.state_save] for c in chunks] == [[8], [2, 6]]  # 0..10: 8; 10..19: 12, 16
