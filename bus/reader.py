"""The one consumer-loop owner: every Kafka reader is a `Reader` given a decoder, a handler and a failure hook.

A Reader owns one AIOKafkaConsumer. It starts it and positions it (`Tail`, `At`, `Own`, `Subscribe`),
runs the poll loop, stretches the fetch wait while it lags (`FetchWaitAdjuster`), checks its polls for a
log the broker lost (`LogResetWatch`, when asked), decodes every record with the reader's typed decoder
(undecodable ones are logged and dropped) and hands each partition's batch to the handler; it stops the
consumer through `stop_consumer`. A loop that dies unexpectedly is logged and reported to the failure hook,
which fails whoever waits on the reader. Given a doorbell (bus/doorbell.py), an idle reader sleeps between polls
with its partitions paused until the bell rings or its poll timeout passes, instead of fetching every few
milliseconds. Whatever else a reader needs (re-assigning partitions, pausing (`pause`: a sleep leaves those alone),
commits, a rebalance listener, point lookups) is an option, a hook or a method here, not a loop of its own.

The loop hands on each partition's records without holes: when a fetch skips records (docs/architecture.md,
broker quirk "fetch skips a batch"), it hands on what came before the hole and reads again from it.
Whoever moves the consumer does it through the Reader (`assign`, `seek`, `rewind_to_committed`), so that
the loop does not take the move for a hole.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from bus.commits import commit_within, rewind_to_committed
from bus.consumer import stop_consumer
from bus.doorbell import Doorbell, ParkedFetch, SparseRecords
from bus.log_watch import FetchWaitAdjuster, LogResetWatch, positions_and_ends
from bus.read_spec import At, Batch, Decoder, Hooks, Options, Own, Start, Subscribe, Tail
from bus.topics import ensure_topics

log = logging.getLogger("ferry.kafka")

T = TypeVar("T")

# How long one fetch of a point lookup waits before the lookup looks at the log's end.
LOOKUP_POLL_MS = 500

# How often the loop reads a hole in a partition's records again before it reads on past it: a broker
# that skipped a batch returns it the next time (broker quirk "fetch skips a batch"); on Apache Kafka,
# compaction and transaction markers make holes that stay, and a reader must never stall on one.
GAP_TRIES = 3


_DEFAULT_OPTIONS = Options()


class Reader(Generic[T]):
    """Owns one consumer and its poll loop; see the module docstring."""

    def __init__(
        self,
        name: str,
        bootstrap: str,
        decoder: Decoder[T],
        options: Options = _DEFAULT_OPTIONS,
        hooks: Hooks[T] | None = None,
        doorbell: Doorbell | None = None,
    ) -> None:
        self.name = name
        self._bootstrap = bootstrap
        self._decoder = decoder
        self._options = options
        self._hooks = hooks
        self._doorbell = doorbell
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._finishing = False
        self._stopped = False
        # A reader without a loop serves point lookups, one at a time (each re-assigns the consumer).
        self._lookup = asyncio.Lock()
        self.failed: BaseException | None = None
        # Per partition, the offset after the last record handed on; a fetch starting past it, or with a hole
        # inside, skipped records (see `_whole`). Forgotten wherever the consumer is moved.
        self._next: dict[TopicPartition, int] = {}
        # Per partition with a hole being read again: the hole's first offset and how often it was read.
        self._holes: dict[TopicPartition, tuple[int, int]] = {}
        self._stretch: FetchWaitAdjuster | None = None  # the loop's, while it runs
        self.gaps_refetched = 0  # holes read again
        self.gaps_accepted = 0  # holes read on past after GAP_TRIES reads
        self.sleeps = 0  # times the loop slept on its doorbell
        self.empty_polls = 0  # polls of a loop that may sleep that brought nothing
        self._held: set[TopicPartition] = set()  # paused by the owner (`pause`), not by a sleep
        self._drowsy = False  # the last poll of a reader that may sleep brought nothing
        self._last_poll_ms = options.poll.timeout_ms  # the poll timeout of the last round (its hook's)
        self._parked = ParkedFetch(options.fetch_wait_ms)
        self._sparse = SparseRecords(options.linger_ms / 1000) if options.sleep_after_records else None

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self, at: Start | None = None) -> None:
        """Start the consumer, position it (None: nowhere yet, for lookups), and run the loop if there are hooks."""
        await self.open(at)
        if self._hooks is not None:
            self.run()

    async def open(self, at: Start | None = None) -> None:
        """Start the consumer and position it, without reading yet (`run` starts the loop)."""
        if isinstance(at, Tail):
            await ensure_topics(self._bootstrap, {at.topic: 1})
        consumer = self._options.make_consumer(self._bootstrap)
        try:
            await consumer.start()
        except BaseException:
            # A start that fails (broker unreachable, cancelled) leaves a client with open connections and
            # tasks that nobody would stop: aiokafka warns "Unclosed AIOKafkaConsumer" when it is collected.
            await asyncio.shield(consumer.stop())
            raise
        self._consumer = consumer
        self._forget()
        match at:
            case Tail(topic):
                tp = TopicPartition(topic, 0)
                consumer.assign([tp])
                await consumer.seek_to_end(tp)
                await consumer.position(tp)  # resolved now (see Tail)
            case At(topic, offset):
                tp = TopicPartition(topic, 0)
                consumer.assign([tp])
                consumer.seek(tp, offset)
            case Own(topic):
                consumer.assign([TopicPartition(topic, 0)])
            case Subscribe(topics, listener, pattern):
                if pattern is not None:
                    consumer.subscribe(pattern=pattern, listener=_Forgetting(self, listener))
                else:
                    consumer.subscribe(list(topics), listener=_Forgetting(self, listener))
            case None:
                pass

    def run(self) -> None:
        """Start the poll loop (after `open`)."""
        assert self._hooks is not None and self._task is None, "a loop needs hooks, and runs once"
        self._task = asyncio.create_task(self._run(self._hooks), name=f"reader {self.name}")

    def finish(self) -> None:
        """Let the loop end after its current round; the consumer stays (for last commits) until `stop`."""
        self._finishing = True
        if self._doorbell is not None:
            self._doorbell.ring()  # a sleeping loop goes on to its last poll now

    async def finished(self, timeout_s: float) -> bool:
        """`finish`, then wait up to `timeout_s` for the loop's last round to end; False if it has not."""
        self.finish()
        task = self._task
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        return bool(done)

    async def stop(self) -> None:
        """End the loop, run the closing hook, stop the consumer. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        consumer = self._consumer
        if consumer is None:
            return
        try:
            if self._hooks is not None and self._hooks.closing is not None:
                await self._hooks.closing()
        finally:
            self._consumer = None
            await stop_consumer(consumer, self._options.join_wait_s)

    @property
    def started(self) -> bool:
        """True from a successful `open` until `stop`."""
        return self._consumer is not None

    @property
    def consumer(self) -> AIOKafkaConsumer:
        """The consumer, for hooks that pause, resume or look at assignments and positions."""
        assert self._consumer is not None, "open() first"
        return self._consumer

    @property
    def group(self) -> str:
        """The consumer group, or "" for a reader that assigns its partitions itself."""
        return self._options.group_id or ""

    async def lag(self) -> dict[str, int]:
        """Records not read yet per topic, over the assigned partitions (high watermarks of the latest fetches)."""
        if self._consumer is None:
            return {}
        out: dict[str, int] = {}
        try:
            ends = await positions_and_ends(self._consumer)
        except KafkaError:
            return {}  # the next reading has it right
        for tp, position, end in ends:
            out[tp.topic] = out.get(tp.topic, 0) + max(end - position, 0)
        return out

    # ---- for hooks ---------------------------------------------------------------------------------

    def set_fetch_wait(self, wait_ms: int) -> None:
        """The loop's fetch wait from its next fetch on (while it is not stretched for a lagging log)."""
        if self._stretch is not None:
            self._stretch.set_base(wait_ms)

    def pause(self, *tps: TopicPartition) -> None:
        """Stop reading `tps` until `resume` (a sleep on the doorbell never resumes them)."""
        self._held.update(tps)
        self.consumer.pause(*tps)

    def resume(self, *tps: TopicPartition) -> None:
        """Read `tps` again (after `pause`)."""
        self._held.difference_update(tps)
        assigned = self.consumer.assignment()
        self.consumer.resume(*(tp for tp in tps if tp in assigned))

    async def position(self, tp: TopicPartition) -> int:
        """The offset the next record of `tp` will have (waits while it is being resolved)."""
        return int(await self.consumer.position(tp))

    async def assign(self, positions: dict[TopicPartition, int]) -> None:
        """Read exactly these partitions, each from its offset (0: from the log's start, wherever that is)."""
        consumer = self.consumer
        consumer.assign(list(positions))
        # A partition put back where its last record left it keeps its expectation (a hole right there is
        # still one); any other is moved.
        self._next = {tp: n for tp, n in self._next.items() if positions.get(tp) == n}
        self._holes = {tp: h for tp, h in self._holes.items() if tp in self._next}
        for tp, offset in positions.items():
            if offset > 0:
                consumer.seek(tp, offset)
            else:
                await consumer.seek_to_beginning(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read `tp` on from `offset` (the loop does not take the move for a hole)."""
        self.consumer.seek(tp, offset)
        self._forget(tp)

    async def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit `offsets` (None: every current position) within `COMMIT_TIMEOUT_S` (see `commit_within`)."""
        await commit_within(self.consumer, offsets)

    async def rewind_to_committed(self) -> None:
        """Move every assigned partition back to its group's last commit (see `rewind_to_committed`)."""
        self._forget()
        await rewind_to_committed(self.consumer)
        self._forget()  # again: the loop may have handed on records while the commits were looked up

    # ---- point lookups -----------------------------------------------------------------------------

    async def read_at(self, tp: TopicPartition, offset: int, timeout_s: float) -> T | None:
        """The message at `offset` of `tp`; None if the log no longer holds it there (it ends before, another
        record took its place, or the record does not decode).

        For a reader without a loop. Raises KafkaError, or TimeoutError after `timeout_s`, when the broker
        does not answer.
        """
        consumer = self.consumer
        async with self._lookup:
            try:
                consumer.assign([tp])
                consumer.seek(tp, offset)
                self._forget()
                skipped = 0
                async with asyncio.timeout(timeout_s):
                    while True:
                        fetched = await consumer.getmany(tp, timeout_ms=LOOKUP_POLL_MS, max_records=1)
                        records = fetched.get(tp, [])
                        if records:
                            if records[0].offset != offset:
                                # Past it: maybe a fetch that skipped it (broker quirk "fetch skips a
                                # batch"); a lost request would be sent twice. Read again, GAP_TRIES times.
                                if records[0].offset < offset or skipped >= GAP_TRIES:
                                    return None
                                skipped += 1
                                consumer.seek(tp, offset)
                                continue
                            batch = self._decode(tp, records)
                            return batch.messages[0][1] if batch.messages else None
                        # An empty fetch with the log's end at or before the offset: the record is gone
                        # (docs/architecture.md, broker quirk "empty restart": no error past the end).
                        end = consumer.highwater(tp)
                        if end is not None and end <= offset:
                            return None
            except OffsetOutOfRangeError:
                return None
            finally:
                # Unassigned, the consumer stops fetching in the background until the next lookup.
                consumer.unsubscribe()

    # ---- the loop ----------------------------------------------------------------------------------

    async def _run(self, hooks: Hooks[T]) -> None:
        consumer = self.consumer
        stretch = self._stretch = FetchWaitAdjuster(consumer, self.name)
        watch = LogResetWatch(consumer, self.name) if self._options.watch_reset else None
        try:
            while not self._finishing:
                try:
                    await self._round(hooks, consumer, stretch, watch)
                except Exception as exc:
                    if hooks.error is None or not await hooks.error(exc):
                        raise
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # Nobody else would ever answer whoever waits on this reader: fail them, loudly.
            log.exception("%s: the reader died", self.name)
            self.failed = exc
            if hooks.failed is not None:
                hooks.failed(exc)
            raise

    async def _round(
        self,
        hooks: Hooks[T],
        consumer: AIOKafkaConsumer,
        stretch: FetchWaitAdjuster,
        watch: LogResetWatch | None,
    ) -> None:
        """One poll and everything around it."""
        poll = self._options.poll
        woke: float | None = None  # (loop time) when a ring ended this round's sleep
        if self._drowsy and self._may_sleep(hooks, stretch) and self._ends_known():
            # The last poll brought nothing: sleep out the rest of its poll timeout, then poll (also when
            # woken by `finish`, so a last poll reads what arrived meanwhile).
            last = self._last_poll_ms
            if hooks.before_sleep is not None:
                await hooks.before_sleep()
            rest_s = (last - min(last, self._options.linger_ms)) / 1000
            loop = asyncio.get_running_loop()
            if await self._sleep(consumer, self._parked.sleep_s(rest_s, loop.time())):
                woke = loop.time()
        if hooks.before_poll is not None:
            poll = await hooks.before_poll() or poll
        # A reader that may sleep polls briefly, and sleeps at the start of the next round if nothing came.
        sleepy = self._may_sleep(hooks, stretch)
        timeout_ms = min(poll.timeout_ms, self._options.linger_ms) if sleepy else poll.timeout_ms
        self._last_poll_ms = poll.timeout_ms
        fetched = await consumer.getmany(timeout_ms=timeout_ms, max_records=poll.max_records)
        self._parked.polled(woke, stretch.wait_ms, timeout_ms, bool(fetched))
        await stretch.after_poll(bool(fetched))
        for tp, records in fetched.items():
            records = self._whole(consumer, tp, records)
            if records:
                await hooks.handle(self._decode(tp, records))
        if watch is not None and watch.due(bool(fetched)):
            rewound = await watch.check()
            if rewound:  # (`_forget()` of nothing named forgets every partition)
                self._forget(*rewound)
                if hooks.reset is not None:
                    await hooks.reset(rewound)
        # The positions of the partitions this poll moved: after a hole, the hole's start (`_whole` moved back
        # there), so only what was handed on is committed. Not the others': a partition the broker no longer
        # knows (an empty restart forgets every topic nobody wrote to since) fails its commit only after
        # COMMIT_TIMEOUT_S of retries, and the reader reads nothing meanwhile.
        moved = (
            {tp: self._next[tp] for tp in fetched if tp in self._next} if self._options.commit_after_poll else {}
        )
        if moved:
            try:
                await commit_within(consumer, moved)
            except (KafkaError, TimeoutError) as exc:
                log.warning("%s: offset commit failed: %r", self.name, exc)
        if hooks.after_poll is not None:
            await hooks.after_poll(bool(fetched))
        sparse = self._sparse
        if sleepy and not fetched:
            self.empty_polls += 1
        if sparse is not None and sleepy:
            sparse.polled(bool(fetched))
        self._drowsy = sleepy and (not fetched or (sparse is not None and sparse.sparse))

    def _may_sleep(self, hooks: Hooks[T], stretch: FetchWaitAdjuster) -> bool:
        bell = self._doorbell
        return (
            bell is not None
            and bell.armed
            and not self._finishing
            and not stretch.stretched  # records are there, slow to read
            and (hooks.may_sleep is None or hooks.may_sleep())
        )

    def _ends_known(self) -> bool:
        """Whether a fetch has told the end of every assigned partition: the lag gauge and `LogResetWatch`
        need it, and a reader that slept right after a (re-)assignment would not learn it until it woke (it
        polls briefly instead, until a fetch has answered)."""
        consumer = self._consumer
        return consumer is not None and all(consumer.highwater(tp) is not None for tp in consumer.assignment())

    async def _sleep(self, consumer: AIOKafkaConsumer, timeout_s: float) -> bool:
        """No fetches until the doorbell rings (True) or `timeout_s` passes (then the loop polls as usual)."""
        bell = self._doorbell
        assert bell is not None
        awake = [tp for tp in consumer.assignment() if tp not in consumer.paused()]
        # Paused, the fetcher sends nothing for them; a fetch already under way ends within its short wait
        # and whatever it brought stays unread until they are resumed.
        consumer.pause(*awake)
        self.sleeps += 1
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            rung = await bell.wait(timeout_s)
            if self._sparse is not None:
                self._sparse.slept(loop.time() - began)
            return rung
        finally:
            # Rings from now on wake the next sleep: the fetch about to go out sees what they announced
            # only if their records were acknowledged before it.
            bell.clear()
            assigned = consumer.assignment()
            consumer.resume(*(tp for tp in awake if tp in assigned and tp not in self._held))

    def _decode(self, tp: TopicPartition, records: list[Any]) -> Batch[T]:
        batch: Batch[T] = Batch(tp, [], [], records[-1].offset + 1)
        decode = self._decoder.decode
        for record in records:
            try:
                batch.messages.append((record, decode(record.value or b"")))
            except Exception as exc:
                log.error(
                    "%s: dropping an undecodable record at %s[%d]@%d: %r",
                    self.name,
                    tp.topic,
                    tp.partition,
                    record.offset,
                    exc,
                )
                batch.dropped.append(record)
        return batch

    # ---- holes in what a fetch brought -------------------------------------------------------------

    def _forget(self, *tps: TopicPartition) -> None:
        """The consumer was moved (these partitions; none named: all): what it reads next is no hole."""
        if tps:
            for tp in tps:
                self._next.pop(tp, None)
                self._holes.pop(tp, None)
        else:
            self._next.clear()
            self._holes.clear()

    def _whole(self, consumer: AIOKafkaConsumer, tp: TopicPartition, records: list[Any]) -> list[Any]:
        """The records up to the first hole, the consumer moved back to read the hole again (broker quirk
        "fetch skips a batch"); all of them when there is none, or the hole was read GAP_TRIES times.

        Per batch a few integer comparisons: a run of offsets first..last without a hole holds exactly
        last - first + 1 records. Records starting before the expected offset mean the consumer was moved
        back (a rewind, an empty broker restart): never a hole.
        """
        first = records[0].offset
        last = records[-1].offset
        expected = self._next.get(tp)
        if (expected is None or first <= expected) and last - first + 1 == len(records):
            self._next[tp] = last + 1
            if self._holes:
                self._holes.pop(tp, None)
            return records
        if expected is not None and first > expected:
            keep, hole, after = 0, expected, first
        else:
            keep = next(i for i in range(1, len(records)) if records[i].offset != records[i - 1].offset + 1)
            if records[keep].offset <= records[keep - 1].offset:
                # Going back: the log restarted between the fetches it merged. No hole (a seek past the new
                # log's end looked like a lost log at every poll, and moved every open stream each time).
                self._forget(tp)
                return records[:keep] + self._whole(consumer, tp, records[keep:])
            hole, after = records[keep - 1].offset + 1, records[keep].offset
        seen = self._holes.get(tp)
        tries = seen[1] + 1 if seen is not None and seen[0] == hole else 1
        if tries > GAP_TRIES:
            self.gaps_accepted += 1
            self._holes.pop(tp, None)
            log.warning("%s: offsets %d..%d of %s[%d] are missing after %d reads; reading on past them",
                        self.name, hole, after - 1, tp.topic, tp.partition, GAP_TRIES)  # fmt: skip
            self._next[tp] = after
            return records[:keep] + self._whole(consumer, tp, records[keep:])
        self.gaps_refetched += 1
        self._holes[tp] = (hole, tries)
        log.info("%s: a fetch of %s[%d] skipped offsets %d..%d; reading them again (try %d)",
                 self.name, tp.topic, tp.partition, hole, after - 1, tries)  # fmt: skip
        consumer.seek(tp, hole)
        self._next[tp] = hole
        return records[:keep]


class _Forgetting(ConsumerRebalanceListener):  # type: ignore[misc]
    """A group member's rebalance listener that first tells its reader the consumer was moved."""

    def __init__(self, reader: Reader[Any], inner: ConsumerRebalanceListener | None) -> None:
        self._reader = reader
        self._inner = inner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        """Pass on to the reader's own listener."""
        if self._inner is not None:
            res = self._inner.on_partitions_revoked(revoked)
            if asyncio.iscoroutine(res):
                await res

    async def on_partitions_assigned(self, assigned: Any) -> None:
        """Partitions come back at their commits: no hole; then pass on to the reader's own listener."""
        self._reader._forget()
        if self._inner is not None:
            res = self._inner.on_partitions_assigned(assigned)
            if asyncio.iscoroutine(res):
                await res
