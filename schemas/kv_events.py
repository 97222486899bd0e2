"""KV-cache events in Ferry's own block hashes, as workers report them to the index."""

from __future__ import annotations

import msgspec

# Where a block lives, in vLLM's names: None or "GPU" is the engine's device pool (vLLM calls it "GPU"
# on the CPU backend too); "CPU" is the host-memory offload tier, whose blocks must be loaded back first.
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Consecutive full blocks that became cached; `block_hashes` are Ferry chained hashes."""

    block_hashes: list[int]
    parent_hash: int | None = None
    lora_name: str | None = None
    # None: the device pool (MEDIUM_DEVICE); MEDIUM_HOST: the host offload tier.
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks that were evicted from the cache (of the tier `medium` names; None = device)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    """The engine dropped its whole prefix cache, every tier."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    """The events of one engine step, applied to the index in one round trip."""

    ts: float
    events: list[KVEvent]


def is_host(medium: str | None) -> bool:
    """Whether an event's medium names the host offload tier rather than the device pool."""
    return medium is not None and medium != MEDIUM_DEVICE


class KVLogRecord(msgspec.Struct, frozen=True):
    """One record of a worker on its model's KV log topic (`kv_log_topic`): events, or its whole cache.

    `incarnation` tells processes under one worker id apart (its start time); `seq` counts the worker's
    records from 1 in that incarnation, so a reader sees a record it missed. A snapshot (`snapshot`) lists
    every block the worker holds at `seq` (`device`, `host`: the two tiers) and replaces all before it;
    otherwise `events` are the engine's events since the previous record, in order.
    """

    worker_id: str
    incarnation: float
    seq: int
    ts: float
    snapshot: bool = False
    events: list[KVEvent] = []
    device: list[int] = []
    host: list[int] = []
