"""Doorbells: an idle reader on the token path stops fetching, its partitions paused, until a writer rings.

The embedded broker answers a parked fetch only at the end of its wait (docs/architecture.md, broker quirk
"late wake-up"), so a prompt reader fetches every few milliseconds, and an idle fleet of such readers keeps
a core busy between the broker and themselves. With a doorbell a reader that has nothing to read sleeps
instead (`Reader`, `Hooks.may_sleep`): a writer rings once the broker has acknowledged its record, so the
fetch the woken reader sends at once finds it. A frontend rings a worker's inbox for a request sooner, once the
record is in its producer's batch: the ring crosses Redis while the record crosses the broker, the woken inbox
polls `Options.linger_ms` before it sleeps again, and an acknowledgement that came later than half that rings
it once more (server/dispatcher.py). A frontend rings its own replies reader when it opens a
stream; rings between processes travel over Redis pub/sub (kvstore/bells.py: a worker's requests, written
by frontends and prefill workers). Between an open stream's records the replies reader sleeps too, having
told the workers where it stopped (`Hooks.before_sleep`): they ring it for a record past that offset
(workers/reply_bells.py). A ring that never comes (Redis away, a writer that does not ring) costs at most
the reader's poll timeout: a sleeping reader fetches then anyway, and a bell that cannot be rung (`armed`
false: its subscription is down) lets the reader poll.
"""

from __future__ import annotations

import asyncio
import contextlib


class Doorbell:
    """`ring` wakes whoever waits, or makes the next wait return at once."""

    def __init__(self) -> None:
        self._rung = asyncio.Event()
        # Whether a reader may sleep on this bell: False while rings cannot reach it (kvstore/bells.py).
        self.armed = True

    def ring(self) -> None:
        """Something may have been written: wake the reader (now, or at its next wait)."""
        self._rung.set()

    def clear(self) -> None:
        """Forget rings so far (the reader is about to fetch, and will see what they announced)."""
        self._rung.clear()

    async def wait(self, timeout_s: float) -> None:
        """Wait for a ring (at once if one came since the last `clear`), at most `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._rung.wait()


# A reader with a doorbell polls at least this long past its fetch wait before it sleeps (`Linger`): a ring can
# wake it while a fetch sent before the ring is still parked at the broker, which answers it only near the end
# of its wait (docs/architecture.md, broker quirk "late wake-up"); a poll that ended first would find nothing,
# and the reader would sleep with the rung record on its way, unread until its fallback poll.
PAST_FETCH_MS = 15


class Linger:
    """How long a reader with a doorbell polls before it may sleep: its linger, or longer than any of its
    fetches that may still be parked (the last round's or this one's: an inbox's wait changes between rounds)
    by PAST_FETCH_MS, so that the fetch after that one, which finds a rung record, is answered too."""

    def __init__(self, linger_ms: int, wait_ms: int) -> None:
        self._linger_ms = linger_ms
        self._wait_ms = wait_ms  # the fetch wait of the last round

    def poll_ms(self, wait_ms: int) -> int:
        """The brief poll of a round whose fetches wait `wait_ms`."""
        parked, self._wait_ms = max(self._wait_ms, wait_ms), wait_ms
        return max(self._linger_ms, parked + PAST_FETCH_MS)


class SparseRecords:
    """Learns whether a reader's records come sparsely, so it may sleep right after a poll that brought some.

    A reader with a doorbell polls briefly after records before it sleeps, in case more follow at once. When
    they come an engine step apart, that poll finds nothing every time: a fetch per record spent for nothing.
    After `EMPTY_TAILS` such empty polls in a row the reader skips them, sleeping as soon as it has read; a
    sleep that a ring cuts shorter than the brief poll would have lasted says records follow closely again,
    and it polls briefly from then on until it has learned otherwise.
    """

    EMPTY_TAILS = 2

    def __init__(self, linger_s: float) -> None:
        self._linger_s = linger_s
        self._empty = 0  # brief polls after records in a row that found nothing
        self._after_records = False  # the last poll brought records and no sleep followed it

    @property
    def sparse(self) -> bool:
        """Whether to sleep right after records."""
        return self._empty >= self.EMPTY_TAILS

    def polled(self, fetched: bool) -> None:
        """A poll (without a sleep before it) ended."""
        if self._after_records:
            self._empty = 0 if fetched else self._empty + 1
        self._after_records = fetched

    def slept(self, seconds: float) -> None:
        """The reader slept this long (a ring, or its timeout, ended it)."""
        self._after_records = False
        if seconds < self._linger_s:
            self._empty = 0
