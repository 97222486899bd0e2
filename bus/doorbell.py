"""Doorbells: an idle reader on the token path stops fetching, its partitions paused, until a writer rings.

The embedded broker answers a parked fetch only at the end of its wait (docs/architecture.md, broker quirk
"late wake-up"), so a prompt reader fetches every few milliseconds, and an idle fleet of such readers keeps
a core busy between the broker and themselves. With a doorbell a reader that has nothing to read sleeps
instead (`Reader`, `Hooks.may_sleep`): a writer rings once the broker has acknowledged its record, so the
fetch the woken reader sends at once finds it. A frontend rings its own replies reader when it opens a
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
