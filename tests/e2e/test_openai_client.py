"""The whole system as a user meets it: `ferry up` with two sim workers, the official openai client."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam

from launch.services import Child

pytestmark = pytest.mark.e2e

T = TypeVar("T")

MODEL = "SmolLM2-135M-Instruct"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(scope="module")
async def stack(model_path: Path) -> AsyncIterator[str]:
    """`ferry up` on a free port; yields the base URL once it printed its ready line."""
    child = await Child.spawn(
        "ferry-up",
        [sys.executable, "-m", "launch", "up", "--port", "0", "--workers", "2", "--speedup", "20",
         "--model-path", str(model_path), "--heartbeat-interval-s", "0.5"],
        echo=False,
    )
    line = await child.wait_for_line(lambda ln: ln.startswith("ferry-ready "), 120)
    yield line.split()[1]
    assert await child.stop(30) == 0, "\n".join(child.tail)


@pytest_asyncio.fixture
async def client(stack: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


async def _all(stream: AsyncIterator[T]) -> list[T]:
    return [x async for x in stream]


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, stream=True, max_tokens=12, stream_options={"include_usage": True}
    )
    chunks = await _all(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_whole_matches_stream_and_n(client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=15, seed=11)
    streamed = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=15, seed=11, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in await _all(streamed) if c.choices)
    assert whole.choices[0].message.content == text
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    many = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage is not None and many.usage.completion_tokens == 18


async def test_stop_and_max_tokens(client: openai.AsyncOpenAI) -> None:
    full = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, seed=5)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage and full.usage.completion_tokens == 40
    stop = text[12:16]
    cut = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, seed=5, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


async def test_completions_stream_and_token_prompt(client: openai.AsyncOpenAI) -> None:
    chunks = await _all(await client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    batch = await client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]


async def test_errors(client: openai.AsyncOpenAI, stack: str) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature="hot")  # type: ignore[call-overload]
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 9000}])
    assert long.value.code == "context_length_exceeded"
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{stack}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_metrics_and_ready(stack: str) -> None:
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{stack}/ready")).json()["ready"] is True
        text = (await http.get(f"{stack}/metrics")).text
    assert "ferry_time_to_first_token_seconds_bucket" in text
    itl = next(ln for ln in text.splitlines() if ln.startswith("ferry_inter_token_latency_seconds_count"))
    assert float(itl.split()[-1]) > 0
    assert 'ferry_requests_total{endpoint="chat",status="200"}' in text


async def test_logprobs(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    text = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=1)
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
