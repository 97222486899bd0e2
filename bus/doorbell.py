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

    async def wait(self, timeout_s: float) -> bool:
        """Wait for a ring (at once if one came since the last `clear`), at most `timeout_s`; whether one came."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._rung.wait()
        return self._rung.is_set()


# How long past its wait a fetch may take to come back (the broker's answer, then the fetch after it) (`ParkedFetch`).
PAST_FETCH_MS = 15


class ParkedFetch:
    """Bounds the sleep after a poll that a ring woke but that found nothing while a fetch may still be parked.

    A ring can wake a reader while a fetch it sent before the ring is still parked at the broker, which answers
    it only near the end of its wait (docs/architecture.md, broker quirk "late wake-up"). A brief poll shorter
    than that wait (the KV log reader's 20 ms against its 100 ms fetches; a busy inbox's paced fetch) ends
    before the fetch comes back, with the rung record on its way; slept out, it stays unread until the
    reader's fallback poll. So that sleep lasts only until the fetch must be back: paused partitions keep what
    it brought, which the next poll returns at once, or that poll's fetch finds the record the ring announced.
    Polling longer instead would keep a reader whose records come about a fetch wait apart awake throughout.
    """

    def __init__(self, wait_ms: int) -> None:
        self._wait_ms = wait_ms  # the fetch wait of the last poll
        self._until: float | None = None  # (loop time) when a fetch parked across an empty woken poll is back

    def polled(self, woke: float | None, wait_ms: int, poll_ms: int, fetched: bool) -> None:
        """A poll with fetches waiting `wait_ms` ended; `woke`: when (loop time) a ring ended the sleep before it,
        None if none did. A fetch of the poll before may still be parked (an inbox's wait changes)."""
        parked, self._wait_ms = max(self._wait_ms, wait_ms), wait_ms
        back_ms = parked + PAST_FETCH_MS
        self._until = None
        if woke is not None and not fetched and back_ms > poll_ms:
            self._until = woke + back_ms / 1000

    def sleep_s(self, timeout_s: float, now: float) -> float:
        """How long the next sleep lasts, at most `timeout_s`."""
        return timeout_s if self._until is None else max(0.0, min(timeout_s, self._until - now))


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
