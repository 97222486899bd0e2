"""The frontend's side of ringing its replies reader: the channel workers ring, and the notice sent before a sleep.

With streams open, the replies reader sleeps once it polled a while without records (bus/doorbell.py), and
first publishes where it stopped in each replies topic to every worker (schemas/bells.py); a worker rings
`channel` as soon as one of its records at or after that offset is in (workers/reply_bells.py). While the
subscription to `channel` is down (`armed` false) the reader polls whenever a stream is open, as it did
before workers could ring it.
"""

from __future__ import annotations

from bus.doorbell import Doorbell
from kvstore.bells import Bells, BellSubscription
from schemas.bells import RepliesAsleep, asleep_encoder
from schemas.names import RedisKeys

# How long the reader sleeps at most while a stream is open: what a ring that never came (a worker whose
# subscription was down when the notice went out) costs the stream's next tokens.
OPEN_SLEEP_MS = 250


class RepliesBell:
    """Owns the replies reader's doorbell, the subscription workers ring it on, and its sleep notices."""

    def __init__(self, redis_url: str, keys: RedisKeys, frontend_id: str, bells: Bells) -> None:
        self.channel = keys.replies_bell(frontend_id)
        self._notices = keys.replies_asleep()
        self._bells = bells
        self.doorbell = Doorbell()
        self.armed = False  # while workers' rings can reach the reader (kept by the subscription)
        self._subscription = BellSubscription(redis_url, self.channel, "replies", self)
        self.announced = 0

    @property
    def rings(self) -> int:
        """Rings heard from workers."""
        return self._subscription.rings

    def ring(self) -> None:
        """Wake the reader (a worker's ring, or the subscription coming back)."""
        self.doorbell.ring()

    def start(self) -> None:
        """Subscribe in the background."""
        self._subscription.start()

    async def stop(self) -> None:
        """Unsubscribe."""
        await self._subscription.stop()

    async def announce(self, positions: dict[str, int]) -> None:
        """Tell every worker that the reader sleeps, and the offset of the next record it would read per topic."""
        self.announced += 1
        await self._bells.publish(
            self._notices, asleep_encoder.encode(RepliesAsleep(self.channel, positions))
        )
