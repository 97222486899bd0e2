"""The frontend on a real socket, with real broker, Redis and sim workers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.harness import Harness, sse_events, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def chat(content: str = "Hello there", **kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def test_streamed_and_whole_responses_agree(h: Harness) -> None:
    await h.add_worker()
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        whole = (await c.post("/v1/chat/completions", json=chat(max_tokens=20, seed=7))).json()
        async with c.stream("POST", "/v1/chat/completions", json=chat(max_tokens=20, seed=7, stream=True)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-ferry-worker"]
            events = [e async for e in sse_events(r)]
    # data:-only, as OpenAI and vLLM send it (clients like `vllm bench serve` parse every line as data).
    assert all(i is None for i, _ in events)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_no_worker_is_503_with_retry_after(h: Harness) -> None:
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_workers"
        assert (await c.get("/ready")).status_code == 503
        assert (await c.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": "hi"}', 400, "messages"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": []}', 400, "messages"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "x"}]}', 400,
         "messages[0].role"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
         400, "max_tokens"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "n": 1000}', 400,
         "n"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
         400, "temperature"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": [{"type": "image_url", '
         b'"image_url": {"url": "http://x/y.png"}}]}]}', 400, "messages[0].content[0]"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}',
         400, "max_tokens"),
    ],
)
async def test_bad_requests_get_openai_errors(h: Harness, body: bytes, status: int, param: str | None) -> None:
    w = await h.add_worker()
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"]
    assert err["param"] == param
    # Nothing reached the worker.
    assert w.worker.metrics.prompt_tokens._value.get() == 0


async def test_body_over_limit_is_413(h: Harness) -> None:
    await h.add_worker()
    _fe, url = await h.add_frontend(max_body_bytes=1000)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat("x" * 5000))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"


async def test_prompt_over_context_is_400(h: Harness) -> None:
    await h.add_worker(max_model_len=128)
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat("word " * 400))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": list(range(200))})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt"


async def test_client_disconnect_aborts_in_engine(h: Harness) -> None:
    w = await h.add_worker(speedup=1.0)
    _fe, url = await h.add_frontend()
    engine = w.worker.engine
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        async with c.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=2000, ignore_eos=True, stream=True)
        ) as r:
            async for _id, data in sse_events(r):
                if '"content":"' in data and '"role"' not in data:
                    break  # first generated text: the engine is running it
            assert engine.stats().running == 1
        # Leaving the block closed the connection mid-stream.
    await asyncio.wait_for(w.worker.idle.wait(), 10)
    assert engine.stats().running == 0
    assert engine.stats().kv_usage == 0.0


async def test_worker_killed_mid_stream_ends_with_error_event(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    child = await worker_process("victim", kafka, redis_url, prefix, model_path, "--speedup", "1")
    try:
        _fe, url = await h.add_frontend()
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream(
                "POST", "/v1/chat/completions", json=chat(max_tokens=2000, ignore_eos=True, stream=True)
            ) as r:
                events = []
                async with asyncio.timeout(20):  # must end by itself, never hang
                    async for _id, data in sse_events(r):
                        events.append(data)
                        if len(events) == 2:
                            child.kill()
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "worker_died"
    finally:
        await child.stop()


async def test_n_choices_stop_and_usage(h: Harness) -> None:
    await h.add_worker()
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = (await c.post("/v1/chat/completions", json=chat(max_tokens=10, n=3))).json()
        texts = [ch["message"]["content"] for ch in r["choices"]]
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
        assert len(set(texts)) == 3
        assert r["usage"]["completion_tokens"] == 30
        assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 30
        # A stop string taken from a longer generation ends the text just before it.
        full = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 30,
                                                        "seed": 3})).json()["choices"][0]["text"]
        stop = full[10:14]
        cut = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 30, "seed": 3,
                                                       "stop": [stop]})).json()["choices"][0]
        assert cut["finish_reason"] == "stop"
        assert cut["text"] == full[: full.index(stop)]


async def test_a_dead_reply_consumer_fails_health_and_requests(h: Harness) -> None:
    # Nothing a frontend sends can come back once its reply consumer died: requests get 503 and /health
    # says so, for a supervisor to restart the process.
    await h.add_worker()
    fe, url = await h.add_frontend()
    consumer = fe.svc.demux._reader.consumer

    async def broken(*args: object, **kw: object) -> object:
        raise RuntimeError("injected")

    consumer.getmany = broken  # type: ignore[method-assign]
    assert fe.svc.demux._reader._task is not None
    await asyncio.wait([fe.svc.demux._reader._task], timeout=10)  # its next poll raises
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        health = await c.get("/health")
        assert health.status_code == 503
        assert "injected" in health.json()["reason"]
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=5))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "frontend_unavailable"
