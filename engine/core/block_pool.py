"""The KV-block pool: a fixed set of blocks, reference counts, an eviction queue and a
prefix cache. Pure and synchronous; the KV-allocator actor is ``reply = pool.handle(call)``.

Block states::

    held        ref_count > 0, in one or more requests' tables (shared when > 1)
    free        ref_count == 0, in the free queue; may still be *cached*:
                its tokens stay reusable until allocation evicts it

    free queue (eviction order):  head -> [evicted first ... evicted last] <- tail
    allocation pops the head; a freed cached block is appended at the tail, a freed block
    holding no cached tokens goes to the head; a prefix hit on a free cached block takes it
    out of the queue wherever it is.

The queue starts as every block in id order, so never-used blocks are handed out lowest id
first, after any freed uncached block and before any cached one is evicted. The set of
blocks ever written thus stays compact: on CPU the pool's memory pages become resident
only when first touched (``engine.runner.kv_cache``), so resident memory follows the most
blocks in use at once plus what the prefix cache keeps, not the pool's size.

Blocks read from a KV store (``--kv-transfer-config``, engine.core.kv_tier): a first
allocation may offer them (``AllocateSlots.external``); those that follow on from the
prefix cache's hit are allocated as new blocks right after it, counted as cached tokens
(``SlotsAllocated.num_external_tokens``) and filled by the runner before the chunk runs.
The request caches them once that step is done, as blocks it computed.

Prefix cache. Only full blocks whose tokens are computed are cached. A block's key chains
its parent's key, its tokens and the request's ``cache_salt``, so equal keys normally
mean equal prefixes. The key is only a bucket index: a hit is *verified* by comparing the
block's stored tokens and salt and by checking that its stored parent is the very cache
entry matched one block earlier (each cache entry gets a fresh generation number, so a
parent evicted and reused for other tokens no longer matches its old children). Two
requests that computed the same prefix side by side cache both copies as twins under one
generation number, so children stay reachable while either twin lives. By
induction a hit of ``k`` blocks means the whole ``k * block_size`` token prefix is equal,
whatever the hash function does.

State checkpoints (a hybrid model's recurrent layers, ``state_checkpoints`` > 0). Such a
model's Mamba or DeltaNet layers keep one state a request, advanced by every token, so a
cached prefix is only of use where the states at its end were kept too. The pool hands out
``state_checkpoints`` checkpoint slots (the runner keeps them beside the running requests'
state slots): a chunk that crosses a block boundary is told to copy its states at the
last boundary it crosses into a reserved checkpoint (``SlotsAllocated.state_save``), which
is tied to that block's cache entry when the block is cached, and a prefix hit ends at the
deepest hit block whose entry holds a checkpoint, which the new request's first chunk
starts from (``state_load``). Checkpoints held by cache entries are reused least recently
used first; one reserved for a chunk still running is never taken. An entry's checkpoint
goes when the entry is evicted. Past its prompt (``AllocateSlots.past_prompt``: decode
steps) a request keeps one checkpoint, its latest: each new one frees the one before, so a
long answer does not take them all, and the next turn of a conversation (the prompt, the
answer and more) resumes at the answer's last full block. And where a new request's
prompt matches cached blocks past the deepest kept states (the prompts share more than
was kept: a common system prompt, then each its own question), the chunk that recomputes
them also keeps the states at the end of that match, the junction, so that the next
prompt sharing it resumes there. vLLM keeps a hybrid model's states on its block grid in
the same way ("align" mode, with its shared-prefix checkpoint), where a hit resumes only
at a block boundary.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.core.request import ProtocolError
from engine.messages import (
    AllocateSlots,
    AllocationRefused,
    AllocatorCall,
    AllocatorReply,
    AllocatorStats,
    BlocksCached,
    BlocksForked,
    BlocksReleased,
    CacheBlocks,
    ClearPrefixCache,
    ForkBlocks,
    FreeRequest,
    LookupPrefix,
    PrefixCacheCleared,
    PrefixLookedUp,
    ReadAllocatorStats,
    ReleaseBlocks,
    RequestFreed,
    SlotsAllocated,
)

BlockHasher = Callable[[int | None, str | None, tuple[int, ...]], int]


def block_hash(parent_hash: int | None, cache_salt: str | None, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block. Python's tuple hash is fast and, because every
    hit is verified against the stored tokens, a collision costs a miss, never a wrong hit."""
    return hash((parent_hash, cache_salt, token_ids))


class _Block:
    __slots__ = ("block_id", "ref_count", "key", "token_ids", "salt", "parent_gen", "gen")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.gen = 0  # cache entry identity; 0 = not cached
        self.key = 0
        self.token_ids: tuple[int, ...] = ()
        self.salt: str | None = None
        self.parent_gen = 0  # gen of the parent entry; 0 for a request's first block


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens, handed out to requests.

    Each request has one block table that only grows, until :class:`FreeRequest` drops it.
    ``hasher`` replaces :func:`block_hash` (tests force collisions with it).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hasher: BlockHasher = block_hash,
        state_checkpoints: int = 0,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hasher = hasher
        # The free queue, next to be taken first, in three parts, so a pool of millions of
        # blocks (a tiny model's share of the KV memory) costs nothing until they are used:
        # blocks freed holding no cached tokens (the last freed first: a dict popped from
        # its end), then the never-used blocks [_fresh, num_blocks) in id order, then the
        # freed cached blocks, least recently freed first. A block's record is made when it
        # is first handed out (the fresh ids go in order, so _blocks[i] exists for i < _fresh).
        self._blocks: list[_Block] = []
        self._fresh = 0
        self._free_front: dict[int, None] = {}
        self._free_back: OrderedDict[int, None] = OrderedDict()
        self._buckets: dict[int, list[_Block]] = {}
        self._tables: dict[str, list[int]] = {}
        # Per request: (key, gen) of each leading block whose tokens are in the cache,
        # the chain its next cached block hangs from.
        self._chains: dict[str, list[tuple[int, int]]] = {}
        self._salts: dict[str, str | None] = {}
        # Per request: how many leading table entries are released (sliding windows), and
        # the requests whose caching a release cut short.
        self._released: dict[str, int] = {}
        self._uncacheable: set[str] = set()
        # State checkpoints: free ones; those held by cache entries (by generation, least
        # recently used first) and the block holding each; per request, the ones reserved
        # for blocks not yet cached (by table index).
        self.state_checkpoints = state_checkpoints if enable_prefix_caching else 0
        self._ckpt_free = list(range(self.state_checkpoints - 1, -1, -1))
        self._ckpt_of: OrderedDict[int, int] = OrderedDict()
        self._ckpt_block: dict[int, int] = {}
        self._ckpt_pending: dict[str, dict[int, tuple[int, bool]]] = {}
        self._ckpt_latest: dict[str, int] = {}  # per request, its checkpoint past its prompt (by gen)
        self._junction: dict[str, int] = {}  # per request, where its match outran the kept states
        self._next_gen = 1
        self._num_cached = 0
        self._queries = 0
        self._hits = 0

    # -- protocol -------------------------------------------------------------------------

    def handle(self, call: AllocatorCall) -> AllocatorReply:
        """Answer one allocator call (see ``engine.messages``)."""
        match call:
            case AllocateSlots():
                return self.allocate_slots(call)
            case CacheBlocks(sample_id, token_ids):
                return self.cache_blocks(sample_id, token_ids)
            case ReleaseBlocks(sample_id, num_blocks):
                return self.release_blocks(sample_id, num_blocks)
            case FreeRequest(sample_id):
                return self.free_request(sample_id)
            case ForkBlocks():
                return self.fork_blocks(call)
            case ClearPrefixCache():
                return PrefixCacheCleared(self.clear_prefix_cache())
            case ReadAllocatorStats():
                return self.statistics()
            case LookupPrefix(token_ids, cache_salt):
                found = self.lookup(token_ids, cache_salt) if self.enable_prefix_caching else ()
                return PrefixLookedUp(len(found))
        raise ProtocolError(f"the block pool cannot handle {type(call).__name__}")

    def allocate_slots(self, call: AllocateSlots) -> SlotsAllocated | AllocationRefused:
        """Grow a table for one chunk, sharing a cached prefix first; all or nothing."""
        table = self._tables.get(call.sample_id, [])
        if call.prefix_token_ids and (table or call.num_computed_tokens):
            raise ProtocolError(
                f"request {call.sample_id!r}: prefix lookup while it holds blocks or computed tokens"
            )
        hits = self._lookup(call) if call.prefix_token_ids else []
        if self.state_checkpoints:
            # The states must be kept where the hit ends: at the deepest entry holding them.
            depth = max((i + 1 for i, b in enumerate(hits) if b.gen in self._ckpt_of), default=0)
            if depth < len(hits):
                self._junction[call.sample_id] = len(hits) * self.block_size
            hits = hits[:depth]
        external = self._external(call, len(hits))
        start = call.num_computed_tokens + (len(hits) + external) * self.block_size
        end = min(call.num_known_tokens, start + call.token_budget)
        if end <= start:
            raise ProtocolError(f"request {call.sample_id!r}: nothing to compute from {start}")
        num_new = max(0, -(-end // self.block_size) - len(table) - len(hits))
        # Hit blocks that sit in the free queue leave it too; count them against it.
        num_taken = num_new + sum(1 for b in hits if b.ref_count == 0)
        if num_taken > self.num_free_blocks:
            return AllocationRefused(call.sample_id, num_taken, self.num_free_blocks)
        for block in hits:
            self._take(block)
        new_ids = [self._allocate_one() for _ in range(num_new)]
        if call.sample_id not in self._tables:
            self._tables[call.sample_id] = table
            self._chains[call.sample_id] = [(b.key, b.gen) for b in hits]
            self._salts[call.sample_id] = call.cache_salt
        block_ids = [b.block_id for b in hits] + new_ids
        table.extend(block_ids)
        if call.prefix_token_ids and self.enable_prefix_caching:
            self._queries += len(call.prefix_token_ids)
            self._hits += len(hits) * self.block_size
        load, save = -1, ()
        if self.state_checkpoints:
            if hits:
                load = self._ckpt_of[hits[-1].gen]
                self._ckpt_of.move_to_end(hits[-1].gen)
            save = self._reserve_checkpoint(call.sample_id, start, end, hits[-1].gen if hits else 0,
                                            call.past_prompt)
        return SlotsAllocated(call.sample_id, (len(hits) + external) * self.block_size, end - start,
                              tuple(block_ids), load, save, external * self.block_size)

    def _external(self, call: AllocateSlots, num_hits: int) -> int:
        """How many of the request's blocks read from the KV store it takes: those past the
        prefix cache's hit, when they follow on from it, and never the block of the last
        known token. They are the first new blocks of its table."""
        first, count = call.external
        if not count or not first <= num_hits < first + count:
            return 0
        return max(0, min(first + count, (call.num_known_tokens - 1) // self.block_size) - num_hits)

    def cache_blocks(self, sample_id: str, token_ids: tuple[int, ...]) -> BlocksCached:
        """Enter the request's next full, computed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return BlocksCached(sample_id, 0)
        table = self._tables.get(sample_id)
        if table is None:
            raise ProtocolError(f"cache_blocks for {sample_id!r}, which holds no blocks")
        chain = self._chains[sample_id]
        if sample_id in self._uncacheable:
            return BlocksCached(sample_id, len(chain))
        count, rest = divmod(len(token_ids), self.block_size)
        if rest or len(chain) + count > len(table):
            raise ProtocolError(
                f"request {sample_id!r}: {len(token_ids)} tokens are not whole blocks after "
                f"the {len(chain)} cached ones of its {len(table)}"
            )
        salt = self._salts[sample_id]
        for i in range(count):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent_key, parent_gen = chain[-1] if chain else (None, 0)
            key = self._hasher(parent_key, salt, tokens)
            # Another request may already cache equal tokens. Then this block enters as
            # a twin carrying that entry's generation: both hold the same prefix, and the
            # chain (and any children) outlive the eviction of either twin.
            twin = self._find(key, tokens, salt, parent_gen)
            gen = twin.gen if twin is not None else None
            entry = self._enter(self._blocks[table[len(chain)]], key, tokens, salt, parent_gen, gen)
            self._commit_checkpoint(sample_id, len(chain), entry)
            chain.append((key, entry.gen))
        return BlocksCached(sample_id, len(chain))

    def release_blocks(self, sample_id: str, num_blocks: int) -> BlocksReleased:
        """Drop the request's hold on its first ``num_blocks`` blocks (see
        :class:`ReleaseBlocks`); they join the free queue as :meth:`free_request` frees."""
        table = self._tables.get(sample_id)
        if table is None:
            raise ProtocolError(f"release_blocks for {sample_id!r}, which holds no blocks")
        done = self._released.get(sample_id, 0)
        if num_blocks > len(table):
            raise ProtocolError(f"request {sample_id!r}: cannot release {num_blocks} of {len(table)} blocks")
        if num_blocks <= done:
            return BlocksReleased(sample_id, done)
        if num_blocks > len(self._chains[sample_id]):
            self._uncacheable.add(sample_id)  # its next block to cache is going away
        for block_id in table[done:num_blocks]:
            self._unref(block_id, sample_id)
        self._released[sample_id] = num_blocks
        return BlocksReleased(sample_id, num_blocks)

    def free_request(self, sample_id: str) -> RequestFreed:
        """Drop a table; cached blocks whose count reaches 0 join the free queue's tail,
        the table's last block first, so a prefix's first blocks are evicted last; uncached
        ones go to the head, to be reused first."""
        table = self._tables.pop(sample_id, None)
        if table is None:
            return RequestFreed(sample_id, 0)
        del self._chains[sample_id], self._salts[sample_id]
        # Reserved for blocks it never cached (it finished, failed or was preempted first).
        self._ckpt_free.extend(c for c, _ in self._ckpt_pending.pop(sample_id, {}).values())
        self._ckpt_latest.pop(sample_id, None)  # its last one stays, for a next turn
        self._junction.pop(sample_id, None)
        released = self._released.pop(sample_id, 0)
        self._uncacheable.discard(sample_id)
        for block_id in reversed(table[released:]):
            self._unref(block_id, sample_id)
        return RequestFreed(sample_id, len(table))

    def fork_blocks(self, call: ForkBlocks) -> BlocksForked | AllocationRefused:
        """Beam search: a child table sharing its parent's first blocks (see
        :class:`ForkBlocks`). The child takes no part in the prefix cache: its blocks are
        its parent's, already cached or not, and what it computes later is its own."""
        src = self._tables.get(call.src_id)
        if src is None or call.dst_id in self._tables or not 0 < call.num_blocks <= len(src):
            raise ProtocolError(f"cannot fork {call.num_blocks} blocks of {call.src_id!r} "
                                f"into {call.dst_id!r}")
        if self._released.get(call.src_id):
            raise ProtocolError(f"cannot fork {call.src_id!r}: it released blocks")
        if call.copy_last and not self.num_free_blocks:
            return AllocationRefused(call.dst_id, 1, 0)
        shared = src[: call.num_blocks - 1] if call.copy_last else src[: call.num_blocks]
        for block_id in shared:
            self._take(self._blocks[block_id])
        table = list(shared)
        copies: tuple[tuple[int, int], ...] = ()
        if call.copy_last:
            table.append(self._allocate_one())
            copies = ((src[call.num_blocks - 1], table[-1]),)
        self._tables[call.dst_id] = table
        self._chains[call.dst_id] = []
        self._salts[call.dst_id] = self._salts[call.src_id]
        self._uncacheable.add(call.dst_id)
        return BlocksForked(call.dst_id, tuple(table), copies)

    def clear_prefix_cache(self) -> bool:
        """Forget every cached block's tokens, as vLLM's ``reset_prefix_cache``: only while
        no request holds a block (else nothing changes and the answer is false), so no
        request's chain of cached blocks is cut under it. The hit and query counters go on
        counting (they are monotonic counters)."""
        if self._tables:
            return False
        for bucket in list(self._buckets.values()):
            for block in list(bucket):
                self._evict(block)
        return True

    def _unref(self, block_id: int, sample_id: str) -> None:
        block = self._blocks[block_id] if 0 <= block_id < self._fresh else None
        if block is None or block.ref_count <= 0 or block_id in self._free_front or block_id in self._free_back:
            raise ProtocolError(f"block {block_id} freed twice (request {sample_id!r})")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.gen:
                self._free_back[block_id] = None
            else:
                # Holding no cached tokens, it is worth nothing: reuse it before any
                # never-used block (whose memory pages may not be resident yet) and before
                # evicting a cached one.
                self._free_front[block_id] = None

    def _reserve_checkpoint(self, sample_id: str, start: int, end: int, loaded_gen: int,
                            past_prompt: bool) -> tuple[tuple[int, int], ...]:
        """Checkpoints for the states at the request's junction, if the chunk ``start:end``
        reaches it, and at the last block boundary the chunk crosses, as ``(offset in the
        chunk, checkpoint)`` pairs; none for a boundary when every checkpoint is reserved,
        or at all when the chunk crosses none or its request caches nothing more."""
        last = end // self.block_size * self.block_size
        if last <= start or sample_id in self._uncacheable:
            return ()
        boundaries = [last]
        junction = self._junction.get(sample_id, 0)
        if junction <= end:
            self._junction.pop(sample_id, None)
            if start < junction < last:
                boundaries.insert(0, junction)
        saves = []
        for boundary in boundaries:
            ckpt = self._take_checkpoint(loaded_gen)
            if ckpt is None:
                break
            pending = self._ckpt_pending.setdefault(sample_id, {})
            index = boundary // self.block_size - 1
            if index in pending:  # a chunk before this one ended inside the same block: replaced
                self._ckpt_free.append(pending[index][0])
            pending[index] = (ckpt, past_prompt)
            saves.append((boundary - start, ckpt))
        return tuple(saves)

    def _take_checkpoint(self, loaded_gen: int) -> int | None:
        """A free checkpoint, else the least recently used entry's (never ``loaded_gen``'s,
        which the chunk starts from); None when every one is reserved."""
        if self._ckpt_free:
            return self._ckpt_free.pop()
        victim = next((g for g in self._ckpt_of if g != loaded_gen), None)
        if victim is None:
            return None
        del self._ckpt_block[victim]
        return self._ckpt_of.pop(victim)

    def _commit_checkpoint(self, sample_id: str, index: int, entry: _Block) -> None:
        """Tie the checkpoint reserved for the request's block ``index`` (if any) to the
        cache entry it entered as; a twin entry holding one already keeps its own."""
        pending = self._ckpt_pending.get(sample_id)
        reserved = pending.pop(index, None) if pending else None
        if reserved is None:
            return
        ckpt, past_prompt = reserved
        if entry.gen in self._ckpt_of:
            self._ckpt_free.append(ckpt)
            return
        self._ckpt_of[entry.gen] = ckpt
        self._ckpt_block[entry.gen] = entry.block_id
        if past_prompt:
            before = self._ckpt_latest.get(sample_id)
            if before in self._ckpt_of:  # unless another reservation took it since
                del self._ckpt_block[before]
                self._ckpt_free.append(self._ckpt_of.pop(before))
            self._ckpt_latest[sample_id] = entry.gen

    def checkpoint_of(self, block_id: int) -> int | None:
        """The state checkpoint tied to the cache entry of ``block_id`` (tests)."""
        gen = self._blocks[block_id].gen if 0 <= block_id < self._fresh else 0
        return self._ckpt_of.get(gen) if gen and self._ckpt_block.get(gen) == block_id else None

    @property
    def num_free_checkpoints(self) -> int:
        return len(self._ckpt_free)

    def statistics(self) -> AllocatorStats:
        return AllocatorStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=self._num_cached,
            usage=1.0 - self.num_free_blocks / self.num_blocks,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    # -- read-only views (tests, debugging) -----------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included."""
        return len(self._free_front) + self.num_blocks - self._fresh + len(self._free_back)

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} of {self.num_blocks}")
        return self._blocks[block_id].ref_count if block_id < self._fresh else 0

    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, next to be evicted first."""
        return (*reversed(self._free_front), *range(self._fresh, self.num_blocks), *self._free_back)

    def block_table(self, sample_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(sample_id, ()))

    def lookup(self, token_ids: tuple[int, ...], cache_salt: str | None = None) -> tuple[int, ...]:
        """The blocks of the longest verified cached prefix of ``token_ids`` (full blocks
        only, no cap). Takes no references and changes no statistics."""
        return tuple(b.block_id for b in self._match(token_ids, cache_salt, len(token_ids) // self.block_size))

    # -- internals ------------------------------------------------------------------------

    def _lookup(self, call: AllocateSlots) -> list[_Block]:
        if not self.enable_prefix_caching:
            return []
        # Never the whole known sequence: the last token's logits must be computed.
        limit = min(len(call.prefix_token_ids), call.num_known_tokens - 1)
        return self._match(call.prefix_token_ids, call.cache_salt, max(0, limit) // self.block_size)

    def _match(self, token_ids: tuple[int, ...], salt: str | None, max_blocks: int) -> list[_Block]:
        hits: list[_Block] = []
        parent_key: int | None = None
        parent_gen = 0
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            key = self._hasher(parent_key, salt, tokens)
            block = self._find(key, tokens, salt, parent_gen)
            if block is None:
                break
            hits.append(block)
            parent_key, parent_gen = key, block.gen
        return hits

    def _find(self, key: int, tokens: tuple[int, ...], salt: str | None, parent_gen: int) -> _Block | None:
        for block in self._buckets.get(key, ()):
            if block.parent_gen == parent_gen and block.token_ids == tokens and block.salt == salt:
                return block
        return None

    def _enter(
        self,
        block: _Block,
        key: int,
        tokens: tuple[int, ...],
        salt: str | None,
        parent_gen: int,
        gen: int | None = None,
    ) -> _Block:
        if block.gen:
            raise ProtocolError(f"block {block.block_id} is cached already")
        block.key, block.token_ids, block.salt, block.parent_gen = key, tokens, salt, parent_gen
        if gen is None:
            gen = self._next_gen
            self._next_gen += 1
        block.gen = gen
        self._buckets.setdefault(key, []).append(block)
        self._num_cached += 1
        return block

    def _evict(self, block: _Block) -> None:
        bucket = self._buckets[block.key]
        bucket.remove(block)
        if not bucket:
            del self._buckets[block.key]
        if self._ckpt_block.get(block.gen) == block.block_id:
            del self._ckpt_block[block.gen]
            self._ckpt_free.append(self._ckpt_of.pop(block.gen))
        block.gen, block.token_ids, block.salt = 0, (), None
        self._num_cached -= 1

    def _take(self, block: _Block) -> None:
        if block.ref_count == 0:
            if block.block_id in self._free_front:
                del self._free_front[block.block_id]
            else:
                del self._free_back[block.block_id]
        block.ref_count += 1

    def _allocate_one(self) -> int:
        if self._free_front:
            block_id, _ = self._free_front.popitem()
        elif self._fresh < self.num_blocks:
            block_id = self._fresh
            self._blocks.append(_Block(block_id))
            self._fresh += 1
        else:
            block_id, _ = self._free_back.popitem(last=False)
        block = self._blocks[block_id]
        if block.gen:
            self._evict(block)
        block.ref_count = 1
        return block_id
