"""Rings a frontend's sleeping replies reader once a record it has not read yet is in its topic.

A frontend's replies reader that polled a while without records sleeps, even with streams open (bus/doorbell.py),
and first tells every worker where it stopped: the offset of the next record it would read in each replies
topic (schemas/bells.py). Whether a worker must ring follows from offsets alone, not from timing: a record of
this worker at or after that offset has not been read, so the worker rings when the notice arrives if such a
record was acknowledged before it, or when the first one is acknowledged after it. One ring per notice is
enough: the woken reader reads everything, and it announces its next sleep afresh.

Per acknowledged record this costs two dict lookups; a ring is one Redis PUBLISH, and under steady load the
reader never sleeps, so nothing is rung.

Batch results readers sleep while the pool is idle too, one channel per model for every frontend's: a result in
a results topic rings it (`Coalesced`: at most once per window, so a batch's results do not ring each).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec

from kvstore.bells import Coalesced
from schemas.bells import asleep_decoder

log = logging.getLogger("ferry.worker")

# Replies topics whose last acknowledged offset is remembered: frontends roll their topics, so the oldest go.
REMEMBERED_TOPICS = 1024

V = TypeVar("V")


class ReplyBells:
    """The worker's side of sleeping replies readers: `acked` for every record the broker took, `heard` for notices."""

    def __init__(self, ring: Callable[[str], None], results: tuple[str, Coalesced] | None = None) -> None:
        self._ring = ring
        # The model's batch results topics (their common prefix), and the ring of the readers of them.
        self._results = results
        self._acked: dict[str, int] = {}  # replies topic -> the highest offset of this worker's records there
        # Replies topic -> (channel to ring, the position its sleeping reader announced).
        self._asleep: dict[str, tuple[str, int]] = {}
        self.rung = 0

    def acked(self, topic: str, offset: int) -> None:
        """The broker acknowledged this worker's record at `offset` of `topic`."""
        if self._acked.get(topic, -1) < offset:
            _remember(self._acked, topic, offset)
        if self._results is not None and topic.startswith(self._results[0]):
            self._results[1].ring()
        if self._asleep:
            asleep = self._asleep.get(topic)
            if asleep is not None and offset >= asleep[1]:
                del self._asleep[topic]
                self._ring_now(asleep[0])

    def heard(self, payload: bytes) -> None:
        """A replies reader went to sleep (a `RepliesAsleep` notice)."""
        try:
            notice = asleep_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            # A newer frontend's notice this worker cannot read: that reader polls in time anyway.
            log.warning("ignoring an unreadable replies-asleep notice: %r", exc)
            return
        unread = False
        for topic, position in notice.positions.items():
            if self._acked.get(topic, -1) >= position:
                unread = True
                self._asleep.pop(topic, None)
            else:
                _remember(self._asleep, topic, (notice.channel, position))
        if unread:
            self._ring_now(notice.channel)

    def _ring_now(self, channel: str) -> None:
        self.rung += 1
        self._ring(channel)


def _remember(memory: dict[str, V], topic: str, value: V) -> None:
    """Set `memory[topic]`, forgetting the oldest topic first when REMEMBERED_TOPICS are held."""
    if topic not in memory and len(memory) >= REMEMBERED_TOPICS:
        del memory[next(iter(memory))]
    memory[topic] = value
