"""The move state machine of server/migration.py: which losses start, repeat or are ignored by a move."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any, cast

import pytest

from schemas.kafka import Chunk, GenerateRequest, KVFrom
from server.errors import APIError
from server.metrics import FrontendMetrics
from server.migration import MOVE_STALLS, Mover, transition
from server.move_needs import Services
from server.router import Decision
from server.streams import Loss, MoveState, Sequence


class FakeRequest:
    """A request whose moves are recorded, never run."""

    def __init__(self) -> None:
        self.closed = False
        self.started: list[str] = []
        self.failed: list[str] = []

    def own(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        coro.close()
        self.started.append(name)

    def fail(self, seq: Sequence, message: str, code: str = "worker_died", retriable: bool = True) -> None:
        self.failed.append(message)


class FakeServices:
    def __init__(self) -> None:
        self.metrics = FrontendMetrics()


def seq() -> Sequence:
    return Sequence("r.0", 0, 0, Decision(worker_id="w1"), prompt_len=4)


def mover() -> tuple[Mover, FakeRequest, FakeServices]:
    req, svc = FakeRequest(), FakeServices()
    return Mover(cast(Any, req), cast(Services, svc)), req, svc


def test_the_machine_allows_only_its_transitions() -> None:
    s = seq()
    with pytest.raises(AssertionError):
        transition(s, MoveState.MOVING_AGAIN)  # nothing to move again
    transition(s, MoveState.MOVING)
    with pytest.raises(AssertionError):
        transition(s, MoveState.MOVING)  # one move at a time
    transition(s, MoveState.MOVING_AGAIN)
    transition(s, MoveState.MOVING)
    transition(s, MoveState.IN_PLACE)
    assert s.move is MoveState.IN_PLACE


def test_a_loss_in_place_starts_one_move() -> None:
    m, req, _ = mover()
    s = seq()
    m.lost(s, Loss.WORKER_DIED)
    assert s.move is MoveState.MOVING and req.started == ["migrate-r.0"]
    assert s.moves == 1  # a dead worker counts toward --migration-limit


def test_a_loss_during_a_move_makes_it_start_over_instead_of_a_second_move() -> None:
    m, req, _ = mover()
    s = seq()
    m.lost(s, Loss.LOG_LOST)
    m.lost(s, Loss.LOG_LOST)
    assert s.move is MoveState.MOVING_AGAIN
    assert s.switched.is_set() and s.progressed.is_set()  # a move waiting on its marker wakes up
    m.lost(s, Loss.WORKER_DIED)
    assert s.move is MoveState.MOVING_AGAIN and req.started == ["migrate-r.0"]
    assert s.moves == 1  # only the worker's death counts


def test_the_brokers_losses_do_not_count_toward_the_limit_and_gaps_are_counted() -> None:
    m, _, svc = mover()
    s = seq()
    m.lost(s, Loss.CHUNK_LOST)
    assert s.moves == 0 and svc.metrics.reply_gaps._value.get() == 1
    s2 = seq()
    m.lost(s2, Loss.REQUEST_LOST)
    assert s2.moves == 0 and s2.move is MoveState.MOVING


def test_a_finished_sequence_or_a_closed_request_does_not_move() -> None:
    m, req, _ = mover()
    s = seq()
    s.finished = True
    m.lost(s, Loss.WORKER_DIED)
    req.closed = True
    m.lost(seq(), Loss.WORKER_DIED)
    assert req.started == [] and s.move is MoveState.IN_PLACE


def test_a_stalled_move_is_made_again_a_few_times_then_fails() -> None:
    m, req, _ = mover()
    s = seq()
    transition(s, MoveState.MOVING)
    for _ in range(MOVE_STALLS):
        m._stalled(s, "its marker did not come back")
        assert s.move is MoveState.MOVING_AGAIN and not req.failed
        transition(s, MoveState.MOVING)
    m._stalled(s, "its marker did not come back")
    assert s.move is MoveState.MOVING and len(req.failed) == 1


async def test_a_move_always_ends_in_place() -> None:
    """Whatever ends the move loop (here: the request closed before the move routed), the state returns."""
    req = FakeRequest()
    req.closed = True
    m = Mover(cast(Any, req), cast(Services, FakeServices()))
    s = seq()
    s.moves = 99  # over any limit: the move fails at once, without routing
    transition(s, MoveState.MOVING)
    svc = cast(Any, m._svc)
    svc.migration_limit = 3
    await asyncio.wait_for(m._migrate(s), 5)
    assert s.move is MoveState.IN_PLACE and req.failed


class HandOffServices(FakeServices):
    """Live workers p1, d1, d2; a broker that acknowledges markers but never delivers them back."""

    def __init__(self) -> None:
        super().__init__()
        self.migration_limit = 3
        self.request_timeout_s = 5.0
        self.notes: list[Chunk] = []
        self.sent: list[tuple[str, GenerateRequest]] = []
        self.pool = SimpleNamespace(
            live=lambda model: [SimpleNamespace(worker_id=w) for w in ("p1", "d1", "d2")]
        )
        self.router = SimpleNamespace(finished=lambda d: None, started=lambda d: None)
        self.dispatcher = SimpleNamespace(note=self._note, submit=self._submit)

    async def _note(self, topic: str, chunk: Chunk) -> None:
        self.notes.append(chunk)

    async def _submit(self, worker_id: str, request: GenerateRequest, cancel_on_timeout: bool = True) -> int:
        self.sent.append((worker_id, request))
        return len(self.sent)


class HandOffRequest(FakeRequest):
    model, reply_topic = "m", "replies"
    prepared = SimpleNamespace(max_tokens=8)

    def submitted(self, seq: Sequence) -> bool:
        return True

    def request_for(
        self, seq: Sequence, generated: list[int] | None = None, kv_from: KVFrom | None = None,
        attempt: int | None = None,
    ) -> GenerateRequest:  # fmt: skip
        return GenerateRequest(seq.request_id, "m", [1, 2, 3, 4], 8, "replies", generated_token_ids=generated or [],
                               attempt=seq.attempt if attempt is None else attempt, kv_from=kv_from)  # fmt: skip


async def test_a_hand_off_sends_the_decode_request_without_waiting_for_its_marker_to_come_back() -> None:
    req, svc = HandOffRequest(), HandOffServices()
    m = Mover(cast(Any, req), cast(Services, svc))
    s = Sequence("r.0", 0, 0, Decision(worker_id="p1"), prompt_len=4, token_ids=[7])
    s.handoff, s.kv_from = Decision(worker_id="d1"), KVFrom("p1", 4)
    transition(s, MoveState.MOVING)
    # The broker never delivers the marker back: waiting for it would stall here for MOVE_STALL_S.
    await asyncio.wait_for(m._move(s), 2)
    assert [c.attempt for c in svc.notes] == [1]
    assert [(w, r.attempt, r.generated_token_ids) for w, r in svc.sent] == [("d1", 1, [7])]
    assert (s.attempt, s.claimed, s.worker_id) == (0, 1, "d1")  # its marker is still on its way
    # Moved again before that marker came back: the next attempt is a new one, not attempt 1 a second time.
    s.handoff, s.kv_from = Decision(worker_id="d2"), KVFrom("p1", 4)
    await asyncio.wait_for(m._move(s), 2)
    assert [c.attempt for c in svc.notes] == [1, 2] and svc.sent[-1][1].attempt == 2


async def test_a_released_hand_off_only_writes_its_marker_and_watches_the_parked_attempt() -> None:
    """Decode-first: the decode attempt went out parked with the prefill one and the prefill worker released
    it; the hand-off sends no request, and moving the sequence before its token drops the parked attempt."""
    req, svc = HandOffRequest(), HandOffServices()
    watched: list[tuple[GenerateRequest, int]] = []
    discarded: list[tuple[str, str]] = []
    req.discard_parked = lambda seq, worker_id: discarded.append((seq.request_id, worker_id))  # type: ignore[attr-defined]
    m = Mover(cast(Any, req), cast(Services, svc))
    m.watch = lambda seq, request, offset: watched.append((request, offset))  # type: ignore[method-assign]
    s = Sequence("r.0", 0, 0, Decision(worker_id="p1"), prompt_len=4, token_ids=[7], next_seq=1, claimed=1)
    s.handoff, s.kv_from = Decision(worker_id="d1"), KVFrom("p1", 4)
    s.parked = req.request_for(s, [], s.kv_from, attempt=1)
    s.parked_offset = 41
    transition(s, MoveState.MOVING)
    await asyncio.wait_for(m._move(s), 2)
    assert [(c.attempt, c.worker_id) for c in svc.notes] == [(1, "d1")] and svc.sent == []
    assert [(r.attempt, r.seq_base, o) for r, o in watched] == [(1, 1, 41)]
    assert (s.parked, s.worker_id, s.claimed, discarded) == (None, "d1", 1, [])
    # The prefill worker lost before its token: the parked attempt is dropped, the move claims attempt 2.
    s = Sequence("r.1", 0, 0, Decision(worker_id="p1"), prompt_len=4, claimed=1)
    s.handoff, s.kv_from = Decision(worker_id="d1"), KVFrom("p1", 4)
    s.parked = req.request_for(s, [], s.kv_from, attempt=1)
    assert m._take_handoff(s) == (None, None)
    assert discarded == [("r.1", "d1")]


async def test_a_hand_off_sends_its_marker_and_its_request_together() -> None:
    """Neither send waits for the other's acknowledgement: one after the other, each would be a broker round
    trip in the gap after the first token. (Sent in turn, the two sends below would never both start.)"""
    req, svc = HandOffRequest(), HandOffServices()
    both = asyncio.Barrier(2)
    note, submit = svc._note, svc._submit

    async def held_note(topic: str, chunk: Chunk) -> None:
        await both.wait()
        await note(topic, chunk)

    async def held_submit(worker_id: str, request: GenerateRequest, cancel_on_timeout: bool = True) -> int:
        await both.wait()
        return await submit(worker_id, request, cancel_on_timeout)

    svc.dispatcher = SimpleNamespace(note=held_note, submit=held_submit)
    m = Mover(cast(Any, req), cast(Services, svc))
    s = Sequence("r.0", 0, 0, Decision(worker_id="p1"), prompt_len=4, token_ids=[7])
    s.handoff, s.kv_from = Decision(worker_id="d1"), KVFrom("p1", 4)
    transition(s, MoveState.MOVING)
    await asyncio.wait_for(m._move(s), 2)
    assert [c.attempt for c in svc.notes] == [1] and [(w, r.attempt) for w, r in svc.sent] == [("d1", 1)]
    assert req.started == ["watch-r.0"] and not req.failed  # a first attempt's delivery check watches it


async def test_a_hand_off_whose_marker_the_broker_refuses_fails_the_sequence() -> None:
    """Its request may be on the decode worker already: failing the sequence cancels it there too."""
    req, svc = HandOffRequest(), HandOffServices()
    svc.request_timeout_s = 0.0  # the broker stays away: no second try

    async def refused(topic: str, chunk: Chunk) -> None:
        raise APIError(503, "The message broker is unavailable", code="broker_unavailable")

    svc.dispatcher = SimpleNamespace(note=refused, submit=svc._submit)
    m = Mover(cast(Any, req), cast(Services, svc))
    s = Sequence("r.0", 0, 0, Decision(worker_id="p1"), prompt_len=4, token_ids=[7])
    s.handoff, s.kv_from = Decision(worker_id="d1"), KVFrom("p1", 4)
    transition(s, MoveState.MOVING)
    await asyncio.wait_for(m._move(s), 2)
    assert len(req.failed) == 1 and "worker d1" in req.failed[0] and s.worker_id == "d1"
    assert svc.metrics.migrations.labels("worker_died", "failed")._value.get() == 1
