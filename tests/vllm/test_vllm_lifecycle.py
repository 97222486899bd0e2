"""Real vLLM workers behind the frontend: engine statistics in heartbeats and /metrics, a client that goes
away aborting its request in the engine, and an engine that dies taking its worker out cleanly, without a
last word on its sequences (frontends move them)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from typing import TYPE_CHECKING

import httpx
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bus.topics import ensure_topics
from schemas.kafka import (
    ENGINE_DEAD,
    Chunk,
    GenerateRequest,
    SamplingParams,
    chunks_of,
    reply_decoder,
    request_encoder,
)
from schemas.names import request_topic
from schemas.settings import DEFAULT_MODEL_NAME as BASE
from server.model_files import ModelFiles
from tests.harness import sse_events
from tests.vllm.stack import VllmStack
from workers.cpu_env import CPU_ENGINE_ENV, cpu_engine_env

if TYPE_CHECKING:
    from workers.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm

LONG = 1500  # tokens: ~a minute of decoding here, so only an abort ends it within the test's deadlines


async def test_disconnect_aborts_in_the_engine_and_stats_follow(vllm_stack: VllmStack) -> None:
    stack = vllm_stack
    await stack.ensure_workers()
    body = {
        "model": BASE,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
    }
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            worker = r.headers["x-ferry-worker"]
            tokens = 0
            # Held until the block ends: left to the garbage collector after the break, the generator
            # would be finalized, closing the response and with it the connection, and the frontend
            # rightly cancels a stream whose client went away (the test failed so, only in the full suite).
            events = sse_events(r)
            async for _id, data in events:
                delta = json.loads(data)["choices"][0]["delta"]
                tokens += bool(delta.get("content"))
                if tokens >= 3:
                    break
            # While it streams, the engine's own figures are in the heartbeat and on /metrics.
            st = await stack.wait_status(worker, lambda s: s is not None and s.running == 1, 10)
            assert st is not None and st.waiting == 0 and 0 < st.kv_usage < 1
            m = await stack.wait_metrics(worker, lambda m: m["ferry_worker_engine_running"] == 1, 10)
            assert m["ferry_worker_kv_usage"] > 0 and m["ferry_worker_inflight"] == 1
            assert "ferry_worker_engine_waiting" in m and "ferry_worker_prefix_cache_queries_total" in m
        # The client is gone (the response was closed mid-stream): the engine stops running it.
    st = await stack.wait_status(worker, lambda s: s is not None and s.running == 0, 15)
    assert st is not None and st.kv_usage == 0
    m = await stack.wait_metrics(worker, lambda m: m["ferry_worker_inflight"] == 0, 15)
    assert m["ferry_worker_engine_running"] == 0
    assert m["ferry_worker_generated_tokens_total"] < LONG


@pytest.mark.kills_worker
async def test_engine_death_takes_the_worker_out(vllm_stack: VllmStack) -> None:
    stack = vllm_stack
    await stack.ensure_workers()
    victim = 1
    wid = VllmStack.worker_id(victim)
    child = stack.children[victim]
    files = ModelFiles.load(stack.model_path, BASE)
    prompt = files.encode(
        files.render_chat([{"role": "user", "content": "Describe the sea."}]), add_special_tokens=False
    )
    # Straight onto the worker's topic, replies to a topic of the test's own: what the worker itself
    # reports, whatever the frontend would then do with it (migrate, or fail the client's stream).
    replies = f"test.engine-death.{uuid.uuid4().hex[:8]}"
    await ensure_topics(stack.kafka, {replies: 1})
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.kafka, enable_auto_commit=False, fetch_max_wait_ms=20)
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka)
    await consumer.start()
    await producer.start()
    try:
        tp = TopicPartition(replies, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        rid = f"death-{uuid.uuid4().hex[:6]}"
        req = GenerateRequest(
            request_id=rid,
            model=BASE,
            prompt_token_ids=prompt,
            max_tokens=LONG,
            reply_topic=replies,
            sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        )
        await producer.send_and_wait(
            request_topic(wid), request_encoder.encode(req), key=rid.encode(), partition=0
        )

        async def next_chunks() -> list[Chunk]:
            batches = await consumer.getmany(tp, timeout_ms=30_000)
            assert batches, "no reply within 30 s"
            return [c for rec in batches[tp] for c in chunks_of(reply_decoder.decode(rec.value))]

        chunks = await next_chunks()
        while not any(c.token_ids for c in chunks):
            chunks += await next_chunks()
        assert all(c.finish_reason is None for c in chunks)

        # vLLM's EngineCore is a child process of the worker (AsyncLLM always runs it apart); kill it.
        os.kill(stack.engine_core_pid(victim), signal.SIGKILL)
        try:
            async with asyncio.timeout(150):  # the worker bounds each closing step; this bounds them all
                rc = await child.proc.wait()
        except TimeoutError:
            pytest.fail(
                "the worker did not exit after its engine died; its last lines:\n" + "\n".join(child.tail)
            )
        assert rc != 0
        # Its last word for the sequence says that the engine died with it: a frontend moves it at once and counts
        # the death against it (tests/integration/test_poison.py); no client sees the error.
        rest = await consumer.getmany(tp, timeout_ms=1000)
        chunks += [c for rec in rest.get(tp, []) for c in chunks_of(reply_decoder.decode(rec.value))]
        *output, last = chunks
        assert all(c.finish_reason is None for c in output), msgspec.json.encode(output[-1])
        assert last.finish_reason == "error" and last.error is not None, msgspec.json.encode(last)
        assert last.error.code == ENGINE_DEAD and last.error.retriable, msgspec.json.encode(last)
        assert any("stopping after a fatal error" in line for line in child.tail), child.tail
        assert await stack.status(wid) is None
        assert stack.frontend is not None and stack.frontend.svc is not None
        await stack.frontend.svc.pool.refresh()
        assert wid not in stack.frontend.svc.pool.workers
    finally:
        await consumer.stop()
        await producer.stop()


async def test_the_engine_core_is_spawned_with_the_cpu_environment(vllm_engine: VLLMEngine) -> None:
    # vLLM spawns its EngineCore on CPU (vllm/platforms/cpu.py), so it starts with this process's environment
    # as the engine's start left it. (Its /proc environ is no witness: setproctitle overwrites it.)
    assert vllm_engine.total_blocks > 0
    assert {k: os.environ.get(k) for k in CPU_ENGINE_ENV} == CPU_ENGINE_ENV
    assert os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"


def test_an_operators_own_value_wins_over_the_cpu_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    cpu_engine_env()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
