"""A decode worker's side of the decode-first hand-off: attempts parked until their prefill worker releases them.

A disaggregated sequence's frontend sends its decode attempt (`parked`) to the decode worker together with the
prefill attempt to the prefill worker. The prefill worker, once it has the token, sends a `Release` straight to
the decode worker's own topic (workers/serving.py), so the decode worker starts at about the time the
frontend reads that token, not a broker round trip after the frontend's own hand-off. Either may arrive
first: a release without its parked attempt waits here for it. An attempt the frontend gave up on (the
sequence ended, or moved elsewhere) is discarded by an attempt's `Cancel`, whichever of the three comes first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from schemas.kafka import Chunk, GenerateRequest, Release

log = logging.getLogger("ferry.worker")

# A parked attempt (or an early release) nobody released (or parked) this long is dropped: its prefill
# worker died and the frontend moved the sequence, or the frontend itself is gone.
PARK_TTL_S = 300.0
# Releases and discards remembered for an attempt not (yet) parked here.
REMEMBERED = 4096

Key = tuple[str, int]


def released(req: GenerateRequest, release: Release, worker_id: str) -> tuple[GenerateRequest, Chunk]:
    """The attempt to run, continuing after the released token, and the token's chunk as its first chunk."""
    tokens = list(release.chunk.token_ids)
    run = msgspec.structs.replace(
        req,
        parked=False,
        generated_token_ids=[*req.generated_token_ids, *tokens],
        max_tokens=req.max_tokens - len(tokens),
        kv_from=release.kv_from,
        seq_base=release.chunk.end,
    )
    first = msgspec.structs.replace(release.chunk, attempt=req.attempt, worker_id=worker_id)
    return run, first


class Parking:
    """Parked attempts, releases that came before theirs, and discarded attempts; `start` runs a released one."""

    def __init__(
        self,
        worker_id: str,
        start: Callable[[GenerateRequest, Chunk], object],
        ttl_s: float = PARK_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._worker_id = worker_id
        self._start = start
        self._ttl_s = ttl_s
        self._clock = clock
        self._parked: OrderedDict[Key, tuple[float, GenerateRequest]] = OrderedDict()
        self._early: OrderedDict[Key, tuple[float, Release]] = OrderedDict()
        self._discarded: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, req: GenerateRequest) -> None:
        """Hold `req` until its release (at once if the release came first)."""
        key = (req.request_id, req.attempt)
        self._expire()
        if key in self._discarded:
            return
        early = self._early.pop(key, None)
        if early is not None:
            self._run(req, early[1])
            return
        self._parked[key] = (self._clock(), req)

    def release(self, release: Release) -> None:
        """Start the parked attempt `release` names (or keep the release until it is parked)."""
        key = (release.request_id, release.attempt)
        self._expire()
        if key in self._discarded:
            return
        parked = self._parked.pop(key, None)
        if parked is None:
            self._early[key] = (self._clock(), release)
            if len(self._early) > REMEMBERED:
                self._early.popitem(last=False)
            return
        self._run(parked[1], release)

    def discard(self, request_id: str, attempt: int) -> None:
        """Drop the parked `attempt` of `request_id` (every parked one with -1) and whatever comes for it later."""
        keys = [k for k in self._parked if k[0] == request_id] if attempt < 0 else [(request_id, attempt)]
        for key in keys:
            self._parked.pop(key, None)
            self._early.pop(key, None)
            self._discarded[key] = None
        while len(self._discarded) > REMEMBERED:
            self._discarded.popitem(last=False)

    def _run(self, req: GenerateRequest, release: Release) -> None:
        run, first = released(req, release, self._worker_id)
        self._start(run, first)

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        waiting_for = ((self._parked, "its release"), (self._early, "its parked attempt"))
        for entries, missing in waiting_for:
            while entries:
                key, (at, _) = next(iter(entries.items()))
                if at >= cutoff:
                    break
                del entries[key]
                log.info("request %s attempt %d: kept %.0fs without %s; dropped", *key, self._ttl_s, missing)
