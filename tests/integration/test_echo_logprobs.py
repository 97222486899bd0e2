"""`echo` with `logprobs` on /v1/completions (lm-evaluation-harness's loglikelihood), against a real frontend,
broker, Redis and a simulated worker: the prompt's tokens come first in each choice's logprobs, as vLLM
shows them, streamed or not, for several prompts and n > 1."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from server.model_files import ModelFiles
from tests.harness import harness, sse_events

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is", "Once upon a time, there"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def url(kafka: str, redis_url: str, model_path: Path, files: ModelFiles) -> AsyncIterator[str]:
    # `files` first: loading it blocks the loop the worker's heartbeats run on.
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        await h.add_worker(heartbeat_interval_s=3.0)
        _fe, base = await h.add_frontend(heartbeat_interval_s=3.0)
        yield base


@pytest_asyncio.fixture(loop_scope="session")
async def client(url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def check_echoed(lp: Any, text: str, prompt: list[int], prompt_text: str, files: ModelFiles, k: int) -> int:
    """One echoed choice as vLLM shows it; returns how many of its tokens are the prompt's."""
    n = len(prompt)
    assert lp.tokens[:n] == [files.decode([t], skip_special_tokens=False) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    for tok, own, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        # The token itself, whatever its rank, and the k best.
        assert top[tok] == own and len(top) in (k, k + 1), top
    assert text.startswith(prompt_text)
    # Offsets advance by each token's text from the start of the echo, and point at the tokens in it.
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert all(text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens, strict=True))
    return n


async def test_echoed_prompt_logprobs_whole(client: openai.AsyncOpenAI, files: ModelFiles) -> None:
    prompts = [files.encode(t, add_special_tokens=True) for t in TEXTS]
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "n": 2, "seed": 7, "logprobs": 2}
    # Text prompts and token-id prompts (what lm-evaluation-harness sends) alike.
    for prompt in (TEXTS, prompts):
        echoed = await client.completions.create(prompt=prompt, echo=True, **common)
        plain = await client.completions.create(prompt=prompt, **common)
        assert len(echoed.choices) == 4
        for e, p in zip(echoed.choices, plain.choices, strict=True):
            i = e.index // 2
            assert e.logprobs is not None and p.logprobs is not None
            n = check_echoed(e.logprobs, e.text, prompts[i], TEXTS[i], files, 2)
            # The output's part is what the same request without echo returns.
            assert e.text == TEXTS[i] + p.text
            assert e.logprobs.tokens[n:] == p.logprobs.tokens
            assert e.logprobs.token_logprobs[n:] == p.logprobs.token_logprobs
            assert e.logprobs.top_logprobs[n:] == p.logprobs.top_logprobs
            assert [
                o - e.logprobs.text_offset[n] for o in e.logprobs.text_offset[n:]
            ] == p.logprobs.text_offset
            # Computed for the echo, not asked for: no `prompt_logprobs` field.
            assert "prompt_logprobs" not in (e.model_extra or {})


async def test_lm_eval_loglikelihood_request(client: openai.AsyncOpenAI, files: ModelFiles) -> None:
    # What lm-evaluation-harness's local-completions sends; it reads token_logprobs[len(context):-1].
    context = files.encode(TEXTS[0], add_special_tokens=True)
    whole = context + files.encode(" Paris", add_special_tokens=False)
    done = await client.completions.create(
        model=MODEL, prompt=[whole], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == len(whole) + 1
    assert all(isinstance(x, float) for x in lp.token_logprobs[len(context) : -1])
    # Asked for as well: then `prompt_logprobs` shows too, with its own count of alternatives.
    both = await client.completions.create(
        model=MODEL, prompt=[whole], echo=True, logprobs=1, max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    shown = (both.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(shown) == len(whole) and shown[0] is None


async def test_echoed_prompt_logprobs_streamed(client: openai.AsyncOpenAI, files: ModelFiles) -> None:
    prompts = [files.encode(t, add_special_tokens=True) for t in TEXTS]
    common: dict[str, Any] = {
        "model": MODEL,
        "prompt": TEXTS,
        "max_tokens": 6,
        "n": 2,
        "seed": 3,
        "logprobs": 1,
    }
    whole = await client.completions.create(echo=True, **common)
    stream = await client.completions.create(echo=True, stream=True, **common)
    texts: dict[int, str] = {}
    lps: dict[int, dict[str, list[Any]]] = {}
    async for chunk in stream:
        for c in chunk.choices:
            if c.index not in texts:
                # The prompt goes with the choice's first delta, its logprobs first.
                i = c.index // 2
                assert c.text.startswith(TEXTS[i]) and c.logprobs is not None
                assert c.logprobs.token_logprobs is not None and c.logprobs.token_logprobs[0] is None
                assert c.logprobs.text_offset is not None and c.logprobs.text_offset[0] == 0
            texts[c.index] = texts.get(c.index, "") + c.text
            for k, v in (c.logprobs.model_dump() if c.logprobs else {}).items():
                lps.setdefault(c.index, {}).setdefault(k, []).extend(v or [])
    assert sorted(texts) == [0, 1, 2, 3]
    for w in whole.choices:
        assert w.logprobs is not None
        assert texts[w.index] == w.text
        assert lps[w.index] == w.logprobs.model_dump()
        check_echoed(w.logprobs, w.text, prompts[w.index // 2], TEXTS[w.index // 2], files, 1)


async def test_resumed_echo_stream_replays_the_same_logprobs(url: str) -> None:
    body = {"model": MODEL, "prompt": TEXTS, "max_tokens": 5, "n": 2, "seed": 1, "stream": True,
            "echo": True, "logprobs": 1}  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/completions", json=body, headers={"x-ferry-resumable": "1"}) as r:
            rid = r.headers["x-request-id"]
            original = [e async for e in sse_events(r)]
        async with c.stream("GET", f"/v1/completions/{rid}/stream") as r:
            replayed = [e async for e in sse_events(r)]
    assert replayed == original
    firsts = [json.loads(d)["choices"][0] for _, d in original[:-1]]
    assert any(c["logprobs"]["token_logprobs"][0] is None for c in firsts)


async def test_refusals_stay_as_vllms(client: openai.AsyncOpenAI) -> None:
    # Explicit prompt_logprobs still cannot stream; echo with logprobs can (above).
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(
            model=MODEL, prompt="x", stream=True, echo=True, logprobs=1, extra_body={"prompt_logprobs": 1}
        )
    assert err.value.param == "prompt_logprobs"


async def test_batch_line_answers_as_the_route(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    # A batch item's output line is the body the interactive route returns (the sim engine is deterministic).
    model = f"m-{uuid.uuid4().hex[:8]}"
    body: dict[str, Any] = {"model": model, "prompt": TEXTS, "max_tokens": 3, "n": 2, "seed": 4}
    body.update(echo=True, logprobs=2)
    line = {"custom_id": "echo", "method": "POST", "url": "/v1/completions", "body": body}
    async with harness(kafka, redis_url, prefix, model_path) as h:
        await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        _, base = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            f = await client.files.create(
                file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch"
            )
            batch = await client.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
            for _ in range(1200):
                done = await client.batches.retrieve(batch.id)
                if done.status in ("completed", "failed", "expired", "cancelled"):
                    break
                await asyncio.sleep(0.05)  # poll period: the Batches API has nothing to wait on
            assert done.status == "completed" and done.output_file_id, done
            out = json.loads((await client.files.content(done.output_file_id)).text)
            interactive = await client.completions.create(**body)
    choices = out["response"]["body"]["choices"]
    assert [(c["text"], c["logprobs"]) for c in choices] == [
        (c.text, c.logprobs.model_dump() if c.logprobs else None) for c in interactive.choices
    ]
    assert choices[0]["logprobs"]["token_logprobs"][0] is None
    assert all("prompt_logprobs" not in c for c in choices)
