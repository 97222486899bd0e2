"""Every topic Ferry writes to is bounded on the embedded broker, and nothing is lost across a roll.

Request topics roll by the clock (`--request-roll-s`): the worker reads a window of epochs and deletes the
topics behind it once read. On Apache Kafka the bound is retention: every topic Ferry creates carries
`retention.ms` / `retention.bytes` / `cleanup.policy` (the embedded broker stores and describes them).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from bus.produce import TrackingProducer
from bus.topics import delete_topics, ensure_topics
from schemas.names import (
    admin_topic,
    batch_results_topic,
    batch_submit_topic,
    pool_topic,
    reply_topic,
    request_topic,
)
from tests.harness import Harness, sse_events, until
from tests.integration.test_delivery import read_one
from tests.integration.test_resume import chat as resume_chat
from tests.integration.test_resume import read_some, ready

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


async def topics(kafka: str) -> set[str]:
    """Every topic the broker lists."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def configs_of(kafka: str, topic: str) -> dict[str, str]:
    """The configs the broker describes for `topic`."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        [resp] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    [resource] = resp.resources
    assert resource[0] == 0, f"DescribeConfigs of {topic} failed: {resource}"
    return {entry[0]: entry[1] for entry in resource[4]}


async def test_requests_across_request_topic_rolls_all_complete_and_read_topics_are_deleted(
    h: Harness, kafka: str
) -> None:
    roll_s = 0.5
    w = await h.add_worker(request_roll_s=roll_s)
    # A send gives up (503) before the worker may judge its epoch read (`RequestTopics.GRACE_S`).
    fe, url = await h.add_frontend(request_roll_s=roll_s, kafka_timeout_s=2.0)
    wid = w.worker.settings.worker_id
    inbox = w.worker._inbox
    # (30 s by default) a read epoch is deleted 3 s after it ended
    inbox.topics.grace_s = fe.svc.dispatcher.topics.grace_s = 3.0
    used: set[str] = set()
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 20, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        # Waves of concurrent requests until they were sent to 8 epochs' topics: requests are in flight
        # across every roll, and the first topics fall behind the worker's window meanwhile.
        while len(used) < 8:
            answers = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))
            assert [a.status_code for a in answers] == [200] * 4
            assert all(a.json()["usage"]["completion_tokens"] == 20 for a in answers)
            used |= {
                t for t in fe.svc.dispatcher._sent_to.values() if t.startswith(f"ferry.requests.{wid}.e")
            }
    assert (fe.metrics.registry.get_sample_value("ferry_requests_lost_total") or 0) == 0

    async def bounded() -> bool:
        # Every epoch that carried requests was read and deleted; what is left is the window (the current
        # epoch and LAG before it) and the epochs of the grace period.
        mine = {t for t in await topics(kafka) if t.startswith(f"ferry.requests.{wid}.e")}
        return len(mine) <= inbox.topics.LAG + 1 + 3.0 / roll_s + 2 and not used & mine

    await until(bounded, 30, 0.1)


async def test_a_topic_behind_the_window_is_kept_until_its_requests_are_read(h: Harness, kafka: str) -> None:
    roll_s = 1000.0  # the test moves the clocks
    now = [1_000_000.0]
    w = await h.add_worker(request_roll_s=roll_s)
    fe, url = await h.add_frontend(request_roll_s=roll_s)
    inbox = w.worker._inbox
    inbox.topics.clock = fe.svc.dispatcher.topics.clock = lambda: now[0]
    wid = w.worker.settings.worker_id
    first = inbox.topics.current(wid)
    await until(lambda: _async(first in inbox._window), 10, 0.05)
    # The worker stops reading the current topic (it keeps heartbeating): the request waits in the broker.
    inbox.reader.pause(TopicPartition(first, 0))
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 5, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        call = asyncio.create_task(c.post("/v1/completions", json=body))
        await until(lambda: _async(first in fe.svc.dispatcher._sent_to.values()), 10, 0.02)
        # The clocks move on until the topic lies behind the window.
        now[0] += (inbox.topics.LAG + 2) * roll_s
        ahead = inbox.topics.window(wid)[-1]
        await until(lambda: _async(ahead in inbox._window), 10, 0.05)
        # The inbox looked at `first` (behind the window now) in the same round that assigned `ahead`.
        assert first in await topics(kafka), "a topic with an unread request was deleted"
        assert not call.done()
        inbox.reader.resume(TopicPartition(first, 0))
        answer = await call
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5

        async def deleted() -> bool:
            return first not in await topics(kafka)

        await until(deleted, 20, 0.1)
        # Requests go on flowing through the current topic.
        again = await c.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5


async def test_the_next_epoch_is_read_before_the_clock_turns_and_nothing_moves_at_the_turn(
    h: Harness, kafka: str
) -> None:
    # Frontends write to the new epoch's topic from the moment the clock turns; a worker that only then
    # assigned it left those requests waiting out its poll (a stall at every turn under load).
    roll_s = 1000.0  # the test moves the clocks
    now = [1_000_500.0]  # half-way through an epoch: past the grace of the one before
    w = await h.add_worker(request_roll_s=roll_s)
    fe, url = await h.add_frontend(request_roll_s=roll_s)
    inbox = w.worker._inbox
    inbox.topics.clock = fe.svc.dispatcher.topics.clock = lambda: now[0]
    wid = w.worker.settings.worker_id
    epoch = inbox.topics.epoch()
    assert epoch is not None
    following = request_topic(wid, epoch + 1)
    # (the epoch before is read and deleted meanwhile)
    settled = lambda: following in inbox._window and not any(map(inbox.topics.deletable, inbox._window))  # noqa: E731
    await until(lambda: _async(settled()), 10, 0.05)
    window, assigned = list(inbox._window), set(inbox.reader.consumer.assignment())
    assert TopicPartition(following, 0) in assigned
    now[0] = (epoch + 1) * roll_s + 1.0  # the turn
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 5, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        answer = await c.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
    assert following in fe.svc.dispatcher._sent_to.values()
    assert inbox._window == window and set(inbox.reader.consumer.assignment()) == assigned


async def test_requests_in_epochs_the_worker_rolled_past_are_read_and_only_written_epochs_exist(
    h: Harness, kafka: str
) -> None:
    # The worker moves its window after a poll: a poll or a loop slower than an epoch jumps over whole
    # epochs, which were never in its window; the requests frontends wrote there must still be read.
    roll_s = 1000.0  # the test moves the clocks
    now = [1_000_000.0]
    fe_now = [now[0]]
    w = await h.add_worker(request_roll_s=roll_s)
    fe, url = await h.add_frontend(request_roll_s=roll_s)
    inbox = w.worker._inbox
    inbox.topics.clock = lambda: now[0]
    inbox.topics.grace_s = 0.0
    fe.svc.dispatcher.topics.clock = lambda: fe_now[0]
    wid = w.worker.settings.worker_id
    epoch = inbox.topics.epoch()
    assert epoch is not None
    current, ahead = request_topic(wid, epoch), request_topic(wid, epoch + 1)
    # (without grace the next epoch is read ahead at once)
    await until(lambda: _async(current in inbox._window and ahead in inbox._window), 10, 0.05)
    # The frontends move on two epochs while the worker's loop is stuck: the request goes to a topic that
    # was never in the worker's window.
    skipped = request_topic(wid, epoch + 2)
    fe_now[0] += 2 * roll_s
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 5, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        call = asyncio.create_task(c.post("/v1/completions", json=body))
        await until(lambda: _async(skipped in fe.svc.dispatcher._sent_to.values()), 10, 0.02)
        # The worker's next roll comes five epochs later (its window: the fifth, the one before and the one
        # after): neither `skipped` nor the epoch after it was ever in its window.
        now[0] += 5 * roll_s
        fe_now[0] = now[0]
        answer = await asyncio.wait_for(call, 20)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5

        async def deleted() -> bool:
            return skipped not in await topics(kafka)

        await until(deleted, 20, 0.1)  # read, so deleted like any past epoch
        # The skipped epoch nobody wrote to was looked for without being created.
        assert request_topic(wid, epoch + 3) not in await topics(kafka)
        again = await c.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5


async def test_a_request_the_broker_lost_in_an_epoch_behind_the_window_is_sent_again(
    h: Harness, kafka: str
) -> None:
    # At short epochs a request's topic lies behind its worker's window by the time the frontend's delivery
    # check looks for the request (`--delivery-check-s` without an answer); the topic stays until the worker
    # may delete it, and the check must look there meanwhile, or a request the broker lost is never sent
    # again (the stream hangs).
    roll_s = 10.0  # the test moves the clocks
    now = [1_000_000.0]  # the start of an epoch
    w = await h.add_worker(request_roll_s=roll_s)
    fe, url = await h.add_frontend(request_roll_s=roll_s, delivery_check_s=1.0, request_timeout_s=60.0)
    inbox = w.worker._inbox
    inbox.topics.clock = fe.svc.dispatcher.topics.clock = lambda: now[0]
    wid = w.worker.settings.worker_id
    first = inbox.topics.current(wid)
    await until(lambda: _async(first in inbox._window), 10, 0.05)
    # The worker stops reading (it keeps heartbeating): the request waits in the broker, as under load.
    inbox.reader.pause(TopicPartition(first, 0))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        call = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        await read_one(kafka, first)
        # The broker loses it (as Tansu does when it restarts empty), and the clocks move on until its topic
        # lies behind the worker's window, within the grace before the worker may delete it.
        await delete_topics(kafka, [first])
        await ensure_topics(kafka, {first: 1})
        now[0] += (inbox.topics.LAG + 1) * roll_s
        assert inbox.topics.behind(first) and not inbox.topics.deletable(first)
        inbox.reader.resume(TopicPartition(first, 0))
        answer = await asyncio.wait_for(call, 30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 6
    assert fe.metrics.requests_lost._value.get() == 1


async def test_streams_outlive_their_request_epoch_resumed_or_cancelled(h: Harness, kafka: str) -> None:
    # A stream's request topic is read and deleted while the stream goes on: a dropped resumable stream is
    # resumed whole, and a client that leaves after its epoch was deleted still cancels its request.
    roll_s = 10.0  # the test moves the clocks
    now = [1_000_000.0]
    w = await h.add_worker(request_roll_s=roll_s, speedup=1.0)  # real time: the requests are still running
    fe, url = await h.add_frontend(request_roll_s=roll_s)
    inbox = w.worker._inbox
    inbox.topics.clock = fe.svc.dispatcher.topics.clock = lambda: now[0]
    inbox.topics.grace_s = fe.svc.dispatcher.topics.grace_s = 0.0
    wid = w.worker.settings.worker_id
    engine = w.worker.engine

    async def roll_past(topic: str) -> None:
        # The clocks move on until `topic` lies behind the window, and the worker deletes it once read.
        now[0] += (inbox.topics.LAG + 2) * roll_s

        async def deleted() -> bool:
            return topic not in await topics(kafka)

        await until(deleted, 20, 0.1)

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await ready(c, url)
        first = inbox.topics.current(wid)
        rid, head = await read_some(c, "/v1/chat/completions", resume_chat(max_tokens=300), 12)
        assert fe.svc.dispatcher._sent_to[(wid, f"{rid}.0")] == first  # (its one sequence)
        await roll_past(first)
        async with c.stream(
            "GET", f"/v1/chat/completions/{rid}/stream", headers={"last-event-id": str(head[-1][0])}
        ) as r:
            assert r.status_code == 200
            tail = [e async for e in sse_events(r)]
        ids = [int(i) for i, _ in head + tail if i is not None]
        assert ids == list(range(len(ids))) and tail[-1] == (None, "[DONE]")
        assert json.loads(tail[-2][1])["usage"]["completion_tokens"] == 300
        # A plain stream leaves after its epoch was deleted: its cancel goes to the current epoch.
        await asyncio.wait_for(w.worker.idle.wait(), 20)
        second = inbox.topics.current(wid)
        async with c.stream("POST", "/v1/chat/completions", json=resume_chat(max_tokens=5000)) as r:
            assert r.status_code == 200
            events = sse_events(r)
            await anext(events)
            await roll_past(second)
            assert engine.stats().running == 1
        await asyncio.wait_for(w.worker.idle.wait(), 20)
        assert engine.stats().running == 0 and engine.stats().kv_usage == 0.0


async def test_a_producer_keeps_the_metadata_of_a_topic_with_a_record_on_its_way(kafka: str) -> None:
    # A frontend forgets the previous epoch's topic when it meets the next one, while a request to the
    # previous epoch may still wait in the producer's batch (here held there by linger_ms): the metadata
    # update the new topic brings must not leave that record without a leader until it expires (a 503).
    base = f"bounds-{uuid.uuid4().hex[:6]}"
    other, old, new = f"{base}.replies", f"{base}.e1", f"{base}.e2"
    producer = TrackingProducer(bootstrap_servers=kafka, linger_ms=300, request_timeout_ms=3000)
    await producer.start()
    try:
        # Created after the producer started, as epochs are: it tracks each by name from its first record.
        await ensure_topics(kafka, {other: 1, old: 1, new: 1})
        # Another topic stays tracked (forgetting them all would make the producer ask for every topic).
        await producer.send_and_wait(other, b"other", partition=0)
        await producer.send_and_wait(old, b"first", partition=0)
        delivery = await producer.send(old, b"late", partition=0)
        producer.forget_idle(also=lambda t: t == old)
        await producer.send_and_wait(new, b"next", partition=0)
        assert (await asyncio.wait_for(delivery, 10)).offset == 1
    finally:
        await producer.stop()


async def _async(value: bool) -> bool:
    return value


async def test_topics_ferry_creates_carry_their_retention(h: Harness, kafka: str) -> None:
    model = f"bounds-{uuid.uuid4().hex[:6]}"  # pool and batch topics of their own (others made the default's)
    w = await h.add_worker(
        pool=True, served_model_name=model, request_roll_s=60.0, kafka_request_retention_s=120.0, kafka_batch_retention_s=7200.0,
        kafka_retention_bytes=5_000_000,
    )  # fmt: skip
    fe, _url = await h.add_frontend(
        batch_api=True, served_model_name=model, request_roll_s=60.0, kafka_request_retention_s=120.0, kafka_batch_retention_s=7200.0,
        kafka_retention_bytes=5_000_000, resume_ttl_s=300.0,
    )  # fmt: skip
    wid = w.worker.settings.worker_id
    short = {"cleanup.policy": "delete", "retention.ms": "120000", "retention.bytes": "5000000"}
    batch = {"cleanup.policy": "delete", "retention.ms": "7200000", "retention.bytes": "5000000"}
    replies = {"cleanup.policy": "delete", "retention.ms": "600000", "retention.bytes": "5000000"}
    expected = {
        w.worker._inbox.topic: short,
        w.worker._inbox.topics.current(wid): short,
        admin_topic(fe.settings.frontend_id): short,
        reply_topic(fe.settings.frontend_id): replies,
        pool_topic(model): batch,
        batch_results_topic(model): batch,
        batch_submit_topic(model): batch,
    }
    for topic, want in expected.items():
        got = await configs_of(kafka, topic)
        assert {k: got.get(k) for k in want} == want, topic


async def test_deleted_replies_topics_stay_deleted(h: Harness, kafka: str) -> None:
    # Workers' producers ask for the metadata of every topic they sent to whenever they meet a new one, and
    # the embedded broker creates a topic anew when asked for it by name: the frontend's retired replies
    # topics must not come back.
    w = await h.add_worker()
    fe, url = await h.add_frontend(replies_roll_records=10, resume_ttl_s=0.2)
    base = reply_topic(fe.settings.frontend_id)
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 12, "ignore_eos": True}

    async def rolls(n: int) -> None:
        # Each wave of requests fills a replies topic; the next wave goes to a fresh one.
        while (fe.metrics.registry.get_sample_value("ferry_reply_topic_rolls_total") or 0) < n:
            answers = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))
            assert [a.status_code for a in answers] == [200] * 4

    async def first_deleted() -> bool:
        return base not in await topics(kafka)

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await rolls(2)
        await until(first_deleted, 20, 0.1)  # the frontend deletes it once idle and past its retention
        w.worker._producer.forget_idle(0)  # at once, not after IDLE_TOPIC_S
        await rolls(4)  # the worker's producer meets new topics again
    assert base not in await topics(kafka), "a deleted replies topic was created again"
