"""Malformed and hostile requests against a real frontend: each gets the right 4xx and an OpenAI error body.

One frontend and one sim worker (context 256 tokens, bodies up to 64 KiB) serve the whole table; every case
also checks that nothing reached the worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.harness import RunningWorker, harness

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 256
MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> bytes:
    """A valid chat body with `fields` replaced (a value of ... drops the field)."""
    body = {"model": MODEL, "messages": USER, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


def completion(**fields: Any) -> bytes:
    """A valid completion body with `fields` replaced (a value of ... drops the field)."""
    body = {"model": MODEL, "prompt": "Hello", **fields}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


def messages(*msgs: Any) -> bytes:
    return chat(messages=list(msgs))


# (id, path, body, status, param, code); a code of None is not checked (OpenAI's own is often null).
CASES: list[tuple[str, str, bytes, int, str | None, str | None]] = [
    # --- not JSON, or not an object
    ("truncated-json", CHAT, b'{"model": ', 400, None, "invalid_json"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json"),
    ("trailing-garbage", CHAT, chat() + b" x", 400, None, "invalid_json"),
    ("array-body", CHAT, b"[1, 2]", 400, None, "invalid_type"),
    ("null-body", CHAT, b"null", 400, None, "invalid_type"),
    (
        "invalid-utf8",
        CHAT,
        chat(messages=[{"role": "user", "content": "@@"}]).replace(b"@@", b"\xff\xfe"),
        400,
        None,
        "invalid_json",
    ),
    (
        "lone-surrogate",
        CHAT,
        chat(messages=[{"role": "user", "content": "@@"}]).replace(b"@@", b"\\ud800"),
        400,
        None,
        "invalid_json",
    ),
    # --- model
    ("model-missing", CHAT, chat(model=...), 400, "model", "missing_required_parameter"),
    ("model-wrong-type", CHAT, chat(model=7), 400, "model", "invalid_type"),
    ("model-unknown", CHAT, chat(model="gpt-9"), 404, "model", "model_not_found"),
    ("completion-model-unknown", COMPLETIONS, completion(model="gpt-9"), 404, "model", "model_not_found"),
    # --- messages
    ("messages-missing", CHAT, chat(messages=...), 400, "messages", "missing_required_parameter"),
    ("messages-wrong-type", CHAT, chat(messages="hi"), 400, "messages", "invalid_type"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages", "invalid_value"),
    ("message-not-object", CHAT, messages("hi"), 400, "messages[0]", "invalid_type"),
    ("role-missing", CHAT, messages({"content": "x"}), 400, "messages[0].role", "missing_required_parameter"),
    (
        "role-unknown",
        CHAT,
        messages({"role": "wizard", "content": "x"}),
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "role-unknown-later",
        CHAT,
        messages(USER[0], {"role": "function", "content": "x"}),
        400,
        "messages[1].role",
        "invalid_value",
    ),
    (
        "content-null",
        CHAT,
        messages({"role": "user", "content": None}),
        400,
        "messages[0].content",
        "invalid_value",
    ),
    ("content-missing", CHAT, messages({"role": "system"}), 400, "messages[0].content", "invalid_value"),
    (
        "content-wrong-type",
        CHAT,
        messages({"role": "user", "content": 5}),
        400,
        "messages[0].content",
        "invalid_type",
    ),
    (
        "content-empty-parts",
        CHAT,
        messages({"role": "user", "content": []}),
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (
        "content-part-unknown",
        CHAT,
        messages({"role": "user", "content": [{"type": "video", "video": "x"}]}),
        400,
        "messages[0].content[0].type",
        "invalid_value",
    ),
    (
        "content-part-no-text",
        CHAT,
        messages({"role": "user", "content": [{"type": "text"}]}),
        400,
        "messages[0].content[0].text",
        "missing_required_parameter",
    ),
    (
        "content-image",
        CHAT,
        messages(
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
        ),
        400,
        "messages[0].content[0]",
        "unsupported_content",
    ),
    # --- max_tokens
    ("max-tokens-negative", CHAT, chat(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max-tokens-float", CHAT, chat(max_tokens=1.5), 400, "max_tokens", "invalid_type"),
    ("max-tokens-string", CHAT, chat(max_tokens="10"), 400, "max_tokens", "invalid_type"),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**30), 400, "max_tokens", "invalid_value"),
    ("max-tokens-over-context", CHAT, chat(max_tokens=100_000), 400, "max_tokens", "context_length_exceeded"),
    (
        "max-completion-tokens-negative",
        CHAT,
        chat(max_completion_tokens=-1),
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        "completion-max-tokens-negative",
        COMPLETIONS,
        completion(max_tokens=-1),
        400,
        "max_tokens",
        "invalid_value",
    ),
    (
        "completion-max-tokens-over-context",
        COMPLETIONS,
        completion(max_tokens=CONTEXT),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    # --- n
    ("n-zero", CHAT, chat(n=0), 400, "n", "invalid_value"),
    ("n-negative", CHAT, chat(n=-3), 400, "n", "invalid_value"),
    ("n-too-many", CHAT, chat(n=129), 400, "n", "invalid_value"),
    ("n-string", CHAT, chat(n="2"), 400, "n", "invalid_type"),
    ("completion-n-huge", COMPLETIONS, completion(n=2**70), 400, "n", "invalid_value"),
    # --- other sampling fields
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature", "invalid_type"),
    ("temperature-too-high", CHAT, chat(temperature=2.5), 400, "temperature", "invalid_value"),
    (
        "temperature-overflow",
        CHAT,
        chat(temperature=1).replace(b'"temperature": 1', b'"temperature": 1e999'),
        400,
        "temperature",
        "invalid_value",
    ),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", "invalid_value"),
    ("presence-penalty-high", CHAT, chat(presence_penalty=3), 400, "presence_penalty", "invalid_value"),
    ("top-k-negative", CHAT, chat(top_k=-5), 400, "top_k", "invalid_value"),
    ("seed-over-int64", CHAT, chat(seed=2**64), 400, "seed", "invalid_value"),
    ("priority-huge", CHAT, chat(priority=-(2**40)), 400, "priority", "invalid_value"),
    ("stop-empty", CHAT, chat(stop=""), 400, "stop", "invalid_value"),
    ("stop-wrong-type", CHAT, chat(stop=[1]), 400, "stop[0]", "invalid_type"),
    ("stop-token-negative", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids[0]", "invalid_value"),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream", "invalid_type"),
    (
        "stream-options-without-stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "invalid_value",
    ),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    (
        "top-logprobs-too-many",
        CHAT,
        chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        "invalid_value",
    ),
    # --- completion prompts
    ("prompt-missing", COMPLETIONS, completion(prompt=...), 400, "prompt", "missing_required_parameter"),
    ("prompt-wrong-type", COMPLETIONS, completion(prompt={"text": "x"}), 400, "prompt", "invalid_type"),
    ("prompt-empty-list", COMPLETIONS, completion(prompt=[]), 400, "prompt", "invalid_value"),
    ("prompt-empty-ids", COMPLETIONS, completion(prompt=[[]]), 400, "prompt", "invalid_value"),
    ("prompt-mixed", COMPLETIONS, completion(prompt=["a", 1]), 400, "prompt", "invalid_type"),
    ("prompt-negative-id", COMPLETIONS, completion(prompt=[-1]), 400, "prompt[0]", "invalid_value"),
    ("prompt-id-beyond-vocab", COMPLETIONS, completion(prompt=[10**6]), 400, "prompt", "invalid_value"),
    ("completion-logprobs-too-many", COMPLETIONS, completion(logprobs=21), 400, "logprobs", "invalid_value"),
    ("completion-suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix", None),
    (
        "completion-stream-options-without-stream",
        COMPLETIONS,
        completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "invalid_value",
    ),
    # --- sizes
    (
        "chat-over-context",
        CHAT,
        messages({"role": "user", "content": "word " * 400}),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "prompt-over-context",
        COMPLETIONS,
        completion(prompt=list(range(CONTEXT + 10))),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "body-over-limit",
        CHAT,
        messages({"role": "user", "content": "x" * MAX_BODY}),
        413,
        None,
        "body_too_large",
    ),
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(kafka: str, redis_url: str, model_path: Path) -> AsyncIterator[tuple[str, RunningWorker]]:
    """One frontend and one sim worker for the whole table (a module-wide Redis prefix of their own)."""
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        # Slow heartbeats: a busy machine may stall the shared event loop past the usual 1.5 s registry TTL,
        # and a worker that seems gone turns the context-length cases into 503s.
        worker = await h.add_worker(max_model_len=CONTEXT, heartbeat_interval_s=3.0)
        _fe, url = await h.add_frontend(max_body_bytes=MAX_BODY, heartbeat_interval_s=3.0)
        yield url, worker


def assert_openai_error(
    r: httpx.Response, status: int, param: str | None, code: str | None
) -> dict[str, Any]:
    """The response is `status` with a complete OpenAI error body; returns the error."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["error"]
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_request_gets_openai_error(
    served: tuple[str, RunningWorker],
    path: str,
    body: bytes,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    url, worker = served
    seen = worker.worker.metrics.prompt_tokens._value.get()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, status, param, code)
    assert worker.worker.metrics.prompt_tokens._value.get() == seen, "a bad request reached the worker"


async def test_wrong_method_and_unknown_path(served: tuple[str, RunningWorker]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert_openai_error(await c.get(CHAT), 405, None, "method_not_allowed")
        assert_openai_error(await c.post("/v1/embeddings", content=chat()), 404, None, "not_found")


async def test_table_stack_serves_a_good_request(served: tuple[str, RunningWorker]) -> None:
    # The same frontend answers a valid request, so the 4xx above are about the input, not a broken stack.
    url, worker = served
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post(CHAT, content=chat(max_tokens=5))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        r = await c.post(COMPLETIONS, content=completion(prompt=[[1, 2], [3]], max_tokens=3))
        assert r.status_code == 200, r.text
    assert worker.worker.metrics.prompt_tokens._value.get() > 0


async def test_chunked_body_over_limit_without_content_length(served: tuple[str, RunningWorker]) -> None:
    # No Content-Length to refuse up front: the limit holds while the body is read.
    url, worker = served
    seen = worker.worker.metrics.prompt_tokens._value.get()
    body = messages({"role": "user", "content": "x" * MAX_BODY})

    async def parts() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post(CHAT, content=parts(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, None, "body_too_large")
    assert worker.worker.metrics.prompt_tokens._value.get() == seen
