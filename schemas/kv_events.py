"""KV-cache events in Ferry's own block hashes, as workers report them to the index."""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Consecutive full blocks that became cached; `block_hashes` are Ferry chained hashes."""

    block_hashes: list[int]
    parent_hash: int | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks that were evicted from the cache."""

    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    """The engine dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    """The events of one engine step, applied to the index in one round trip."""

    ts: float
    events: list[KVEvent]
