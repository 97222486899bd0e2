"""The simulated engine's side of disaggregated serving: receiving a sequence's prompt KV from a prefill worker.

A request whose `kv_from` names a prefill worker takes the KV of the prompt tokens that worker computed
instead of computing it: they count as computed at admission (and as cached tokens, as vLLM counts KV a
connector loaded), and their full blocks are stored in this engine's pool like computed ones (KV events as
usual). What is left is the prefill worker's token, whose KV a decode step computes as it does every
sampled token's: the sequence decodes from its first step here, and its hand-off adds no prefill step to
the worker's other sequences. Receiving the KV takes `blocks x block_size x kv_bytes_per_token / bandwidth`
(the formula the host tier charges its loads, workers/host_tier.py) for the prompt's blocks this engine
does not already cache (the last one may be partial); transfers share one link, in arrival order. The
sequence alone waits for its KV: the engine's other sequences keep stepping meanwhile, as a NIXL-style
transfer overlaps the decode worker's compute.

The link time is wall time, not divided by `--speedup`: the speedup scales the engine's compute model (the
step times), not the network between workers. Dynamo's mocker does the same: its prefill worker holds its
response for `prompt tokens x kv_bytes_per_token / bandwidth` whatever its `--speedup-ratio`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.hashing import block_hashes
from schemas.kafka import KVFrom


def transfer_seconds(blocks: int, block_size: int, kv_bytes_per_token: int, bandwidth_gbps: float) -> float:
    """Link time of moving `blocks` KV blocks; 0 with a non-positive bandwidth (free, as Dynamo's 0)."""
    if bandwidth_gbps <= 0 or blocks <= 0:
        return 0.0
    return blocks * block_size * kv_bytes_per_token / (bandwidth_gbps * 1e9)


def received_tokens(kv_from: KVFrom | None, num_tokens: int) -> int:
    """Leading tokens of a sequence of `num_tokens` whose KV comes from its prefill worker: those it computed,
    leaving at least one token to compute here."""
    if kv_from is None:
        return 0
    return max(0, min(kv_from.tokens, num_tokens - 1))


def admission(hit_tokens: int, received: int, num_tokens: int) -> tuple[int, int]:
    """(computed, prefill_end) of a sequence admitted with `hit_tokens` cached here and `received` tokens' KV
    received: one left with only its last token to compute decodes (prefill_end = computed)."""
    computed = max(hit_tokens, received)
    return computed, computed if received and computed == num_tokens - 1 else num_tokens


class TransferSettings(Protocol):
    """The fields of SimConfig that shape the incoming KV link."""

    @property
    def block_size(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def kv_transfer_bandwidth_gbps(self) -> float: ...


class KVReceiver:
    """One engine's incoming KV link: how many blocks a sequence receives and when its KV has arrived.

    `cached_prefix` answers how many leading blocks of a hash chain the engine's own pool holds.
    """

    def __init__(self, c: TransferSettings, cached_prefix: Callable[[Sequence[int]], int]) -> None:
        self._block_size = c.block_size
        self._kv_bytes = c.kv_bytes_per_token
        self._gbps = c.kv_transfer_bandwidth_gbps
        self._cached_prefix = cached_prefix
        self._link_free_at = 0.0
        # Counters for stats and tests.
        self.received_blocks = 0
        self.transferred_blocks = 0

    def receive(
        self, kv_from: KVFrom | None, tokens: list[int], seed: int, arrived: Callable[[], None]
    ) -> int:
        """Start receiving a sequence's KV: returns the tokens it covers; `arrived` is called (soon or at once)
        when it is here. Full blocks this engine already caches are not sent again."""
        n = received_tokens(kv_from, len(tokens))
        if n == 0:
            arrived()
            return 0
        bs = self._block_size
        blocks = -(-n // bs)  # the last one may be partial
        moved = blocks - self._cached_prefix(block_hashes(tokens[: n // bs * bs], bs, seed))
        self.received_blocks += blocks
        self.transferred_blocks += moved
        seconds = transfer_seconds(moved, self._block_size, self._kv_bytes, self._gbps)
        if seconds <= 0:
            arrived()
            return n
        now = time.monotonic()
        self._link_free_at = max(now, self._link_free_at) + seconds
        asyncio.get_running_loop().call_later(self._link_free_at - now, arrived)
        return n
