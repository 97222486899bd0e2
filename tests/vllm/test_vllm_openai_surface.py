"""The request surface real clients use, through the frontend onto real vLLM workers with the official
`openai` client: structured outputs that validate, vLLM's request extensions, /tokenize counts that match
what generation counts, and vLLM's own LoRA paths."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, Field

from schemas.settings import DEFAULT_MODEL_NAME as BASE
from tests.vllm.lora_adapter import make_adapter
from tests.vllm.stack import VllmStack

pytestmark = pytest.mark.vllm

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in JSON."}
]


class Capital(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)
    is_capital: bool


@pytest_asyncio.fixture
async def client(vllm_stack: VllmStack) -> AsyncIterator[openai.AsyncOpenAI]:
    await vllm_stack.ensure_workers()
    async with openai.AsyncOpenAI(
        base_url=f"{vllm_stack.url}/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        yield c


async def test_parse_returns_a_schema_valid_object(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.parse(
        model=BASE, messages=QUESTION, response_format=Capital, max_tokens=96, temperature=0
    )
    assert isinstance(done.choices[0].message.parsed, Capital), done.choices[0].message.content


async def test_json_schema_streamed_validates(client: openai.AsyncOpenAI) -> None:
    schema = Capital.model_json_schema()
    stream = await client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=96, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}},
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), schema)


async def test_json_object_choice_and_regex(client: openai.AsyncOpenAI) -> None:
    obj = await client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=64, temperature=0, response_format={"type": "json_object"}
    )
    # 64 tokens may cut an object short; what was written is still the start of one.
    content = obj.choices[0].message.content or ""
    assert content.lstrip().startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    choice = await client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}},
    )  # fmt: skip
    assert choice.choices[0].message.content in ("Paris", "Lyon")
    regex = await client.completions.create(
        model=BASE, prompt="The capital of France is", max_tokens=12, temperature=0,
        extra_body={"guided_regex": " [A-Z][a-z]{2,9}\\."},
    )  # fmt: skip
    assert re.fullmatch(r" [A-Z][a-z]{2,9}\.", regex.choices[0].text)


async def test_an_invalid_schema_is_refused_before_any_worker(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=BASE, messages=QUESTION,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
        )  # fmt: skip
    assert err.value.param == "response_format.json_schema.schema"


async def test_tokenize_counts_what_generation_counts(vllm_stack: VllmStack) -> None:
    async with httpx.AsyncClient(base_url=vllm_stack.url, timeout=300) as c:
        counted = (await c.post("/tokenize", json={"model": BASE, "messages": QUESTION})).json()
        done = await c.post("/v1/chat/completions", json={"model": BASE, "messages": QUESTION, "max_tokens": 1})
        assert counted["count"] == done.json()["usage"]["prompt_tokens"]
        back = (await c.post("/detokenize", json={"tokens": counted["tokens"]})).json()["prompt"]
        assert "capital of France" in back


async def test_prompt_logprobs_agree_with_the_sampled_tokens(vllm_stack: VllmStack) -> None:
    """The model's logprob of a greedy token is the same whether it was sampled or read back in the prompt."""
    async with httpx.AsyncClient(base_url=vllm_stack.url, timeout=300) as c:
        prompt = (await c.post("/tokenize", json={"model": BASE, "prompt": "The capital of France is"})).json()
        body = {"model": BASE, "prompt": prompt["tokens"], "max_tokens": 1, "temperature": 0, "logprobs": 1}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text + await vllm_stack.diagnose("vllm-1")
        said = r.json()["choices"][0]["logprobs"]
        again = {"model": BASE, "prompt": said["tokens"][0], "add_special_tokens": False}
        token = (await c.post("/tokenize", json=again)).json()["tokens"]
        assert len(token) == 1
        body = {"model": BASE, "prompt": prompt["tokens"] + token, "max_tokens": 1, "prompt_logprobs": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text + await vllm_stack.diagnose("vllm-1")
        read = r.json()["choices"][0]["prompt_logprobs"]
        assert read[0] is None and len(read) == len(prompt["tokens"]) + 1
        last = read[-1][str(token[0])]
        assert last["rank"] == 1 and last["logprob"] == pytest.approx(said["token_logprobs"][0], abs=0.05)


async def test_echo_logprobs_start_with_the_prompt(vllm_stack: VllmStack) -> None:
    """lm-evaluation-harness's loglikelihood request: with echo, the prompt's tokens lead the logprobs."""
    async with httpx.AsyncClient(base_url=vllm_stack.url, timeout=300) as c:
        text = "The capital of France is"
        ask = {"model": BASE, "prompt": text, "return_token_strs": True}
        prompt = (await c.post("/tokenize", json=ask)).json()
        n = len(prompt["tokens"])
        body = {"model": BASE, "prompt": text, "max_tokens": 2, "temperature": 0, "logprobs": 1}
        plain = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        r = await c.post("/v1/completions", json={**body, "echo": True})
        assert r.status_code == 200, r.text + await vllm_stack.diagnose("vllm-1")
        echoed = r.json()["choices"][0]
        assert "prompt_logprobs" not in echoed and echoed["text"] == text + plain["text"]
        lp = echoed["logprobs"]
        detok = [
            (await c.post("/detokenize", json={"tokens": [t]})).json()["prompt"] for t in prompt["tokens"]
        ]
        assert lp["tokens"][:n] == detok
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x <= 0 for x in lp["token_logprobs"][1:n])
        assert all(lp["top_logprobs"][i][lp["tokens"][i]] == lp["token_logprobs"][i] for i in range(1, n))
        assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
        assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=0.05)
        lengths = [len(t) for t in lp["tokens"]]
        assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
        # Streamed: the prompt and its logprobs come with the first delta.
        chunks = []
        async with c.stream("POST", "/v1/completions", json={**body, "echo": True, "stream": True}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: "))["choices"][0])
        assert chunks[0]["text"].startswith(text) and chunks[0]["logprobs"]["tokens"][:n] == detok
        assert [t for ch in chunks for t in (ch["logprobs"] or {}).get("tokens", [])] == lp["tokens"]


async def test_vllm_lora_paths_load_and_unload(vllm_stack: VllmStack, model_path: Path, tmp_path: Path) -> None:
    adapter = await asyncio.to_thread(make_adapter, model_path, tmp_path / "surface-lora")
    async with httpx.AsyncClient(base_url=vllm_stack.url, timeout=300) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "surface-lora", "lora_path": str(adapter)})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'surface-lora' added successfully.")
        assert "surface-lora" in {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
        tuned = await c.post(
            "/v1/chat/completions",
            json={"model": "surface-lora", "messages": QUESTION, "max_tokens": 4, "temperature": 0},
        )
        assert tuned.status_code == 200, tuned.text
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "surface-lora"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'surface-lora' removed successfully.")
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "surface-lora"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
