"""A copy of the KV block index kept from the KV log: per worker, the blocks it holds on each tier.

Workers keep their own (`WorkerBlocks`, for the snapshots they write); frontends keep every worker's
(`KVMirror`, from the log) and write it back into a Redis that lost the index (`KVIndex.replace_worker`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVLogRecord, is_host


@dataclass
class WorkerBlocks:
    """The blocks one worker process holds, as its KV events and snapshots say."""

    incarnation: float = 0.0
    seq: int = 0  # the last record applied
    device: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)
    # False while records may be missing since the last snapshot: the sets may be wrong until the next one.
    whole: bool = True
    ts: float = 0.0  # when the last record applied was written

    def apply(self, events: list[KVEvent]) -> None:
        """Apply engine events in order."""
        for ev in events:
            match ev:
                case BlockStored():
                    (self.host if is_host(ev.medium) else self.device).update(ev.block_hashes)
                case BlockRemoved():
                    tier = self.host if is_host(ev.medium) else self.device
                    tier.difference_update(ev.block_hashes)
                case AllBlocksCleared():
                    self.device.clear()
                    self.host.clear()

    def __len__(self) -> int:
        return len(self.device | self.host)


class KVMirror:
    """Every worker's blocks, from the records of the KV log in whatever order its topics are read.

    A worker's records carry a sequence number: one at or below the last applied is old (read again, or
    from the epoch before a snapshot already applied) and skipped; a snapshot replaces the worker's sets;
    a record after a missing one is applied but leaves the worker not `whole` until its next snapshot. A
    newer incarnation (a restart under the same id) starts the worker afresh; an older one is ignored.
    """

    def __init__(self) -> None:
        self.workers: dict[str, WorkerBlocks] = {}
        self.gaps = 0  # records that came after a missing one
        self.applied = 0

    def apply(self, rec: KVLogRecord) -> bool:
        """Apply one record; False if it was old and skipped."""
        w = self.workers.get(rec.worker_id)
        if w is None or rec.incarnation > w.incarnation:
            # A record of a process we have not seen yet: only a snapshot, or its first record, is whole.
            w = self.workers[rec.worker_id] = WorkerBlocks(
                rec.incarnation, whole=rec.snapshot or rec.seq == 1
            )
        elif rec.incarnation < w.incarnation or rec.seq <= w.seq:
            return False
        elif not rec.snapshot and rec.seq != w.seq + 1:
            self.gaps += 1
            w.whole = False
        if rec.snapshot:
            w.device, w.host, w.whole = set(rec.device), set(rec.host), True
        else:
            w.apply(rec.events)
        w.seq, w.ts = rec.seq, rec.ts
        self.applied += 1
        return True

    def forget(self, worker_id: str) -> None:
        """Drop a worker (it left for good)."""
        self.workers.pop(worker_id, None)

    def overlaps(self, chain: list[int], among: Collection[str]) -> dict[str, tuple[int, int]]:
        """For each of the workers `among` holding the chain's first block: (leading blocks held on either
        tier, how many of them only on host), as the Redis index's lookup answers."""
        out: dict[str, tuple[int, int]] = {}
        for wid in among:
            w = self.workers.get(wid)
            if w is None:
                continue
            n = host = 0
            for h in chain:
                if h in w.device:
                    n += 1
                elif h in w.host:
                    n += 1
                    host += 1
                else:
                    break
            if n:
                out[wid] = (n, host)
        return out

    def blocks(self) -> int:
        """Blocks held, summed over workers."""
        return sum(len(w) for w in self.workers.values())
