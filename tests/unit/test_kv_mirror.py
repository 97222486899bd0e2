"""The KV log's mirror: records in any order, snapshots, gaps, restarts; and the worker's snapshot records."""

from __future__ import annotations

import asyncio
import random

import msgspec

from kvstore.hashing import block_hashes, chain_seed
from kvstore.kv_mirror import KVMirror
from schemas.kv_events import (
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVLogRecord,
)
from schemas.settings import RouterSettings
from schemas.status import WorkerStatus
from workers import kv_log
from workers.kv_log import KVLog
from workers.metrics import WorkerMetrics


def ev(wid: str, seq: int, *events: KVEvent, inc: float = 1.0) -> KVLogRecord:
    return KVLogRecord(wid, inc, seq, float(seq), events=list(events))


def snap(
    wid: str, seq: int, device: list[int], host: list[int] | None = None, inc: float = 1.0
) -> KVLogRecord:
    return KVLogRecord(wid, inc, seq, float(seq), snapshot=True, device=device, host=host or [])


def test_events_in_order_build_both_tiers() -> None:
    m = KVMirror()
    m.apply(snap("w", 1, []))
    m.apply(ev("w", 2, BlockStored([1, 2, 3]), BlockStored([9], medium=MEDIUM_HOST)))
    m.apply(ev("w", 3, BlockRemoved([2]), BlockRemoved([9], medium=MEDIUM_HOST), BlockStored([4])))
    w = m.workers["w"]
    assert (w.device, w.host, w.whole, w.seq) == ({1, 3, 4}, set(), True, 3)
    assert m.gaps == 0


def test_a_cleared_cache_stays_cleared() -> None:
    m = KVMirror()
    m.apply(snap("w", 1, [1, 2], [3]))
    m.apply(ev("w", 2, AllBlocksCleared()))
    assert len(m.workers["w"]) == 0


def test_the_previous_epoch_read_after_the_current_one_changes_nothing() -> None:
    """A reader of two epochs may get the newer epoch's snapshot first: older records are skipped."""
    m = KVMirror()
    assert m.apply(snap("w", 5, [10, 11]))
    assert m.apply(ev("w", 6, BlockStored([12])))
    for old in (snap("w", 1, []), ev("w", 2, BlockStored([1])), ev("w", 4, BlockRemoved([10]))):
        assert not m.apply(old)
    assert m.workers["w"].device == {10, 11, 12}


def test_a_gap_leaves_the_worker_not_whole_until_its_next_snapshot() -> None:
    m = KVMirror()
    m.apply(snap("w", 1, [1]))
    m.apply(ev("w", 3, BlockStored([2])))  # 2 is missing
    assert m.gaps == 1 and not m.workers["w"].whole
    m.apply(snap("w", 4, [7]))
    assert m.workers["w"].whole and m.workers["w"].device == {7}


def test_a_new_incarnation_starts_afresh_and_the_old_one_is_ignored() -> None:
    m = KVMirror()
    m.apply(snap("w", 1, [1, 2]))
    m.apply(ev("w", 2, BlockStored([3])))
    m.apply(snap("w", 1, [], inc=2.0))  # restarted under the same id: seq starts again
    assert m.workers["w"].device == set()
    assert not m.apply(ev("w", 3, BlockStored([4])))  # a late record of the old process
    assert m.workers["w"].device == set()


def test_a_reader_starting_mid_stream_knows_it_is_not_whole() -> None:
    m = KVMirror()
    m.apply(ev("w", 7, BlockStored([1])))
    assert not m.workers["w"].whole


def test_worker_snapshot_records_carry_the_whole_cache_in_pieces() -> None:
    """The worker's log keeps its blocks from its events; a snapshot too big for one record continues as
    stored blocks, and a mirror fed those records holds exactly the worker's blocks."""
    log = KVLog(None, "", "w", "m", 1.0, 60.0, WorkerMetrics(), clock=lambda: 0.0)  # type: ignore[arg-type]
    device = list(range(1, 12))
    log.add(KVEventBatch(0.0, [BlockStored(device), BlockStored([100, 101], medium=MEDIUM_HOST)]))
    log.add(KVEventBatch(0.0, [BlockRemoved([5])]))
    old = kv_log.SNAPSHOT_MAX
    kv_log.SNAPSHOT_MAX = 4
    try:
        records = log._records(True, [])
    finally:
        kv_log.SNAPSHOT_MAX = old
    assert records[0].snapshot and len(records) == 4  # 10 device + 2 host blocks, 4 per record
    decoded = [msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=KVLogRecord) for r in records]
    m = KVMirror()
    for r in decoded:
        assert m.apply(r)
    w = m.workers["w"]
    assert w.whole and w.device == set(device) - {5} and w.host == {100, 101}
    assert [r.seq for r in records] == [1, 2, 3, 4]


def test_the_mirror_answers_lookups_like_the_index() -> None:
    """Leading blocks per worker on either tier (host-only ones counted apart), only for the workers asked
    about: a worker the frontend no longer sees is never a candidate."""
    m = KVMirror()
    m.apply(snap("a", 1, [1, 2, 3]))
    m.apply(snap("b", 1, [1], [2, 3, 4]))
    m.apply(snap("gone", 1, [1, 2, 3, 4]))
    m.apply(snap("c", 1, [2, 3]))  # not the first block: no overlap
    assert m.overlaps([1, 2, 3, 4], ["a", "b", "c", "unknown"]) == {"a": (3, 0), "b": (4, 3)}


class _Standby:
    def __init__(self, mirror: KVMirror, rebuilding: bool) -> None:
        # Not caught up with the log: outside a rebuild or an outage the index in Redis answers.
        self.mirror, self.rebuilding, self.caught_up = mirror, rebuilding, False

    def overlaps(self, model: str, chain: list[int]) -> dict[str, tuple[int, int]]:
        return self.mirror.overlaps(chain, ["a", "b"])

    def marker_changed(self, marker: str | None) -> bool:
        return False  # the marker the rebuild round read


class _EmptiedIndex:
    def __init__(self) -> None:
        self.fail = False

    async def lookup(self, model: str, chain: list[int]) -> tuple[dict[str, tuple[int, int]], str | None]:
        if self.fail:
            raise ConnectionError("redis down")
        return {}, "m1"  # Redis came back empty


async def test_the_router_asks_the_mirror_while_the_index_is_rebuilt_or_down() -> None:
    from server.metrics import FrontendMetrics
    from server.router import PromptMemo, Router

    tokens = list(range(160))
    chain = block_hashes(tokens, 16, chain_seed("m"))
    mirror = KVMirror()
    mirror.apply(snap("b", 1, chain))
    workers = [WorkerStatus(w, "m", "sim", 16, 1000, 4096, 0.0, 0.0) for w in ("a", "b")]
    index = _EmptiedIndex()
    router = Router(RouterSettings(), FrontendMetrics(), index, random.Random(0))  # type: ignore[arg-type]
    standby = _Standby(mirror, rebuilding=True)
    router.standby = standby
    d = await router.choose("m", workers, PromptMemo(tokens, max_tokens=4))
    assert (d.worker_id, d.predicted_cached_blocks) == ("b", 10)
    standby.rebuilding = False  # rebuilt: the index answers again (here: nothing)
    assert (await router.choose("m", workers, PromptMemo(tokens, max_tokens=4))).predicted_cached_blocks == 0
    index.fail = True  # unreachable: the mirror answers
    assert (await router.choose("m", workers, PromptMemo(tokens, max_tokens=4))).predicted_cached_blocks == 10


class _HeldProducer:
    """A producer whose sends wait until the test lets them through; it keeps what was sent."""

    def __init__(self) -> None:
        self.sent: list[KVLogRecord] = []
        self.gate = asyncio.Event()
        self.sending = asyncio.Event()

    async def send(self, topic: str, value: bytes, key: bytes, partition: int) -> asyncio.Task[None]:
        self.sending.set()
        return asyncio.create_task(self._delivered(value))

    async def _delivered(self, value: bytes) -> None:
        await self.gate.wait()
        self.sent.append(msgspec.msgpack.decode(value, type=KVLogRecord))


async def test_events_added_while_a_record_is_sent_go_in_the_next_record() -> None:
    """A worker's engine steps on while its KV log waits for the broker: what it stored meanwhile is not lost
    with the record under way, and a mirror fed the records holds exactly the worker's blocks."""
    producer = _HeldProducer()
    log = KVLog(producer, "", "w", "m", 1.0, 60.0, WorkerMetrics(), clock=lambda: 0.0)  # type: ignore[arg-type]
    log._created = 0  # the epoch's topics exist (no broker here)
    log.add(KVEventBatch(0.0, [BlockStored([1, 2])]))
    first = asyncio.create_task(log.flush())  # the epoch's first record: a snapshot
    await producer.sending.wait()  # it waits for the broker now
    log.add(KVEventBatch(0.0, [BlockStored([3])]))
    producer.gate.set()
    await first
    await log.flush()
    m = KVMirror()
    for r in producer.sent:
        m.apply(r)
    assert [r.snapshot for r in producer.sent] == [True, False]
    assert m.workers["w"].device == log.own.device == {1, 2, 3}
