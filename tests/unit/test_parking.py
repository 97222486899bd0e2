"""Decode-first hand-offs on the decode worker: parked attempts, releases in either order, discards, expiry."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus.topics import RequestTopics
from schemas.kafka import Chunk, GenerateRequest, KVFrom, Release
from schemas.names import request_topic
from server.streams import ClientStream, Sequence
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
    serving._release(req, Chunk("r.0", 0, token_ids=[7], text="x", worker_id="p"))
    [(topic, sent)] = outbox.sent
    assert topic == request_topic("d", 100) and (sent.request_id, sent.attempt) == ("r.0", 1)
