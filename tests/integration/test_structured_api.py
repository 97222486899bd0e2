"""Structured outputs, the vLLM request extensions and vLLM's extra endpoints with the official `openai`
client, against a real frontend, broker, Redis and a simulated worker (which writes schema-valid output)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel

from server.model_files import ModelFiles
from tests.harness import harness

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN = "admin-key-secret"
USER = "user-key"


class Capital(BaseModel):
    city: str
    population: int
    is_capital: bool


@dataclass
class Stack:
    url: str
    keyed_url: str  # a second frontend with a user key and the admin key


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(kafka: str, redis_url: str, model_path: Path, files: ModelFiles) -> AsyncIterator[Stack]:
    # `files` first: loading it blocks the loop the worker's heartbeats run on.
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        # Slow heartbeats: on a busy machine the shared event loop may stall longer than the usual 1.5 s
        # registry TTL, and a worker that seems gone makes 503s that say nothing about these requests.
        await h.add_worker(heartbeat_interval_s=3.0)
        _fe, url = await h.add_frontend(heartbeat_interval_s=3.0)
        _fe, keyed = await h.add_frontend(api_keys=USER, admin_key=ADMIN, heartbeat_interval_s=3.0)
        yield Stack(url, keyed)


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


async def test_parse_returns_the_pydantic_object(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Capital, max_tokens=300, seed=3
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    assert done.choices[0].finish_reason == "stop"


async def test_json_schema_streams_valid_json(client: openai.AsyncOpenAI) -> None:
    schema = Capital.model_json_schema()
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}},
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), schema)


async def test_json_object_is_a_json_object(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=300, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
        {"guided_choice": ["Paris", "Lyon", "Nice"]},
    ],
)
async def test_choice_is_honoured(client: openai.AsyncOpenAI, extra: dict[str, Any]) -> None:
    done = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=20, extra_body=extra
    )
    assert done.choices[0].message.content in ("Paris", "Lyon", "Nice")


@pytest.mark.parametrize(
    "extra", [{"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, {"guided_regex": "[A-Z][a-z]{2,8}"}]
)
async def test_regex_is_honoured_on_completions_too(
    client: openai.AsyncOpenAI, extra: dict[str, Any]
) -> None:
    done = await client.completions.create(
        model=MODEL, prompt="The capital is", max_tokens=20, extra_body=extra
    )
    assert re.fullmatch("[A-Z][a-z]{2,8}", done.choices[0].text)


async def test_a_constraint_the_engine_refuses_is_a_400(client: openai.AsyncOpenAI) -> None:
    # The simulated engine writes no grammar: the worker refuses, and it is the request's fault.
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=MODEL, messages=QUESTION, extra_body={"structured_outputs": {"grammar": 'root ::= "a"'}}
        )
    assert err.value.code == "unsupported_structured_output"


async def test_min_tokens_and_logit_bias(client: openai.AsyncOpenAI, files: ModelFiles) -> None:
    done = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, seed=5, extra_body={"min_tokens": 20, "min_p": 0.05}
    )
    assert done.usage is not None and done.usage.completion_tokens >= 20
    # Every token the unbiased answer used is banned: none of them may appear again.
    plain = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, seed=9)
    used = set(files.encode(plain.choices[0].text, add_special_tokens=False))
    banned = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, seed=9, logit_bias={str(t): -100 for t in used}
    )
    assert banned.choices[0].text != plain.choices[0].text
    assert not used & set(files.encode(banned.choices[0].text, add_special_tokens=False))


async def test_continuous_usage_stats_put_usage_on_every_chunk(client: openai.AsyncOpenAI) -> None:
    # vLLM's option, unknown to the SDK's types.
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, stream=True, stream_options=options
    )
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts[0] == 0 and counts == sorted(counts)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == counts[-2]
    assert {c.usage.prompt_tokens for c in chunks if c.usage is not None} == {last.usage.prompt_tokens}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "Paris"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wrong"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ],
)
async def test_unsupported_and_invalid_fields_are_400s_naming_them(
    client: openai.AsyncOpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **fields)
    assert err.value.param == param


def _check_prompt_logprobs(got: list[Any], prompt: list[int], k: int, files: ModelFiles) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for token, entry in zip(prompt[1:], got[1:], strict=True):
        assert str(token) in entry and len(entry) in (k, k + 1), entry
        assert entry[str(token)]["decoded_token"] == files.decode([token], skip_special_tokens=False)
        assert all(e["logprob"] <= 0 and e["rank"] >= 1 for e in entry.values())


async def test_prompt_logprobs_as_vllm_shows_them(stack: Stack, files: ModelFiles) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        prompt = files.encode("The capital of France is", add_special_tokens=True)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
        done = (await c.post("/v1/completions", json=body)).json()
        _check_prompt_logprobs(done["choices"][0]["prompt_logprobs"], prompt, 2, files)
        # Chat shows them once, on the response, for the rendered prompt.
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "prompt_logprobs": 0}
        done = (await c.post("/v1/chat/completions", json=body)).json()
        rendered = files.encode(files.render_chat([dict(m) for m in QUESTION]), add_special_tokens=False)
        _check_prompt_logprobs(done["prompt_logprobs"], rendered, 0, files)
        assert "prompt_logprobs" not in done["choices"][0]
        plain = (await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})).json()
        assert "prompt_logprobs" not in plain["choices"][0]


async def test_tokenize_and_detokenize_round_trip(stack: Stack, files: ModelFiles) -> None:
    text = "The capital of France is Paris."
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        r = await c.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
        body = r.json()
        assert body["tokens"] == files.encode(text, add_special_tokens=True)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
        assert body["token_strs"][0] == files.tokenizer.id_to_token(body["tokens"][0])
        back = (await c.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})).json()
        assert back == {"prompt": files.decode(body["tokens"], skip_special_tokens=False)} == {"prompt": text}
        # Messages are counted as a chat completion counts them.
        chat = (await c.post("/tokenize", json={"messages": QUESTION})).json()
        done = (
            await c.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 1})
        ).json()
        assert chat["count"] == done["usage"]["prompt_tokens"]
        rendered = files.render_chat([dict(m) for m in QUESTION])
        assert chat["tokens"] == files.encode(rendered, add_special_tokens=False)
        bad = await c.post("/detokenize", json={"tokens": [files.vocab_size]})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
        bad = await c.post("/tokenize", json={"prompt": "x", "messages": QUESTION})
        assert bad.status_code == 400
        bad = await c.post("/tokenize", json={"prompt": "x", "model": "nope"})
        assert bad.status_code == 404
        bad = await c.post("/tokenize", json={"messages": [{"role": "user", "content": 5}]})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "messages[0].content")


async def test_version(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        r = await c.get("/version")
    assert r.status_code == 200 and re.fullmatch(r"\d+\.\d+\.\d+.*", r.json()["version"])


async def test_vllm_lora_paths_answer_like_vllm_and_need_the_admin_key(stack: Stack, tmp_path: Path) -> None:
    load = {"lora_name": "a", "lora_path": str(tmp_path)}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        # Simulated workers have no LoRA slots; the loaded path is exercised on vLLM (tests/vllm).
        r = await c.post("/v1/load_lora_adapter", json=load)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "lora_not_supported")
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "lora_not_found")
        r = await c.post("/v1/load_lora_adapter", json={**load, "load_inplace": True})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "load_inplace")
    async with httpx.AsyncClient(base_url=stack.keyed_url, timeout=30) as c:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = await c.post(path, json=load, headers={"Authorization": f"Bearer {USER}"})
            assert (r.status_code, r.json()["error"]["code"]) == (401, "insufficient_permissions")
        r = await c.post("/tokenize", json={"prompt": "x"})
        assert r.status_code == 401
        r = await c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": f"Bearer {USER}"})
        assert r.status_code == 200
