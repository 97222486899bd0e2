"""Doorbells rung over Redis pub/sub: `Bells` rings a reader, `BellSubscription` hears its rings.

A worker's inbox sleeps while idle (bus/doorbell.py); whoever writes to its requests topic rings it on the
channel `<prefix>bell:<worker_id>` once the broker has acknowledged the record. A frontend's replies reader
sleeps between a stream's tokens and is rung on `<prefix>rbell:<frontend_id>` by the workers it announced
its sleep to (workers/reply_bells.py). A frontend's KV log reader sleeps once caught up and is rung on
`<prefix>kvbell:<model>` by the worker whose record is in (workers/kv_log.py). Batch readers sleep while the
pool is empty: workers' pool consumers are rung on `<prefix>poolbell:<model>` by the frontend that wrote items
(server/batch), frontends' results readers on `<prefix>resbell:<model>` by the worker whose result is in
(`Coalesced`: a batch's records ring once per window, not once each). Rings are best effort: one
that Redis does not take is logged once and costs the sleeping reader at most its fallback poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kvstore.connect import redis_client
from schemas.names import RedisKeys

log = logging.getLogger("ferry.kafka")

# How long one wait for a pub/sub message lasts before the listener looks again.
LISTEN_S = 1.0
# Backoff between attempts to subscribe again after Redis went away.
RESUBSCRIBE_S = (0.5, 5.0)


class Ringable(Protocol):
    """What a subscription rings (bus.doorbell.Doorbell)."""

    armed: bool

    def ring(self) -> None:
        """Wake the reader."""
        ...


class Bells:
    """Rings workers' doorbells: `ring` once the broker acknowledged a record in a worker's requests topic."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._failing = False
        self._pending: set[asyncio.Task[None]] = set()

    async def ring(self, worker_id: str) -> None:
        """Wake `worker_id`'s inbox; a ring Redis does not take is logged once (the inbox polls it anyway)."""
        await self.publish(self._keys.bell(worker_id))

    async def publish(self, channel: str, message: bytes = b"") -> None:
        """Publish `message` on `channel` (a ring, or a sleeping reader's notice); failures are logged once."""
        try:
            try:
                await self._redis.publish(channel, message)
            except (RedisConnectionError, OSError):
                # A pooled connection that a restarted Redis closed fails its next command, and this ring would
                # cost a sleeping reader its whole fallback poll: once more, on a connection made afresh.
                await self._redis.publish(channel, message)
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("could not ring doorbells (%r); sleeping readers read at their next poll", exc)
                self._failing = True
            return
        if self._failing:
            log.info("ringing doorbells again")
            self._failing = False

    def ring_soon(self, worker_id: str) -> None:
        """`ring` without waiting for it (from a delivery report, or off a request's path): in a task of its own."""
        self.publish_soon(self._keys.bell(worker_id))

    def publish_soon(self, channel: str, message: bytes = b"") -> None:
        """`publish` without waiting for it, in a task of its own."""
        task = asyncio.get_running_loop().create_task(self.publish(channel, message))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class Coalesced:
    """Rings one channel at most once per `window_s`, and once more at the window's end if asked meanwhile.

    For writers of many records (batch items, their results): a reader woken by the first ring reads what
    follows it anyway, and the trailing ring covers a reader that went back to sleep within the window.
    """

    def __init__(self, publish: Callable[[str], None], channel: str, window_s: float = 0.05) -> None:
        self._publish = publish
        self._channel = channel
        self._window_s = window_s
        self._last = -window_s
        self._trailing: asyncio.TimerHandle | None = None
        self.rung = 0  # rings published

    def ring(self) -> None:
        """Ring now, or at the end of the current window."""
        if self._trailing is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._last + self._window_s - loop.time()
        if wait <= 0:
            self._now()
        else:
            self._trailing = loop.call_later(wait, self._now)

    def _now(self) -> None:
        self._trailing = None
        self._last = asyncio.get_running_loop().time()
        self.rung += 1
        self._publish(self._channel)

    def cancel(self) -> None:
        """Drop a ring still waiting for its window (the writer is stopping)."""
        if self._trailing is not None:
            self._trailing.cancel()
            self._trailing = None


class BellSubscription:
    """Rings `bell` for every message on `channel`; keeps `bell.armed` true exactly while subscribed.

    Rings published while unsubscribed are lost, so the first moment subscribed again counts as a ring.
    """

    def __init__(
        self,
        url: str,
        channel: str,
        name: str,
        bell: Ringable,
        notices: dict[str, Callable[[bytes], None]] | None = None,
    ) -> None:
        self._url = url
        self._channel = channel
        # Other channels heard on the same connection: each message's payload goes to its channel's handler.
        self._notices = {c.encode(): h for c, h in (notices or {}).items()}
        self._name = name
        self._bell = bell
        bell.armed = False
        self._task: asyncio.Task[None] | None = None
        self.rings = 0  # messages heard

    def start(self) -> None:
        """Subscribe in the background (the reader polls until the subscription stands)."""
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name=f"doorbell {self._name}")

    async def stop(self) -> None:
        """Unsubscribe; the reader polls from now on."""
        task, self._task = self._task, None
        self._bell.armed = False
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _listen(self) -> None:
        bell = self._bell
        backoff = RESUBSCRIBE_S[0]
        lost = False
        while True:
            # Its own client: a subscribed connection serves nothing else, and the shared clients' 2 s socket
            # timeout would cut every quiet second of listening short.
            client: aioredis.Redis = redis_client(self._url)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel, *self._notices)
                bell.armed = True
                bell.ring()  # rings published while unsubscribed were lost
                if lost:
                    log.info("%s: doorbell subscribed again; the reader sleeps while idle", self._name)
                    lost = False
                backoff = RESUBSCRIBE_S[0]
                notices = self._notices
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=LISTEN_S)
                    if message is None:
                        continue
                    handler = notices.get(message["channel"]) if notices else None
                    if handler is not None:
                        handler(message["data"])
                    else:
                        self.rings += 1
                        bell.ring()
            except (RedisError, OSError) as exc:
                if not lost:
                    log.warning("%s: doorbell lost its Redis subscription (%r); polling until it is back",
                                self._name, exc)  # fmt: skip
                    lost = True
            finally:
                bell.armed = False
                bell.ring()  # a reader asleep now must poll
                await asyncio.shield(_close(pubsub, client))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESUBSCRIBE_S[1])


async def _close(pubsub: aioredis.client.PubSub, client: aioredis.Redis) -> None:
    try:
        await pubsub.aclose()
        await client.aclose()
    except (RedisError, OSError):
        pass
