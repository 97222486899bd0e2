"""A paged KV block pool with prefix caching keyed by Ferry's chained block hashes.

Blocks that no sequence references keep their contents and stay findable by hash until a new
block is needed; then never-hashed free blocks go first, and cached ones are evicted least
recently used first. Cache changes are recorded as KV events for the caller to publish per step.

With a host tier (workers/host_tier.py), an evicted cached block is copied there, and a prefix whose
blocks continue on the host after the device-cached part counts as a hit: those blocks are loaded back
into fresh device blocks (at the tier's bandwidth cost) instead of being recomputed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.hashing import block_hashes
from schemas.kv_events import MEDIUM_HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from workers.host_tier import HostTier


class _Block:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


@dataclass(slots=True)
class SequenceBlocks:
    """The blocks one sequence holds, and the chained hashes of its full blocks."""

    seed: int
    lora_name: str | None = None
    block_ids: list[int] = field(default_factory=list)
    # Hashes of full blocks of the sequence's tokens, computed lazily and kept across
    # preemption: they depend only on the tokens.
    hashes: list[int] = field(default_factory=list)
    # Leading blocks already offered to the cache (registered, or found there).
    num_committed: int = 0


class BlockPool:
    """Fixed-size pool of KV blocks shared by all sequences of one engine."""

    def __init__(self, num_blocks: int, block_size: int, host: HostTier | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks without contents worth keeping: used before any cached block is evicted.
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Unreferenced cached blocks, least recently used first.
        self._evictable: OrderedDict[int, _Block] = OrderedDict()
        self._cached: dict[int, _Block] = {}
        self._num_used = 0
        self._events: list[KVEvent] = []
        self.host = host

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached-but-unreferenced blocks count as free)."""
        return self.num_blocks - self._num_used

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, referenced or not."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by sequences."""
        return self._num_used / self.num_blocks

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is in the cache."""
        return block_hash in self._cached

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading `hashes` whose blocks are cached."""
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def match_prefix(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> int:
        """Cached leading full blocks of `token_ids` (device, then host), leaving a token to compute."""
        # Like vLLM: the last token must be computed to get logits, so a fully cached prompt
        # still recomputes its last block.
        max_blocks = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(seq, token_ids, max_blocks)
        n = self.longest_prefix(seq.hashes[:max_blocks])
        if self.host is not None and n < max_blocks:
            n += self.host.leading(seq.hashes[n:max_blocks])
        return n

    def snapshot(self) -> KVEventBatch:
        """A batch that rebuilds an index's view of this pool from nothing, every tier (O(cached blocks): for a
        reader that fell behind, not per step)."""
        events: list[KVEvent] = [AllBlocksCleared()]
        if self._cached:
            events.append(BlockStored(block_hashes=list(self._cached)))
        if self.host is not None and len(self.host):
            events.append(BlockStored(block_hashes=self.host.hashes(), medium=MEDIUM_HOST))
        return KVEventBatch(ts=time.time(), events=events)

    def take_transfer_seconds(self) -> float:
        """Host-link time of the loads and offloads since the previous call (0 without a host tier)."""
        return self.host.take_seconds() if self.host is not None else 0.0

    def allocate(
        self,
        seq: SequenceBlocks,
        token_ids: Sequence[int],
        num_tokens: int,
        num_hit_blocks: int = 0,
    ) -> bool:
        """Make `seq` hold blocks for its first `num_tokens` tokens; False (and no change) if short.

        `num_hit_blocks` leading blocks are taken from the cache (only for a sequence that holds no
        blocks yet, as found by `match_prefix`); those past the device-cached prefix are loaded from
        the host tier into new blocks. Blocks that the first `num_tokens` tokens fill are then hashed
        and cached, emitting BlockStored.
        """
        if num_hit_blocks and seq.block_ids:
            raise ValueError("cache hits can only start a sequence")
        if not num_hit_blocks and num_tokens <= len(seq.block_ids) * self.block_size:
            # Room in the blocks held (most decode steps): nothing to take, only full blocks to commit.
            self._commit_full_blocks(seq, token_ids, num_tokens // self.block_size)
            return True
        self._extend_hashes(seq, token_ids, num_hit_blocks)
        on_device = self.longest_prefix(seq.hashes[:num_hit_blocks])
        to_load = seq.hashes[on_device:num_hit_blocks]
        if to_load and (self.host is None or self.host.leading(to_load) < len(to_load)):
            raise ValueError("hit blocks are neither on the device nor on the host")
        hits = [self._cached[h] for h in seq.hashes[:on_device]]
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids) - on_device
        reclaimed = sum(1 for b in hits if b.ref_cnt == 0)
        if max(needed, 0) + reclaimed > self.num_free_blocks:
            return False
        for block in hits:
            self._touch(block)
            seq.block_ids.append(block.block_id)
        if to_load and self.host is not None:
            # Before taking free blocks: the offloads that frees may cause must not push these out.
            self.host.load(to_load)
        seq.num_committed = max(seq.num_committed, on_device)
        for _ in range(needed):
            seq.block_ids.append(self._take_free_block())
        self._commit_full_blocks(seq, token_ids, num_tokens // self.block_size)
        return True

    def free(self, seq: SequenceBlocks) -> None:
        """Release every block of `seq`; cached ones stay findable until evicted."""
        # Reverse order so a sequence's tail blocks are evicted before its head, which other
        # prompts are likelier to share.
        for block_id in reversed(seq.block_ids):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_used -= 1
                if block.block_hash is None:
                    self._free_plain.append(block_id)
                else:
                    self._evictable[block_id] = block
        seq.block_ids.clear()
        seq.num_committed = 0

    def reset(self) -> bool:
        """Drop the whole prefix cache (emitting AllBlocksCleared); False if any block is in use."""
        if self._num_used:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        if self.host is not None:
            self.host.clear()
        self._evictable.clear()
        self._free_plain = list(range(self.num_blocks - 1, -1, -1))
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """KV events since the previous call, in order."""
        events, self._events = self._events, []
        return events

    def _extend_hashes(self, seq: SequenceBlocks, token_ids: Sequence[int], n_blocks: int) -> None:
        have = len(seq.hashes)
        if have >= n_blocks:
            return
        bs = self.block_size
        parent = seq.hashes[-1] if have else seq.seed
        seq.hashes.extend(
            block_hashes(token_ids[have * bs : n_blocks * bs], bs, seed=seq.seed, parent=parent)
        )

    def _touch(self, block: _Block) -> None:
        if block.ref_cnt == 0:
            self._num_used += 1
            self._evictable.pop(block.block_id, None)
        block.ref_cnt += 1

    def _take_free_block(self) -> int:
        if self._free_plain:
            block = self._blocks[self._free_plain.pop()]
        else:
            _, block = self._evictable.popitem(last=False)
            assert block.block_hash is not None
            del self._cached[block.block_hash]
            self._record_removed(block.block_hash, None)
            if self.host is not None:
                self._offload(block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        self._num_used += 1
        return block.block_id

    def _commit_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int], n_full: int) -> None:
        if n_full <= seq.num_committed:
            return
        self._extend_hashes(seq, token_ids, n_full)
        stored: list[int] = []
        parent: int | None = seq.hashes[seq.num_committed - 1] if seq.num_committed else None
        for i in range(seq.num_committed, n_full):
            h = seq.hashes[i]
            if h in self._cached:
                # Another sequence computed the same block first: keep that copy as the cached
                # one, so each hash is stored and removed exactly once.
                self._record_stored(stored, parent, seq.lora_name)
                stored = []
                parent = h
                continue
            block = self._blocks[seq.block_ids[i]]
            block.block_hash = h
            self._cached[h] = block
            stored.append(h)
        self._record_stored(stored, parent, seq.lora_name)
        seq.num_committed = n_full

    def _record_stored(self, hashes: list[int], parent: int | None, lora_name: str | None) -> None:
        if hashes:
            self._events.append(BlockStored(block_hashes=hashes, parent_hash=parent, lora_name=lora_name))

    def _offload(self, block_hash: int) -> None:
        assert self.host is not None
        stored, dropped = self.host.offload(block_hash)
        if stored:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockStored) and last.medium == MEDIUM_HOST:
                last.block_hashes.append(block_hash)
            else:
                self._events.append(BlockStored(block_hashes=[block_hash], medium=MEDIUM_HOST))
        for h in dropped:
            self._record_removed(h, MEDIUM_HOST)

    def _record_removed(self, block_hash: int, medium: str | None) -> None:
        last = self._events[-1] if self._events else None
        # The batch is not published yet, so growing the last event in place is safe.
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=medium))
