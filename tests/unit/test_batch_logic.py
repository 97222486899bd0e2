"""Logic of the batch path without services: file checks, ordering, item assembly, pool room and commits."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from schemas.batch import ItemMeta
from schemas.kafka import Chunk, ChunkUsage, ErrorInfo, GenerateRequest
from schemas.settings import WorkerSettings
from server.batch.items import split_item_id, split_sequence_id
from server.batch.lines import ItemChunks, build
from server.batch.ordering import plan
from server.batch.validate import parse_batch_file, window_seconds
from workers.engine import EngineStats
from workers.pool_consumer import PartitionTrack, PoolConsumer

MODEL = "m"


def line(cid: str, **over: Any) -> bytes:
    body = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL}}
    return json.dumps({**body, **over}).encode()


def test_a_valid_file_keeps_line_numbers_and_skips_blank_lines() -> None:
    parsed = parse_batch_file(line("a") + b"\n\n" + line("b") + b"\n", 10)
    assert not parsed.errors
    assert [(n, x.custom_id) for n, x in parsed.lines] == [(1, "a"), (3, "b")]


def test_file_errors_name_their_line() -> None:
    parsed = parse_batch_file(b"\n".join([line("a"), b"nope", line("a"), line("c", body=[1])]), 10)
    assert [(e.line, e.code) for e in parsed.errors] == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "invalid_request"),
    ]
    too_many = parse_batch_file(b"\n".join(line(str(i)) for i in range(5)), 3)
    assert too_many.errors[-1].code == "too_many_requests"


def test_windows() -> None:
    assert window_seconds("24h") == 86400 and window_seconds("10s") == 10 and window_seconds("30m") == 1800
    assert window_seconds("0h") is None and window_seconds("1 day") is None


def test_prefix_order_groups_shared_prefixes_in_contiguous_partitions() -> None:
    block = 4
    prefixes = [[100 + p] * 12 for p in range(3)]
    # Submission order interleaves the three prefixes.
    prompts = [(i, prefixes[i % 3] + [i]) for i in range(12)]
    order = plan(prompts, 3, MODEL, block, "prefix")
    assert sorted(i for i, _ in order) == list(range(12))
    by_partition: dict[int, set[int]] = {}
    for index, part in order:
        by_partition.setdefault(part, set()).add(index % 3)
    # Each partition holds items of one prefix only.
    assert all(len(groups) == 1 for groups in by_partition.values())
    submission = plan(prompts, 3, MODEL, block, "submission")
    assert [i for i, _ in submission] == list(range(12))
    assert [p for _, p in submission] == [i % 3 for i in range(12)]


def test_ids_round_trip() -> None:
    assert split_item_id("batch_abc:12") == ("batch_abc", 12)
    assert split_item_id("kitem-0-5-1") is None
    assert split_sequence_id("batch_abc:12/3") == ("batch_abc:12", 3)
    assert split_sequence_id("chatcmpl-x.0") is None


class _Fmt:
    def token(self, token_id: int) -> str:
        return str(token_id)


def _meta(n: int = 1) -> ItemMeta:
    return ItemMeta(custom_id="c", endpoint="/v1/chat/completions", model=MODEL, prompt_lens=[5], n=n)


def test_an_interrupted_run_is_dropped_and_the_rerun_wins() -> None:
    item = ItemChunks(first_offset=0)
    item.add(0, Chunk("i/0", 0, [1], "a", worker_id="w1"))
    item.add(
        0,
        Chunk("i/0", 1, finish_reason="error", worker_id="w1", error=ErrorInfo("worker_stopped", "x", True)),
    )
    assert not item.finished(1) and item.error is None
    item.add(0, Chunk("i/0", 0, [1], "a", worker_id="w2"))
    item.add(0, Chunk("i/0", 1, [2], "b", finish_reason="stop", usage=ChunkUsage(5, 2, 3), worker_id="w2"))
    assert item.finished(1)
    result = build(_meta(), item, _Fmt())  # type: ignore[arg-type]
    body = json.loads(result.body)
    assert result.ok and body["choices"][0]["message"]["content"] == "ab"
    assert (result.input_tokens, result.cached_tokens, result.output_tokens) == (5, 3, 2)


def test_a_run_of_joined_chunks_is_whole_once_they_cover_it() -> None:
    item = ItemChunks(first_offset=0)
    item.add(0, Chunk("i/0", 3, [4], "d", finish_reason="stop", usage=ChunkUsage(5, 4), worker_id="w"))
    item.add(0, Chunk("i/0", 0, [1, 2], "ab", worker_id="w", span=2))
    assert not item.finished(1)  # chunk 2 is missing
    item.add(0, Chunk("i/0", 2, [3], "c", worker_id="w"))
    assert item.finished(1)
    body = json.loads(build(_meta(), item, _Fmt()).body)  # type: ignore[arg-type]
    assert body["choices"][0]["message"]["content"] == "abcd"


def test_chunks_out_of_order_and_duplicated_make_one_answer() -> None:
    item = ItemChunks(first_offset=0)
    c1 = Chunk("i/1", 1, [2], "y", finish_reason="length", usage=ChunkUsage(5, 2), worker_id="w")
    c0 = Chunk("i/1", 0, [1], "x", worker_id="w")
    for c in (c1, c0, c0, c1):
        item.add(1, c)
    item.add(0, Chunk("i/0", 0, [3], "z", finish_reason="stop", usage=ChunkUsage(5, 1), worker_id="w"))
    assert item.finished(2)
    body = json.loads(build(_meta(n=2), item, _Fmt()).body)  # type: ignore[arg-type]
    assert [c["message"]["content"] for c in body["choices"]] == ["z", "xy"]
    assert body["usage"]["completion_tokens"] == 3


def test_a_request_error_decides_the_item() -> None:
    item = ItemChunks(first_offset=0)
    item.add(
        0,
        Chunk(
            "i/0", 0, finish_reason="error", worker_id="w", error=ErrorInfo("context_length_exceeded", "long")
        ),
    )
    assert item.finished(1)
    result = build(_meta(), item, _Fmt())  # type: ignore[arg-type]
    assert not result.ok and result.status == 400


def test_commit_point_waits_for_the_oldest_unfinished_item() -> None:
    t = PartitionTrack()
    for off in (10, 11, 12):
        t.take(off)
    t.done(11)
    assert t.commit_point() == 10
    t.done(10)
    assert t.commit_point() == 12
    t.committed = 12
    assert t.commit_point() is None
    t.done(12)
    assert t.commit_point() == 13


@dataclass
class _Engine:
    stats_now: EngineStats

    def stats(self) -> EngineStats:
        return self.stats_now


@dataclass
class _Host:
    engine: _Engine
    failed: bool = False
    started: list[str] = field(default_factory=list)

    def start_request(self, req: GenerateRequest) -> asyncio.Task[None] | None:
        return None

    def running_task(self, request_id: str) -> asyncio.Task[None] | None:
        return None

    async def flush_replies(self, timeout_s: float) -> bool:
        return True

    def fail(self, exc: BaseException) -> None:
        self.failed = True


def _stats(running: int = 0, waiting: int = 0, kv: float = 0.0) -> EngineStats:
    return EngineStats(running, waiting, kv, 0.0, 1000, 64, 4096)


def test_pool_room_is_only_spare_capacity() -> None:
    settings = WorkerSettings(pool_max_inflight=8, pool_max_kv_usage=0.8, max_num_seqs=10)
    host = _Host(_Engine(_stats()))
    pool = PoolConsumer(settings, host, store=None, registry=CollectorRegistry())  # type: ignore[arg-type]
    assert pool._room_for() == 8
    host.engine.stats_now = _stats(running=5)
    assert pool._room_for() == 5  # what the engine's sequence limit leaves
    host.engine.stats_now = _stats(running=1, waiting=1)
    assert pool._room_for() == 0  # anything waiting (interactive or not) means no spare capacity
    host.engine.stats_now = _stats(kv=0.85)
    assert pool._room_for() == 0
    host.engine.stats_now = _stats()
    pool._sequences = 8
    assert pool._room_for() == 0
    pool._sequences = 0
    host.failed = True
    assert pool._room_for() == 0
    host.failed = False
    pool.stop_taking()
    assert pool._room_for() == 0


def test_batch_sequences_send_their_output_once() -> None:
    pool = PoolConsumer(WorkerSettings(), _Host(_Engine(_stats())), store=None, registry=CollectorRegistry())  # type: ignore[arg-type]
    batch_req = GenerateRequest("b:0/0", MODEL, [1], 4, "results")
    other = GenerateRequest("chatcmpl-x.0", MODEL, [1], 4, "replies")
    pool._pool_requests.add(batch_req.request_id)
    assert pool.coalesce(batch_req, Chunk("b:0/0", 0, [5], "a")) is None
    assert pool.coalesce(batch_req, Chunk("b:0/1", 1, [6], "b")) is None
    passed = Chunk("chatcmpl-x.0", 0, [7], "z")
    assert pool.coalesce(other, passed) is passed
    whole = pool.coalesce(
        batch_req, Chunk("b:0/0", 2, [7], "c", finish_reason="stop", usage=ChunkUsage(1, 3))
    )
    assert whole is not None
    assert (whole.seq, whole.token_ids, whole.text, whole.finish_reason) == (0, [5, 6, 7], "abc", "stop")
    assert whole.usage == ChunkUsage(1, 3) and not pool._partial
