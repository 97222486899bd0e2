"""A request that kills the engine running it (a poison request) takes two workers down, not every one it is moved
to: after its second engine death in an attempt that produced nothing its sequence ends with an error. A sequence
that was generating when its engine died is a bystander: its worker's last word moves it at once, and it finishes
elsewhere however many engines die under it. A batch item that kills engines ends with an error the same way,
instead of taking the pool's workers down one after another."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from schemas.kafka import GenerateRequest
from server.frontend import Frontend
from tests.harness import Harness, RunningWorker, sse_events, until
from tests.integration.test_batch_api import chat_line, final_batch, jsonl, model_name
from workers.sim import SimEngine

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
POISON_SEED = 666
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about ferries. " * 10}],
    "max_tokens": 60,
    "ignore_eos": True,
    "seed": 3,
}


def _is_poison(request: GenerateRequest) -> bool:
    return request.sampling.seed == POISON_SEED


async def _fleet(h: Harness, n: int, **overrides: object) -> tuple[list[RunningWorker], Frontend, str]:
    # Slow heartbeats: the workers' own last words, not the registry, must be what moves the sequences.
    workers = [await h.add_worker(canary_wait_s=0, heartbeat_interval_s=2.0, **overrides) for _ in range(n)]
    for w in workers:
        assert isinstance(w.worker.engine, SimEngine)
        w.worker.engine.poison = _is_poison
    fe, url = await h.add_frontend(migration_limit=3)

    async def sees_all() -> bool:
        await fe.svc.pool.refresh()
        return len(fe.svc.pool.workers) == n

    await until(sees_all, 10)
    return workers, fe, url


async def test_a_poison_request_ends_with_an_error_after_two_engines_died(h: Harness) -> None:
    workers, fe, url = await _fleet(h, 3)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json={**BODY, "seed": POISON_SEED})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "repeated_engine_death", error
        assert "may be what kills them" in error["message"]
        await until(lambda: _exited(workers, 2), 30)
        (survivor,) = [w for w in workers if not w.task.done()]
        assert all(w.task.result() == 1 for w in workers if w is not survivor)
        assert fe.metrics.migrations.labels("engine_died", "moved")._value.get() == 1
        assert fe.metrics.migrations.labels("engine_died", "failed")._value.get() == 1
        # The last worker serves on.
        r = await c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert r.headers["x-ferry-worker"] == survivor.worker.settings.worker_id


async def test_a_sequence_generating_when_its_engines_die_moves_at_once_and_finishes(h: Harness) -> None:
    # Speed 1 (real-time steps), so the stream is still running when its engines die.
    workers, fe, url = await _fleet(h, 3, speedup=1.0)
    crashed: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            async with asyncio.timeout(30):
                async for e in sse_events(r):
                    events.append(e)
                    if len(events) in (3, 15):
                        # The engine running the sequence dies between two of its tokens.
                        (running,) = [w for w in workers if len(w.worker.serving)]
                        assert isinstance(running.worker.engine, SimEngine)
                        running.worker.engine.crash = True
                        crashed.append(running.worker.settings.worker_id)
    assert not any('"error"' in d for _, d in events), events[-3:]
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert len(set(crashed)) == 2
    # Moved by the workers' last words, each time before the registry could have said anything.
    assert fe.metrics.migrations.labels("engine_died", "moved")._value.get() == 2
    assert fe.metrics.migrations.labels("worker_died", "moved")._value.get() == 0
    await until(lambda: _exited(workers, 2), 30)


async def _exited(workers: list[RunningWorker], n: int) -> bool:
    return sum(w.task.done() for w in workers) == n


async def test_a_batch_item_that_kills_engines_ends_with_an_error_and_the_batch_completes(
    h: Harness, tmp_path: Path
) -> None:
    model = model_name()
    workers = []
    for _ in range(3):
        w = await h.add_worker(pool=True, served_model_name=model, speedup=200.0, canary_wait_s=0)
        assert isinstance(w.worker.engine, SimEngine)
        w.worker.engine.poison = _is_poison
        workers.append(w)
    _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    lines = [chat_line(f"req-{i}", model, f"Question number {i}?") for i in range(4)]
    lines.append(chat_line("poison", model, "Say anything.", seed=POISON_SEED))
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = await final_batch(client, batch.id, 120)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 1), done.request_counts
    errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["poison"]
    assert errors[0]["response"]["status_code"] == 500
    assert errors[0]["response"]["body"]["error"]["code"] == "repeated_engine_death"
    await until(lambda: _exited(workers, 2), 30)  # (the second may still be closing its clients)
    (survivor,) = [w for w in workers if not w.task.done()]
    assert survivor.worker.pool is not None
    assert survivor.worker.pool.metrics.items.labels("refused")._value.get() == 1
