"""Moving sequences whose attempt was lost: each sequence's move.

Every loss travels one way. Its detector (the worker pool for a dead worker, the replies reader for a
log the broker lost, a stream for a missing chunk or a worker's word that it cannot finish an attempt, the
delivery check for a request without answer) calls `Migrations` (server/losses.py), which decides for the
frontend, or the request's `Mover` directly, which moves its sequences.
A sequence's move state (`MoveState`) changes only through `transition`.

A move routes the sequence again as a prompt of the original prompt plus the tokens it has received,
writes a marker into the replies topic (from there only the new attempt's chunks count, live and in a
replay), waits until the marker came back, stops the old worker and sends the request to the new one.
A broker that restarted empty can lose what a move sends (docs/architecture.md, broker quirk "lost again
after a restart"): a move whose marker or first chunk does not come back in time is made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from schemas.kafka import REPEATED_ENGINE_DEATH, Chunk, ChunkUsage, GenerateRequest, KVFrom
from server.errors import APIError
from server.losses import engine_death
from server.move_needs import MovingRequest, Services
from server.router import Decision, PromptMemo
from server.streams import Loss, MoveState, Sequence, marker

log = logging.getLogger("ferry.frontend")

# A move whose marker, or first chunk, did not come back this long after it went out is made again, at most
# MOVE_STALLS times.
MOVE_STALL_S = 10.0
MOVE_STALLS = 3
# After the broker lost the replies log, how long a first attempt that stays silent past
# `--delivery-check-s` is sent again although its request is still in the worker's topic: the broker can
# also lose replies a worker writes in the first seconds after its restart, and then nothing else would
# ever answer the request. A needless second attempt in that window costs one prefill.
REPLIES_IN_DOUBT_S = 60.0

T = TypeVar("T")

# Losses of a worker, which --migration-limit bounds.
_WORKER_LOSSES = frozenset({Loss.WORKER_DIED, Loss.ENGINE_DIED, Loss.WORKER_STOPPED})

_TRANSITIONS: dict[MoveState, set[MoveState]] = {
    MoveState.IN_PLACE: {MoveState.MOVING},
    MoveState.MOVING: {MoveState.MOVING_AGAIN, MoveState.IN_PLACE},
    MoveState.MOVING_AGAIN: {MoveState.MOVING, MoveState.IN_PLACE},
}


def transition(seq: Sequence, to: MoveState) -> None:
    """Change a sequence's move state; a change the machine does not allow is a bug."""
    if to not in _TRANSITIONS[seq.move]:
        raise AssertionError(f"{seq.request_id}: no move transition from {seq.move.name} to {to.name}")
    seq.move = to


class Mover:
    """Moves the sequences of one request, one move at a time per sequence."""

    def __init__(self, req: MovingRequest, svc: Services) -> None:
        # Weak: the request holds its Mover (its stream `lost`), so a strong ref back made every request a cycle.
        self._req = weakref.proxy(req)
        self._svc = svc

    def lost(self, seq: Sequence, why: Loss) -> None:
        """The sequence's attempt can no longer deliver: move it (in the background)."""
        try:
            if self._req.closed or seq.finished:
                return
        except ReferenceError:  # its request was dropped without closing (it failed to start): nothing reads it
            return
        if why in _WORKER_LOSSES:
            seq.moves += 1  # what --migration-limit bounds; the broker's losses are not the request's doing
        elif why is Loss.CHUNK_LOST:
            self._svc.metrics.reply_gaps.inc()
        if why in (Loss.ENGINE_DIED, Loss.WORKER_STOPPED):
            # Its worker said so itself: it is going, whatever the registry says yet (its other sequences move
            # once it has left); nothing may be routed there meanwhile, least of all this sequence.
            self._svc.pool.depart(seq.lost_on, why.value)
            self._svc.metrics.worker_failures.inc()
            refusal = engine_death(seq) if why is Loss.ENGINE_DIED else None
            if refusal is not None:
                seq.move_reason = why.name.lower()
                self._fail(seq, refusal, REPEATED_ENGINE_DEATH, retriable=False)
                return
        if seq.move is not MoveState.IN_PLACE:
            # Lost again while moving: two moves at once would both claim the next attempt with different
            # tokens so far. (A broker that loses its log twice, as the embedded one does after an empty
            # restart, takes the move's own marker or request with it.) Move once more when this move is
            # done, or at once if it still waits for its marker, which may have gone with the log.
            if seq.move is MoveState.MOVING:
                transition(seq, MoveState.MOVING_AGAIN)
            seq.switched.set()
            seq.progressed.set()
            return
        transition(seq, MoveState.MOVING)
        seq.move_reason = why.name.lower()
        self._req.own(self._migrate(seq), f"migrate-{seq.request_id}")

    def hand_off(self, seq: Sequence) -> None:
        """A disaggregated sequence's prefill worker sent its token: move it to its decode worker.

        A move in all but name (server/disagg.py): the same marker, attempt and sequence numbers, so dedupe,
        ordering, resumed streams and cancellation work as for any move; it does not count as a migration.
        """
        if self._req.closed or seq.finished or seq.move is not MoveState.IN_PLACE:
            return  # (a move under way takes the hand-off with it: see _move)
        transition(seq, MoveState.MOVING)
        seq.move_reason = "handoff"
        self._req.own(self._migrate(seq), f"handoff-{seq.request_id}")

    def _fail(self, seq: Sequence, message: str, code: str = "worker_died", retriable: bool = True) -> None:
        """The move failed: the sequence ends with an error (counted as the move's outcome)."""
        self._svc.metrics.migrations.labels(seq.move_reason, "failed").inc()
        self._req.fail(seq, message, code, retriable)

    def watch(self, seq: Sequence, request: GenerateRequest, offset: int) -> None:
        """Send a first attempt again if it gets no answer and the broker no longer holds its request."""

        async def watch() -> None:
            lost = await self._unanswered(seq, request, offset)
            if lost is None or seq.move is not MoveState.IN_PLACE:
                return
            self._svc.metrics.requests_lost.inc()
            log.warning(
                "%s: no answer from worker %s after %.0fs and %s; sending it again",
                seq.request_id,
                seq.worker_id,
                self._svc.delivery_check_s,
                lost,
            )
            self.lost(seq, Loss.REQUEST_LOST)

        self._req.own(watch(), f"watch-{seq.request_id}")

    async def _migrate(self, seq: Sequence) -> None:
        try:
            while True:
                sent = await self._move(seq)
                if seq.move is MoveState.MOVING and sent is not None and not await self._started(seq, sent):
                    self._stalled(seq, f"nothing came from worker {seq.worker_id} within {MOVE_STALL_S:.0f}s")
                if seq.move is MoveState.MOVING or seq.finished or self._req.closed:
                    return
                transition(seq, MoveState.MOVING)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("migrating %s failed", seq.request_id)
            self._fail(seq, f"could not move the sequence: {exc!r}")
        finally:
            transition(seq, MoveState.IN_PLACE)

    def _stalled(self, seq: Sequence, what: str) -> None:
        """A move went wrong (its marker or request lost): move again, a few times; then give up."""
        if seq.stalls == MOVE_STALLS:
            self._fail(seq, f"moving the sequence failed: {what}, {MOVE_STALLS + 1} times")
            return
        seq.stalls += 1
        log.warning("%s: %s; moving it again", seq.request_id, what)
        if seq.move is MoveState.MOVING:  # (lost again meanwhile: it moves again anyway)
            transition(seq, MoveState.MOVING_AGAIN)

    async def _started(self, seq: Sequence, request: GenerateRequest) -> bool:
        """True once the moved sequence produced a chunk (or ended, or was lost again); False after
        MOVE_STALL_S without any.

        A timer, not the delivery check: the broker can also refuse a worker's replies for good
        (docs/architecture.md, broker quirk "lost again after a restart"), and a move made again is what
        gets the stream going then. A move is rare enough that one made again under a prefill longer than
        MOVE_STALL_S costs little.
        """
        try:
            async with asyncio.timeout(MOVE_STALL_S):
                while seq.next_seq <= request.seq_base and not seq.finished and seq.move is MoveState.MOVING:
                    seq.progressed.clear()
                    await seq.progressed.wait()
        except TimeoutError:
            return seq.finished or self._req.closed
        return True

    async def _unanswered(self, seq: Sequence, request: GenerateRequest, offset: int) -> str | None:
        """Wait for the attempt sent at `offset` to produce a chunk (or to be ended or lost otherwise):
        None. After `delivery_check_s` without one, why it must be sent again: the broker no longer holds
        its request, or it lost its log lately, so the worker's replies may be gone too.

        Otherwise a request still in the log is waiting for its worker (a long prefill, a queue): wait on.
        """
        svc = self._svc

        def waiting() -> bool:
            return (
                seq.next_seq <= request.seq_base
                and seq.attempt <= request.attempt  # (a hand-off's marker may not be back yet)
                and not seq.finished
                and not self._req.closed
                and seq.move is not MoveState.MOVING_AGAIN
            )

        while waiting():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(svc.delivery_check_s):
                    while waiting():
                        seq.progressed.clear()
                        await seq.progressed.wait()
            if waiting():
                held = await svc.requests.holds(seq.worker_id, offset, request)
                if held is False and waiting():
                    return "the broker no longer holds its request (restarted empty?)"
                in_doubt = time.monotonic() - svc.migrations.log_lost_at < REPLIES_IN_DOUBT_S
                if held and waiting() and in_doubt:
                    return "the broker lost its log lately (its replies may be gone with it)"
        return None

    async def _move(self, seq: Sequence) -> GenerateRequest | None:
        """Send the prompt and the tokens so far to another worker; its chunks continue the stream.

        Returns the request it sent, if it sent one.
        """
        svc, req = self._svc, self._req
        # A move abandoned before its request went out leaves the worker that really runs the sequence here.
        old = seq.moved_from or seq.decision.worker_id
        if seq.moves > svc.migration_limit:
            self._fail(
                seq,
                f"worker {old} stopped responding; the sequence already moved {seq.moves - 1} time(s) "
                f"(migration limit {svc.migration_limit})",
            )
            return None
        handoff, kv_from = self._take_handoff(seq)
        decision = handoff or await self._reroute(seq, old)
        if decision is None or seq.finished or req.closed or not req.submitted(seq):
            if handoff is not None:
                svc.router.finished(handoff)
            return None
        # Load moves with the sequence (no await between the check above and these lines); a hand-off's decode
        # worker has been charged since the sequence started.
        svc.router.finished(seq.decision)
        if handoff is None:
            svc.router.started(decision)
        decision.remaining = seq.decision.remaining  # what the sequence may still generate goes with it
        seq.decision = decision
        seq.moved_from = old
        # A hand-off's request goes out before its marker is back: the attempt it claimed is taken.
        target = max(seq.attempt, seq.claimed) + 1
        if kv_from is not None:
            await self._hand_over(seq, kv_from, target)
            return None
        if not await self._mark(seq, target, old):
            return None
        # Only now may the old worker be stopped: its abort would otherwise have ended the sequence. (It
        # may be alive after all, e.g. its heartbeats were late; it may even be the worker chosen now.)
        await svc.dispatcher.cancel(old, seq.request_id)
        seq.moved_from = ""
        if seq.finished:
            return None  # the old worker's last chunk landed before the marker
        generated = list(seq.token_ids)
        if len(generated) >= req.prepared.max_tokens:
            # Every token arrived but not the final chunk: end it here, as the worker would have.
            usage = ChunkUsage(seq.prompt_len, len(generated))
            req.end(seq, Chunk(seq.request_id, seq.next_seq, finish_reason="length", usage=usage,
                               worker_id=old, attempt=seq.attempt))  # fmt: skip
            return None
        log.warning(
            "moving %s from worker %s to %s (attempt %d, %d token(s) so far)",
            seq.request_id,
            old,
            decision.worker_id,
            target,
            len(generated),
        )
        request = req.request_for(seq, generated, attempt=target)
        seq.claimed = target  # from here the worker may run it, whether or not the send below succeeds
        try:
            # No cancel behind a timed-out copy: the next copy is the same attempt and must run (the worker
            # runs whichever arrives first and drops the other as a duplicate).
            await self._while_broker_away(
                lambda: svc.dispatcher.submit(decision.worker_id, request, cancel_on_timeout=False)
            )
        except APIError as exc:
            self._fail(seq, f"worker {old} stopped responding; moving the sequence failed: {exc.message}")
            return None
        svc.metrics.migrations.labels(seq.move_reason, "moved").inc()
        return request

    async def _hand_over(self, seq: Sequence, kv_from: KVFrom, target: int) -> None:
        """A disaggregated sequence's hand-off to its decode worker (`seq.decision` now): the marker of attempt
        `target` and the decode request go out together, and nothing waits for the marker, not even for the
        broker's acknowledgement.

        The prefill worker ended its attempt with the token that started the hand-off, so no chunk of the old
        attempt can follow the marker, and no worker needs stopping. Should a chunk of the new attempt land
        before the marker, it switches the sequence over by itself and the marker is dropped as a duplicate
        (`ClientStream.put`; a replay reads the same order). The two sends one after the other would add a
        broker round trip to every disaggregated sequence's gap after its first token.
        """
        svc, req = self._svc, self._req
        seq.moved_from = ""
        worker_id = seq.decision.worker_id
        if seq.parked is not None:
            await self._released(seq, worker_id)
            return
        log.debug("handing %s over to worker %s (attempt %d)", seq.request_id, worker_id, target)
        request = req.request_for(seq, list(seq.token_ids), kv_from, attempt=target)
        seq.claimed = target  # from here the worker may run it, whether or not the sends below succeed
        mark = marker(seq.request_id, target, worker_id)
        outcomes = await asyncio.gather(
            self._while_broker_away(lambda: svc.dispatcher.note(req.reply_topic, mark)),
            self._while_broker_away(
                lambda: svc.dispatcher.submit(worker_id, request, cancel_on_timeout=False)
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, APIError):
                # (`fail` also cancels the sequence on the decode worker, which may have it already.)
                self._fail(seq, f"handing the sequence over to worker {worker_id} failed: {outcome.message}")
                return
            if isinstance(outcome, BaseException):
                raise outcome
        offset = outcomes[1]
        assert isinstance(offset, int)
        svc.metrics.migrations.labels(seq.move_reason, "moved").inc()
        # A hand-off is every disaggregated sequence's course, and its decode worker may queue it for long: it
        # gets a first attempt's delivery check, not a move's timer.
        self.watch(seq, request, offset)

    async def _released(self, seq: Sequence, worker_id: str) -> None:
        """A decode-first hand-off: the prefill worker released the attempt parked on the decode worker itself,
        along with the token that got here; only its marker is left to write (as in `_hand_over`, it may land
        after the attempt's first chunks), and the attempt is watched as a first one."""
        svc = self._svc
        parked, seq.parked = seq.parked, None
        assert parked is not None
        log.debug("%s: released to worker %s (attempt %d)", seq.request_id, worker_id, parked.attempt)
        try:
            await self._while_broker_away(
                lambda: svc.dispatcher.note(
                    self._req.reply_topic, marker(seq.request_id, parked.attempt, worker_id)
                )
            )
        except APIError as exc:
            self._fail(seq, f"handing the sequence over to worker {worker_id} failed: {exc.message}")
            return
        svc.metrics.migrations.labels(seq.move_reason, "moved").inc()
        # Its chunks continue after the token(s) that got here (the released one, from either worker).
        self.watch(seq, msgspec.structs.replace(parked, seq_base=seq.next_seq), seq.parked_offset)

    def _take_handoff(self, seq: Sequence) -> tuple[Decision | None, KVFrom | None]:
        """For a disaggregated sequence's hand-off (its prefill worker's token arrived): the decode worker it
        moves to if that is still live, and the KV to receive if its prefill worker is. A hand-off pending on
        any other move (the prefill worker lost before its token) is dropped, with its load."""
        handoff, seq.handoff = seq.handoff, None
        if handoff is None:
            return None, None
        live = {w.worker_id for w in self._svc.pool.live(self._req.model)}
        if seq.parked is not None and seq.token_ids and seq.kv_from and handoff.worker_id in live:
            # Decode-first: the prefill worker released the parked attempt with the token (it may have left since).
            return handoff, seq.kv_from
        if seq.parked is not None:
            self._req.discard_parked(seq, handoff.worker_id)
        source = seq.kv_from if seq.token_ids and seq.kv_from and seq.kv_from.worker_id in live else None
        if source is not None and handoff.worker_id in live:
            return handoff, source
        self._svc.router.finished(handoff)
        return None, source

    async def _reroute(self, seq: Sequence, old: str) -> Decision | None:
        """A new worker for the sequence. A worker may be on its way (a restart, or this one back after a
        late heartbeat): wait for one as long as for a busy one, then give up with a clear error."""
        svc = self._svc
        memo = PromptMemo(self._req.prepared.prompts[seq.prompt_index] + seq.token_ids)
        give_up = time.monotonic() + svc.busy_wait_s
        while True:
            try:
                return await self._req.choose(memo)
            except APIError as exc:
                remaining = give_up - time.monotonic()
                if exc.code != "no_workers" or remaining <= 0:
                    self._fail(
                        seq,
                        f"worker {old} stopped responding and no other worker can take over: {exc.message}",
                    )
                    return None
                await svc.pool.wait_refreshed(remaining)

    async def _mark(self, seq: Sequence, target: int, old: str) -> bool:
        """Write the marker of attempt `target` into the replies topic and wait until it came back.

        From where it lands, only chunks of the new attempt count, for this stream and any replay of it.
        False if the move must stop here (failed, or to be started over).
        """
        req = self._req
        seq.switched.clear()
        try:
            await self._while_broker_away(
                lambda: self._svc.dispatcher.note(
                    req.reply_topic, marker(seq.request_id, target, seq.worker_id)
                )
            )
        except APIError as exc:
            self._fail(seq, f"worker {old} stopped responding; moving the sequence failed: {exc!r}")
            return False
        try:
            async with asyncio.timeout(MOVE_STALL_S):
                while seq.attempt < target and not seq.finished:
                    await seq.switched.wait()
                    seq.switched.clear()
                    if seq.move is MoveState.MOVING_AGAIN and seq.attempt < target:
                        # Lost again before the marker came back: the broker may have lost it too. Start
                        # over; no request went out, so the next move may claim the same attempt.
                        return False
        except TimeoutError:
            self._stalled(seq, f"its marker did not come back within {MOVE_STALL_S:.0f}s")
            return False
        return True

    async def _while_broker_away(self, send: Callable[[], Awaitable[T]]) -> T:
        """Send, and send again while the broker is unavailable, up to --request-timeout-s.

        A worker often dies together with the broker's outage (or the broker's restart is what lost the
        sequence): the move must outlast it, not fail on it. Each attempt waits up to --kafka-timeout-s
        for the broker, which paces the retries.
        """
        give_up = time.monotonic() + self._svc.request_timeout_s
        while True:
            try:
                return await send()
            except APIError as exc:
                if exc.code != "broker_unavailable" or time.monotonic() > give_up or self._req.closed:
                    raise
