"""A worker's requests topic: requests in order, each (request id, attempt) served once, cancels, LoRA ops."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from bus.doorbell import Doorbell
from bus.log_watch import positions_and_ends
from bus.read_spec import Batch, Hooks, Options, Own, Poll
from bus.reader import Reader
from bus.topics import RequestTopics, delete_topics, ensure_topics, existing_topics, retention
from kvstore.bells import BellSubscription
from schemas.kafka import (
    Cancel,
    EngineControl,
    GenerateRequest,
    LoadLora,
    Release,
    RequestMessage,
    UnloadLora,
    request_decoder,
)
from schemas.names import RedisKeys, request_epoch, request_topic
from schemas.settings import WorkerSettings
from workers.lora import LoraControl
from workers.metrics import WorkerMetrics
from workers.serving import Serving

log = logging.getLogger("ferry.worker")

# Routed requests remembered for deduplication: a redelivered one is not run (and answered) twice.
SEEN_REQUESTS = 65536


def fetch_wait_ms(base_ms: int, busy_cap_ms: int, busy: bool, step_s: float) -> int:
    """The inbox's fetch wait: `base_ms` while idle; while busy, half the engine's step, at most `busy_cap_ms`
    (a request arriving meanwhile would mostly wait for the step under way anyway).

    The wait is chosen before each poll and kept by every fetch until the next one, which comes only when
    records arrive: `busy` is false while every attempt in flight has one output to go, since the engine's
    work ends with those outputs and a request arriving after them would wait out a paced fetch for nothing
    (in a closed loop the next request comes exactly then: 10-30 ms more TTFT, docs/benchmarks.md, "A quiet
    fleet")."""
    if not busy or busy_cap_ms <= base_ms:
        return base_ms
    return max(base_ms, min(int(step_s * 500), busy_cap_ms))


def busy_wait_cap_ms(role: str, busy_fetch_wait_ms: int) -> int:
    """The cap of a busy inbox's fetch wait: none (0) on a decode worker, whose requests are hand-offs on the
    token path: a release read late by a paced fetch often misses the engine's next step boundary, a whole
    decode step more in the gap after the first token (docs/benchmarks.md, "Disaggregated serving")."""
    return 0 if role == "decode" else busy_fetch_wait_ms


def read_through(
    topics: list[str], ends: dict[str, tuple[int, int]], paused: set[TopicPartition]
) -> list[str]:
    """Those of `topics` (request topics behind the window) read to their end, by (position, end) of each one's
    partition 0.

    Everything in such a topic was read, and so committed: the reader commits after every poll that brought
    records. One never fetched yet, or paused (its end is not fetched), is read first. A position past the end
    is no read topic but a lost log written again from offset 0 (an empty broker restart): the reader's
    LogResetWatch rewinds it, and it is read then.
    """
    return [
        t for t in topics if t in ends and ends[t][0] == ends[t][1] and TopicPartition(t, 0) not in paused
    ]


class Inbox:
    """Reads the worker's own topics and hands each message to serving or LoRA control.

    With `--request-roll-s`, frontends write to the topic of the current epoch of the clock (`RequestTopics`):
    the inbox reads a window of epochs plus the unrolled `ferry.requests.<worker>` (LoRA control, producers
    that do not roll) and deletes each past epoch's topic once it has read and committed all of it and its
    grace is over, so no partition grows for the worker's life (docs/architecture.md, broker quirk "slow
    long partitions"). The two moves of an epoch, the next topic in and the last one out, are one
    re-assignment in mid-epoch: nothing changes when the epoch turns.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        serving: Serving,
        lora: LoraControl,
        metrics: WorkerMetrics,
        on_fatal: Callable[[BaseException], None],
        on_log_lost: Callable[[], Awaitable[None]],
        notices: dict[str, Callable[[bytes], None]] | None = None,
    ) -> None:
        self.topic = request_topic(settings.worker_id)
        self._kafka = settings.kafka
        self._worker_id = settings.worker_id
        self.topics = RequestTopics(settings.request_roll_s)
        self._configs = retention(settings.kafka_request_retention_s, settings.kafka_retention_bytes)
        self._window: list[str] = []  # the rolled topics assigned now, oldest first
        self._newest: int | None = None  # the newest epoch assigned so far (None: none since open or a reset)
        self._deleted: set[str] = set()  # topics of the window this inbox read and deleted
        self._serving = serving
        self._lora = lora
        self._metrics = metrics
        self._on_log_lost = on_log_lost
        # (request id, attempt) of routed requests started lately, oldest first (bounded).
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        # Rung by frontends and prefill workers once their request, cancel or release is in the topic: an
        # inbox with nothing to read does not fetch every --kafka-fetch-wait-ms (bus/doorbell.py), busy
        # engine or not: a ring per request costs a CPU engine's cores fewer wake-ups than a paced fetch
        # every half step.
        self.doorbell: Doorbell | None = None
        self.bell_subscription: BellSubscription | None = None
        if settings.doorbell:
            channel = RedisKeys(settings.redis_prefix).bell(settings.worker_id)
            self.doorbell = Doorbell()
            # The same connection hears `notices` (replies readers going to sleep: workers/reply_bells.py).
            self.bell_subscription = BellSubscription(settings.redis, channel, "requests", self.doorbell, notices)
        self.reader: Reader[RequestMessage] = Reader(
            "requests",
            settings.kafka,
            request_decoder,
            Options(
                fetch_wait_ms=settings.kafka_fetch_wait_ms,
                # The window moves after a poll: several times an epoch, so the next epoch's topic is
                # created before frontends need it and epochs are seldom skipped (they are read anyway).
                poll=Poll(_poll_ms(settings.request_roll_s), 256),
                # An idle worker sees nothing fail while the broker is away (no commit, no reply), so the
                # check cannot wait for an error: a position past the fetch's high watermark is the only sign
                # that the broker came back without this log, and on a healthy log it never holds.
                watch_reset=True,
                # Commit once the engine holds the requests: a restart under the same id resumes after them.
                commit_after_poll=True,
                group_id=f"ferry-worker-{settings.worker_id}",
                offset_reset="earliest",
            ),
            Hooks(
                self._handle,
                failed=on_fatal,
                reset=self._reset,
                before_poll=self._pace,
                after_poll=self._roll,
            ),
            self.doorbell,
        )
        self._base_wait_ms = settings.kafka_fetch_wait_ms
        self._busy_wait_ms = busy_wait_cap_ms(settings.role, settings.busy_fetch_wait_ms)

    async def _pace(self) -> Poll | None:
        # Every fetch the embedded broker parks wakes it and this process when the wait ends (it answers a
        # parked fetch only then), on the cores a CPU engine's threads step on: the stack's 5 ms readers
        # together cost a vLLM worker up to a fifth of its throughput (docs/benchmarks.md, "The engine's
        # environment"); this one is the worker's own.
        serving = self._serving
        self.reader.set_fetch_wait(
            fetch_wait_ms(self._base_wait_ms, self._busy_wait_ms, serving.busy_after_step, serving.step_s)
        )
        return None

    async def open(self) -> None:
        """Create and position on the topics (from the last commits) before the worker registers."""
        await ensure_topics(self._kafka, {self.topic: 1}, self._configs)
        if self.bell_subscription is not None:
            self.bell_subscription.start()
        await self.reader.open(Own(self.topic))
        await self._roll(False)

    async def close(self) -> None:
        """Stop reading, then stop listening for rings."""
        try:
            await self.reader.stop()
        finally:
            if self.bell_subscription is not None:
                await self.bell_subscription.stop()

    async def _roll(self, got_records: bool) -> None:
        """Read the current window of rolled topics; delete those of past epochs once read (after every poll)."""
        if self.topics.roll_s <= 0:
            return
        window = self.topics.window(self._worker_id)
        first, newest = request_epoch(window[0]), request_epoch(window[-1])
        assert first is not None and newest is not None
        # An epoch deleted while still in the window (read, and past its grace) is not assigned again.
        self._deleted &= set(window)
        fresh = [t for t in window if t not in self._window and t not in self._deleted]
        new = fresh  # the topics to assign: the fresh ones of the window, and skipped epochs
        if self._newest is not None and self._newest + 1 < first:
            # Whole epochs went by since the last roll (a poll or a loop slower than an epoch): they were
            # never in a window, yet frontends wrote there. Read those that exist; the others were never
            # written (a frontend creates its topic before its first send), and asking for them by name
            # would create them (broker quirk "metadata re-creates topics").
            skipped = await existing_topics(
                self._kafka, self.topics.between(self._worker_id, self._newest, first)
            )
            if skipped:
                log.info("requests: reading skipped epochs %s", skipped)
            new = [*skipped, *fresh]
        behind = [t for t in self._window if self.topics.deletable(t)]
        if not new and not behind:
            return
        if fresh:
            # The next epoch's topic is created here, `grace_s` before frontends write there, so they never
            # create it at the same moment as the worker (two CreateTopics racing on the embedded broker can
            # lose what was written in between).
            await ensure_topics(self._kafka, dict.fromkeys(fresh, 1), self._configs)
        consumer = self.reader.consumer
        paused = consumer.paused()
        ends = {tp.topic: (position, end) for tp, position, end in await positions_and_ends(consumer)}
        done = read_through(behind, ends, paused)
        if not new and not done:
            return
        keep = [t for t in self._window if t not in done]
        positions = {}
        for tp in consumer.assignment():
            if tp.topic not in done:
                positions[tp] = await consumer.position(tp)
        # assign() forgets positions: the kept ones are put back, new ones start at the group's commit
        # (none yet: the start of the topic).
        consumer.assign(list({*positions, *(TopicPartition(t, 0) for t in new)}))
        for tp, offset in positions.items():
            consumer.seek(tp, offset)
        consumer.pause(*paused)  # assign() resumes them
        self._window = [*keep, *new]
        self._newest = newest
        if done:
            try:
                await delete_topics(self._kafka, done)
            except KafkaError as exc:
                log.warning("could not delete read request topics %s: %r", done, exc)
            else:
                self._deleted.update(done)
                log.info("requests: deleted read topics %s", done)

    async def _handle(self, batch: Batch[RequestMessage]) -> None:
        for _record, msg in batch.messages:
            await self.dispatch(msg)

    async def _reset(self, rewound: list[TopicPartition]) -> None:
        self._window = []  # the broker lost the topics too: create the window again
        self._deleted.clear()
        self._newest = None
        await self._on_log_lost()

    async def dispatch(self, msg: RequestMessage) -> None:
        """Act on one message of the topic."""
        match msg:
            case GenerateRequest():
                key = (msg.request_id, msg.attempt)
                if key in self._seen:
                    # Redelivered (a producer retry, a re-read after a restart): already running or done.
                    self._metrics.requests.labels("duplicate").inc()
                    return
                if msg.request_id in self._serving and not msg.parked:
                    await self._serving.supersede(msg)
                if msg.deadline and msg.deadline < time.time():
                    log.info("request %s arrived after its deadline; skipped", msg.request_id)
                    self._metrics.requests.labels("expired").inc()
                    return
                self._seen[key] = None
                if len(self._seen) > SEEN_REQUESTS:
                    self._seen.popitem(last=False)
                if msg.parked:
                    # A decode-first hand-off's attempt: it starts on its prefill worker's Release.
                    self._serving.parking.park(msg)
                    return
                self._serving.start(msg)
            case Release():
                self._serving.parking.release(msg)
            case Cancel():
                await self._serving.cancel(msg.request_id, msg.attempt)
            case LoadLora() | UnloadLora() | EngineControl():
                self._lora.submit(msg)


def _poll_ms(roll_s: float) -> int:
    """The longest a poll waits for records: a second, or a quarter of an epoch when that is shorter."""
    return 1000 if roll_s <= 0 else max(20, min(1000, int(roll_s * 250)))
