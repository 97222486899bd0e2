"""Decode-first hand-offs on the decode worker: parked attempts, releases in either order, discards, expiry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from bus.topics import RequestTopics
from schemas.kafka import Chunk, ErrorInfo, GenerateRequest, KVFrom, Release
from schemas.names import request_topic
from server.router import Decision
from server.streams import ClientStream, Sequence, marker
from workers.engine import EngineOutput
from workers.engine_base import OutputStream
from workers.metrics import WorkerMetrics
from workers.parking import Parking, released
from workers.serving import Serving


def parked(rid: str = "r.0", attempt: int = 1) -> GenerateRequest:
    return GenerateRequest(
        rid, "m", [1, 2, 3], 20, "replies", attempt=attempt, kv_from=KVFrom("p", 3), parked=True
    )


def release(rid: str = "r.0", attempt: int = 1) -> Release:
    token = Chunk(rid, 0, token_ids=[7], text="x", worker_id="p", attempt=attempt - 1)
    return Release(rid, attempt, token, KVFrom("p", 3))


class Started(list[tuple[GenerateRequest, Chunk]]):
    def __call__(self, req: GenerateRequest, first: Chunk) -> None:
        self.append((req, first))


def test_released_attempt_continues_after_the_token_whose_chunk_it_sends_first() -> None:
    run, first = released(parked(), release(), "d")
    assert (run.parked, run.generated_token_ids, run.max_tokens, run.seq_base) == (False, [7], 19, 1)
    assert run.kv_from == KVFrom("p", 3)
    assert (first.seq, first.token_ids, first.text, first.attempt, first.worker_id) == (0, [7], "x", 1, "d")


def test_release_starts_the_parked_attempt_whichever_arrives_first() -> None:
    started = Started()
    p = Parking("d", started)
    p.park(parked("a.0"))
    assert not started and len(p) == 1
    p.release(release("a.0"))
    assert [r.request_id for r, _ in started] == ["a.0"] and len(p) == 0
    p.release(release("b.0"))  # before its attempt: kept
    assert len(started) == 1
    p.park(parked("b.0"))
    assert [r.request_id for r, _ in started] == ["a.0", "b.0"] and len(p) == 0
    p.release(release("a.0"))  # a duplicate: nothing parked for it any more, and nothing runs twice
    assert len(started) == 2


def test_a_release_for_another_attempt_does_not_start_it() -> None:
    started = Started()
    p = Parking("d", started)
    p.park(parked("a.0", attempt=2))
    p.release(release("a.0", attempt=1))
    assert not started and len(p) == 1


def test_discarded_attempt_never_starts_whatever_order_the_messages_take() -> None:
    started = Started()
    p = Parking("d", started)
    p.park(parked("a.0"))
    p.discard("a.0", 1)
    p.release(release("a.0"))
    assert not started and len(p) == 0
    p.discard("b.0", 1)  # before both
    p.release(release("b.0"))
    p.park(parked("b.0"))
    assert not started and len(p) == 0
    p.park(parked("c.0"))
    p.discard("c.0", 2)  # another attempt: this one stays
    p.discard("c.0", -1)  # any attempt
    assert len(p) == 0


def test_parked_attempts_without_release_expire() -> None:
    now = [0.0]
    started = Started()
    p = Parking("d", started, ttl_s=10.0, clock=lambda: now[0])
    p.park(parked("a.0"))
    p.release(release("b.0"))
    now[0] = 11.0
    p.park(parked("c.0"))  # any call sweeps what is older than the TTL
    assert len(p) == 1
    p.park(parked("b.0"))  # its early release expired
    assert not started and len(p) == 2


async def test_the_stream_takes_the_token_from_whichever_attempt_lands_first() -> None:
    def stream() -> tuple[ClientStream, Sequence]:
        s = ClientStream("r")
        seq = Sequence("r.0", 0, 0, None, 3)  # type: ignore[arg-type]  # (no routing here)
        s.sequences["r.0"] = seq
        return s, seq

    prefill_token = Chunk("r.0", 0, token_ids=[7], worker_id="p", attempt=0)
    echo = Chunk("r.0", 0, token_ids=[7], worker_id="d", attempt=1)
    second = Chunk("r.0", 1, token_ids=[8], worker_id="d", attempt=1)
    for order in ([prefill_token, echo, second], [echo, prefill_token, second]):
        s, seq = stream()
        for c in order:
            s.put(c)
        assert (seq.token_ids, seq.attempt, seq.next_seq, seq.broken) == ([7, 8], 1, 2, False)
        assert len(await asyncio.wait_for(s.get(1.0), 1.0)) == 2


class Outbox:
    """What a Serving's release needs of the outbox: where each request-topic record went."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Release]] = []

    def put_request(self, topic: str, message: Release, delivered: Callable[[], None] | None = None) -> None:
        self.sent.append((topic, message))


async def test_a_release_goes_to_the_decode_workers_current_epoch_not_its_unrolled_topic() -> None:
    # The unrolled requests topic is never trimmed on the embedded broker: a release per disaggregated
    # request there would grow it for the worker's life.
    outbox = Outbox()
    now = 6_000.0
    serving = Serving(None, outbox, None, "p", lambda exc: None, RequestTopics(60.0, clock=lambda: now))  # type: ignore[arg-type]
    req = GenerateRequest("r.0", "m", [1, 2, 3], 20, "replies", prefill_only=True, release_to="d")
    serving._release(req, Chunk("r.0", 0, token_ids=[7], text="x", worker_id="p"), None)
    [(topic, sent)] = outbox.sent
    assert topic == request_topic("d", 100) and (sent.request_id, sent.attempt) == ("r.0", 1)
    assert sent.kv_from == KVFrom("p", 3)


def test_the_prefill_engines_kv_descriptor_reaches_the_decode_attempt() -> None:
    # NIXL's decode engine pulls the blocks the prefill engine names; only the release carries the names.
    outbox = Outbox()
    serving = Serving(None, outbox, None, "p", lambda exc: None, RequestTopics(60.0))  # type: ignore[arg-type]
    req = GenerateRequest("r.0", "m", [1, 2, 3], 20, "replies", prefill_only=True, release_to="d")
    descriptor = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[4]]}
    serving._release(req, Chunk("r.0", 0, token_ids=[7], worker_id="p"), descriptor)
    [(_, sent)] = outbox.sent
    assert sent.kv_from == KVFrom("p", 3, descriptor)
    run, _ = released(parked(), sent, "d")
    assert run.kv_from is not None and run.kv_from.connector == descriptor


def held_stream() -> tuple[ClientStream, Sequence]:
    s = ClientStream("r")
    seq = Sequence("r.0", 0, 0, Decision("p"), 3, hold_first=True)
    s.sequences["r.0"] = seq
    return s, seq


def delivered(s: ClientStream) -> list[tuple[int, int]]:
    return [(c.seq, c.attempt) for _, c in s._items]


def test_a_held_prefill_token_reaches_the_client_with_the_decode_workers_copy_of_it() -> None:
    prefill_token = Chunk("r.0", 0, token_ids=[7], worker_id="p", attempt=0)
    copy = Chunk("r.0", 0, token_ids=[7], worker_id="d", attempt=1)
    second = Chunk("r.0", 1, token_ids=[8], worker_id="d", attempt=1)
    s, seq = held_stream()
    s.put(prefill_token)
    # It counts at once (a move from here continues after it), but the client does not get it yet,
    s.put(marker("r.0", 1, "d"))  # not on the hand-off's marker either,
    assert (seq.token_ids, seq.next_seq, delivered(s)) == ([7], 1, [])
    s.put(copy)  # but once the decode worker started the sequence.
    assert delivered(s) == [(0, 0)]
    s.put(second)
    assert delivered(s) == [(0, 0), (1, 1)] and seq.token_ids == [7, 8]
    # The copy first: the decode worker's attempt is the sequence's, and nothing waits.
    s, seq = held_stream()
    for c in (copy, prefill_token, second):
        s.put(c)
    assert delivered(s) == [(0, 1), (1, 1)]


def test_a_held_token_goes_out_before_whatever_comes_instead_of_the_copy() -> None:
    prefill_token = Chunk("r.0", 0, token_ids=[7], worker_id="p", attempt=0)
    # The decode worker was lost: the sequence moved, and the new worker's first chunk follows the token.
    s, _ = held_stream()
    for c in (
        prefill_token,
        marker("r.0", 2, "d2"),
        Chunk("r.0", 1, token_ids=[8], worker_id="d2", attempt=2),
    ):
        s.put(c)
    assert delivered(s) == [(0, 0), (1, 2)]
    # The frontend ended it.
    s, _ = held_stream()
    s.put(prefill_token)
    s.fail("r.0", ErrorInfo("timeout", "no progress"))
    assert delivered(s) == [(0, 0), (1, 0)]
    # A token that ends the sequence by itself is not held; nor is anything without the setting.
    s, _ = held_stream()
    s.put(Chunk("r.0", 0, token_ids=[2], finish_reason="stop", worker_id="p"))
    s2 = ClientStream("r")
    s2.sequences["r.0"] = Sequence("r.0", 0, 0, Decision("p"), 3)
    s2.put(prefill_token)
    assert delivered(s) == delivered(s2) == [(0, 0)]


class _Engine:
    """Just enough of an engine to tell when a sequence is scheduled and to take its outputs."""

    def __init__(self) -> None:
        self.on_scheduled: Callable[[], None] | None = None
        self.sink: Callable[[EngineOutput], None] | None = None
        self.pushed = asyncio.Event()

    def generate(self, req: GenerateRequest) -> OutputStream:
        async def nothing() -> AsyncGenerator[EngineOutput, None]:
            return
            yield

        def push(sink: Callable[[EngineOutput], None]) -> asyncio.Future[None]:
            self.sink = sink
            self.pushed.set()
            return asyncio.get_running_loop().create_future()

        def scheduled(callback: Callable[[], None]) -> None:
            self.on_scheduled = callback

        return OutputStream(nothing(), lambda: None, push=push, scheduled=scheduled)


class _Outbox(Outbox):
    linger_s = 0.002

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[Chunk] = []
        self.urgent: list[bool] = []

    def put(self, req: GenerateRequest, chunk: Chunk, urgent: bool = False) -> None:
        self.chunks.append(chunk)
        self.urgent.append(urgent)


async def test_a_released_attempt_sends_the_token_when_its_engine_schedules_it() -> None:
    engine, outbox = _Engine(), _Outbox()
    serving = Serving(engine, outbox, WorkerMetrics(), "d", lambda exc: None)  # type: ignore[arg-type]
    run, first = released(parked(), release(), "d")
    task = serving.start(run, first)
    await asyncio.wait_for(engine.pushed.wait(), 5)
    # In the engine's queue: sent now, it would reach the client a wait for the engine's step early.
    assert outbox.chunks == []
    assert engine.on_scheduled is not None
    engine.on_scheduled()
    assert outbox.chunks == [first]
    assert engine.sink is not None
    engine.sink(EngineOutput([8], text="y"))
    assert [(c.seq, c.token_ids) for c in outbox.chunks] == [(0, [7]), (1, [8])]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_only_a_sequences_first_tokens_skip_the_outboxs_linger() -> None:
    engine, outbox = _Engine(), _Outbox()
    serving = Serving(engine, outbox, WorkerMetrics(), "d", lambda exc: None)  # type: ignore[arg-type]
    run, first = released(parked(), release(), "d")
    task = serving.start(run, first)
    await asyncio.wait_for(engine.pushed.wait(), 5)
    assert engine.on_scheduled is not None and engine.sink is not None
    sink, engine.sink = engine.sink, None
    engine.on_scheduled()
    sink(EngineOutput([8], text="y"))
    sink(EngineOutput([9], text="y"))  # the worker's only sequence: nothing to wait for
    engine.pushed.clear()
    other = serving.start(parked("r.1"))  # a second sequence in flight
    await asyncio.wait_for(engine.pushed.wait(), 5)
    sink(EngineOutput([10], text="y"))
    serving.step_s = 0.05  # an engine stepping slower than the linger: nothing to gather
    sink(EngineOutput([11], text="y"))
    # The hand-off's token and the decode engine's first are what the client waits for; the rest may linger.
    assert [(c.token_ids, u) for c, u in zip(outbox.chunks, outbox.urgent, strict=True)] == [
        ([7], True), ([8], True), ([9], True), ([10], False), ([11], True),
    ]  # fmt: skip
    for t in (task, other):
        t.cancel()
    await asyncio.gather(task, other, return_exceptions=True)
