"""The move state machine of server/migration.py: which losses start, repeat or are ignored by a move."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, cast

import pytest

from server.metrics import FrontendMetrics
from server.migration import MOVE_STALLS, Mover, Services, transition
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

    def fail(self, seq: Sequence, message: str, code: str = "worker_died") -> None:
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
