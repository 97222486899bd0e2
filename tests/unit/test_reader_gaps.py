"""The reader loop's answer to a fetch that skipped records: hand on what came before, read the hole again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from bus.read_spec import Batch, Hooks, Options
from bus.reader import GAP_TRIES, Reader
from launch.services import free_port

TP = TopicPartition("t", 0)


@dataclass
class Record:
    offset: int
    value: bytes = b""


class Raw:
    """Decodes nothing: the value is the message."""

    def decode(self, buf: bytes, /) -> bytes:
        return buf


@dataclass
class FakeConsumer:
    """Serves queued fetches; records seeks and commits."""

    fetches: list[dict[TopicPartition, list[Record]]]
    seeks: list[tuple[TopicPartition, int]] = field(default_factory=list)
    commits: int = 0

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict:
        return self.fetches.pop(0) if self.fetches else {}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    def assign(self, tps: list[TopicPartition]) -> None:
        pass

    async def commit(self, offsets: object = None) -> None:
        self.commits += 1

    def unsubscribe(self) -> None:
        pass

    def highwater(self, tp: TopicPartition) -> int | None:
        return None


class NoStretch:
    wait_ms = 100

    async def after_poll(self, got: bool) -> None:
        pass


def run(offsets: list[int]) -> list[Record]:
    return [Record(o) for o in offsets]


async def read(
    fetches: list[list[int]], reader: Reader[bytes] | None = None
) -> tuple[Reader[bytes], list[int], FakeConsumer]:
    """Run one loop round per fetch; the offsets handed on, in order."""
    handed: list[int] = []

    async def handle(batch: Batch[bytes]) -> None:
        assert batch.end == batch.messages[-1][0].offset + 1
        handed.extend(r.offset for r, _ in batch.messages)

    reader = reader or Reader("test", "127.0.0.1:1", Raw(), Options(commit_after_poll=True))
    consumer = FakeConsumer([{TP: run(f)} if f else {} for f in fetches])
    reader._consumer = consumer  # type: ignore[assignment]
    for _ in fetches:
        await reader._round(Hooks(handle), consumer, NoStretch(), None)  # type: ignore[arg-type]
    return reader, handed, consumer


async def test_a_whole_run_passes_untouched() -> None:
    reader, handed, consumer = await read([[0, 1, 2], [3, 4]])
    assert handed == [0, 1, 2, 3, 4] and consumer.seeks == [] and reader.gaps_refetched == 0


async def test_a_hole_inside_a_fetch_is_read_again() -> None:
    reader, handed, consumer = await read([[0, 1, 2, 6, 7], [3, 4, 5, 6, 7, 8]])
    assert handed == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert consumer.seeks == [(TP, 3)]
    assert reader.gaps_refetched == 1 and reader.gaps_accepted == 0


async def test_a_fetch_starting_past_the_last_record_is_read_again() -> None:
    _, handed, consumer = await read([[0, 1], [5, 6], [2, 3, 4, 5, 6]])
    assert handed == [0, 1, 2, 3, 4, 5, 6]
    assert consumer.seeks == [(TP, 2)]


async def test_a_hole_that_stays_is_read_past_after_the_tries() -> None:
    fetches = [[0, 1, 4, 5]] + [[4, 5]] * GAP_TRIES
    reader, handed, consumer = await read(fetches)
    assert handed == [0, 1, 4, 5]
    assert consumer.seeks == [(TP, 2)] * GAP_TRIES
    assert reader.gaps_refetched == GAP_TRIES and reader.gaps_accepted == 1


async def test_a_second_hole_behind_one_read_past_is_read_again() -> None:
    # After the seek back to 1 the broker keeps answering from 3; the last of those brings another hole.
    fetches = [[0, 3]] + [[3]] * (GAP_TRIES - 1) + [[3, 5], [4, 5, 6]]
    reader, handed, consumer = await read(fetches)
    assert handed == [0, 3, 4, 5, 6]
    assert consumer.seeks == [(TP, 1)] * GAP_TRIES + [(TP, 4)]
    assert reader.gaps_accepted == 1


async def test_records_before_the_expected_offset_are_a_rewind_not_a_hole() -> None:
    # An empty broker restart: the log starts again at 0.
    _, handed, consumer = await read([[0, 1, 2, 3], [0, 1]])
    assert handed == [0, 1, 2, 3, 0, 1] and consumer.seeks == []


async def test_offsets_going_back_within_a_fetch_are_a_restarted_log_not_a_hole() -> None:
    # One fetch merging the old log's last records with the restarted log's first: handed on as they come,
    # and no seek (a seek to 87 would be past the new log's end, and look like a lost log at every poll).
    reader, handed, consumer = await read([[84, 85, 86, 20, 21], [22, 23]])
    assert handed == [84, 85, 86, 20, 21, 22, 23] and consumer.seeks == [] and reader.gaps_refetched == 0


async def test_a_move_through_the_reader_is_no_hole() -> None:
    reader, handed, consumer = await read([[0, 1]])
    reader.seek(TP, 10)
    await reader.assign({TP: 20})
    _, handed, consumer = await read([[20, 21]], reader)
    assert handed == [20, 21] and consumer.seeks == []


async def test_commit_after_poll_follows_the_move_back_to_the_hole() -> None:
    # The fake's commit commits "the positions"; the seek back to the hole came first.
    calls: list[str] = []
    reader = Reader("test", "127.0.0.1:1", Raw(), Options(commit_after_poll=True))
    consumer = FakeConsumer([{TP: run([0, 1, 5])}])
    orig_seek, orig_commit = consumer.seek, consumer.commit

    def seek(tp: TopicPartition, offset: int) -> None:
        calls.append(f"seek {offset}")
        orig_seek(tp, offset)

    async def commit(offsets: object = None) -> None:
        calls.append("commit")
        await orig_commit(offsets)

    consumer.seek, consumer.commit = seek, commit  # type: ignore[method-assign]

    async def handle(batch: Batch[bytes]) -> None:
        calls.append(f"handle {[r.offset for r, _ in batch.messages]}")

    reader._consumer = consumer  # type: ignore[assignment]
    await reader._round(Hooks(handle), consumer, NoStretch(), None)  # type: ignore[arg-type]
    assert calls == ["seek 2", "handle [0, 1]", "commit"]


async def test_a_fetch_that_is_all_hole_hands_on_nothing() -> None:
    _, handed, consumer = await read([[0], [3, 4], [1, 2, 3, 4]])
    assert handed == [0, 1, 2, 3, 4] and consumer.seeks == [(TP, 1)]


async def test_a_partition_assigned_again_where_it_was_keeps_its_expectation() -> None:
    reader, _, _ = await read([[0, 1]])
    other = TopicPartition("u", 0)
    await reader.assign({TP: 2, other: 7})
    _, handed, consumer = await read([[4, 5], [2, 3, 4, 5]], reader)
    assert handed == [2, 3, 4, 5] and consumer.seeks == [(TP, 2)]


async def test_a_lookup_whose_fetch_skipped_the_record_reads_again() -> None:
    reader = Reader("lookups", "127.0.0.1:1", Raw())
    consumer = FakeConsumer([{TP: [Record(5, b"five")]}, {TP: [Record(3, b"three")]}])
    reader._consumer = consumer  # type: ignore[assignment]
    assert await reader.read_at(TP, 3, 5.0) == b"three"
    assert consumer.seeks == [(TP, 3), (TP, 3)]


async def test_a_lookup_past_a_hole_that_stays_finds_nothing() -> None:
    reader = Reader("lookups", "127.0.0.1:1", Raw())
    consumer = FakeConsumer([{TP: [Record(5, b"five")]}] * (GAP_TRIES + 1))
    reader._consumer = consumer  # type: ignore[assignment]
    assert await reader.read_at(TP, 3, 5.0) is None
    assert consumer.seeks == [(TP, 3)] * (GAP_TRIES + 1)


async def test_a_consumer_that_fails_to_start_is_stopped() -> None:
    made: list[Any] = []

    class Recording(Options):
        def make_consumer(self, bootstrap: str) -> Any:
            made.append(super().make_consumer(bootstrap))
            return made[-1]

    reader = Reader("unreachable", f"127.0.0.1:{free_port()}", Raw(), Recording())
    with pytest.raises(KafkaError):
        await reader.open(None)
    # Not stopped, it would hold its connections and warn "Unclosed AIOKafkaConsumer" when collected.
    assert made and made[0]._closed is True
    assert not reader.started
