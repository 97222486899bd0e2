"""API keys, the admin key and private prompts, against a real frontend (real broker, Redis and sim worker).

With keys configured every route needs `Authorization: Bearer <key>` except health, readiness, metrics
and the OpenAPI document; `/v1/admin/*` needs the admin key. The middleware answers before routing, so an
admin path is refused or let through whatever admin routes exist. Prompts reach the log only with
`--log-prompts`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from launch.services import Child, free_port
from tests.harness import RunningWorker, harness, sse_events

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("user-key-one", "user-key-two")
ADMIN = "admin-key-secret"
CHAT = "/v1/chat/completions"
ADMIN_PATH = "/v1/admin/loras"


def chat(content: str = "Hello", **kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(r: httpx.Response, code: str | None) -> None:
    """A 401 with a complete OpenAI error body and the given `code`."""
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code
    assert ADMIN not in err["message"] and all(k not in err["message"] for k in KEYS)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(kafka: str, redis_url: str, model_path: Path) -> AsyncIterator[tuple[str, RunningWorker]]:
    """A frontend with two user keys and an admin key, and one sim worker."""
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        worker = await h.add_worker()
        _fe, url = await h.add_frontend(api_keys=" , ".join(KEYS) + ",", admin_key=ADMIN)
        yield url, worker


def prompts_seen(worker: RunningWorker) -> float:
    return float(worker.worker.metrics.prompt_tokens._value.get())


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, None),  # OpenAI's code for a missing key is null
        (bearer("not-a-key"), "invalid_api_key"),
        (bearer(KEYS[0] + "x"), "invalid_api_key"),
        ({"Authorization": f"Basic {KEYS[0]}"}, None),  # not a bearer token: no key given
        ({"Authorization": "Bearer"}, None),
        ({"X-Api-Key": KEYS[0]}, None),
    ],
    ids=["missing", "unknown", "prefix-of-a-key", "basic-scheme", "empty-bearer", "other-header"],
)
async def test_api_routes_refuse_without_a_right_key(
    keyed: tuple[str, RunningWorker], headers: dict[str, str], code: str | None
) -> None:
    url, worker = keyed
    seen = prompts_seen(worker)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert_401(await c.post(CHAT, json=chat(), headers=headers), code)
        assert_401(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers), code
        )
        assert_401(await c.get("/v1/models", headers=headers), code)
        # Unknown paths are closed too: nothing tells a caller without a key which routes exist.
        assert_401(await c.get("/v1/embeddings", headers=headers), code)
    assert prompts_seen(worker) == seen, "a refused request reached the worker"


@pytest.mark.parametrize("key", [*KEYS, ADMIN], ids=["first-key", "second-key", "admin-key"])
async def test_a_right_key_is_served(keyed: tuple[str, RunningWorker], key: str) -> None:
    url, _ = keyed
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(key)) as c:
        r = await c.post(CHAT, json=chat())
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        async with c.stream("POST", CHAT, json=chat(stream=True)) as s:
            assert s.status_code == 200
            events = [d async for _, d in sse_events(s)]
        assert events[-1] == "[DONE]"
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == MODEL
        lower = await c.get("/v1/models", headers={"Authorization": f"bearer {key}"})
        assert lower.status_code == 200  # the scheme is case-insensitive (RFC 7235)


async def test_operational_routes_stay_open(keyed: tuple[str, RunningWorker]) -> None:
    url, _ = keyed
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).status_code == 200
        assert (await c.get("/metrics")).text.startswith("# HELP")
        doc = (await c.get("/openapi.json")).json()
        assert doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


async def test_admin_routes_need_the_admin_key(keyed: tuple[str, RunningWorker]) -> None:
    url, _ = keyed
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for path in (ADMIN_PATH, "/v1/admin", "/v1/admin/anything/else"):
            assert_401(await c.get(path), None)
            assert_401(await c.get(path, headers=bearer("not-a-key")), "invalid_api_key")
            # A user key is a valid key, but not enough.
            assert_401(await c.get(path, headers=bearer(KEYS[0])), "insufficient_permissions")
            assert_401(await c.post(path, json={}, headers=bearer(KEYS[1])), "insufficient_permissions")
            # The admin key gets past the middleware; what answers then is the route (or its absence).
            r = await c.get(path, headers=bearer(ADMIN))
            assert r.status_code != 401, r.text
        # A look-alike path is not an admin path, and a user key serves it.
        assert (await c.get("/v1/administrator", headers=bearer(KEYS[0]))).status_code == 404


async def test_admin_key_alone_guards_only_admin_routes(kafka: str, redis_url: str, model_path: Path) -> None:
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        await h.add_worker()
        _fe, url = await h.add_frontend(admin_key=ADMIN)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await c.post(CHAT, json=chat())).status_code == 200
            assert_401(await c.get(ADMIN_PATH), None)
            assert (await c.get(ADMIN_PATH, headers=bearer(ADMIN))).status_code != 401


async def test_no_keys_means_open(kafka: str, redis_url: str, model_path: Path) -> None:
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        await h.add_worker()
        _fe, url = await h.add_frontend()
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await c.post(CHAT, json=chat(), headers=bearer("anything"))).status_code == 200
            assert "security" not in (await c.get("/openapi.json")).json()


# ---- prompts in logs -------------------------------------------------------------------------------

SECRET = "zebra-quartz-7781 my account number is 4242"


def logged_text(records: list[logging.LogRecord]) -> str:
    """Everything the records would write: messages, arguments and tracebacks."""
    parts = []
    for r in records:
        parts.append(r.getMessage())
        if r.exc_text:
            parts.append(r.exc_text)
    return "\n".join(parts)


@pytest.mark.parametrize("log_prompts", [False, True], ids=["default", "log-prompts"])
async def test_prompts_reach_the_log_only_when_asked(
    kafka: str, redis_url: str, model_path: Path, caplog: pytest.LogCaptureFixture, log_prompts: bool
) -> None:
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        await h.add_worker()
        _fe, url = await h.add_frontend(log_prompts=log_prompts)
        # Every logger of the process (frontend, worker, libraries), at every level.
        caplog.set_level(logging.DEBUG)
        caplog.set_level(logging.DEBUG, logger="ferry")
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post(CHAT, json=chat(SECRET))
            assert r.status_code == 200, r.text
            async with c.stream("POST", CHAT, json=chat(SECRET, stream=True)) as s:
                assert [d async for _, d in sse_events(s)][-1] == "[DONE]"
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": SECRET, "max_tokens": 2})
            assert r.status_code == 200, r.text
            # A refused request (over the context length) must not leak its prompt either.
            r = await c.post(CHAT, json=chat(SECRET * 2000))
            assert r.status_code == 400
    text = logged_text(caplog.records)
    assert caplog.records, "nothing was captured: the check below would prove nothing"
    assert (SECRET in text) is log_prompts, text[-2000:] if log_prompts else "a prompt was logged"


# ---- `ferry up` passes keys to its frontend ---------------------------------------------------------


async def test_ferry_up_passes_keys_to_the_frontend(model_path: Path) -> None:
    port = free_port()
    env: dict[str, Any] = {"FERRY_API_KEYS": KEYS[0], "FERRY_ADMIN_KEY": ADMIN}
    child = await Child.spawn(
        "ferry-up",
        [
            sys.executable,
            "-m",
            "launch",
            "up",
            "--workers",
            "1",
            "--port",
            str(port),
            "--speedup",
            "50",
            "--model-path",
            str(model_path),
            "--log-level",
            "info",
        ],
        echo=bool(os.environ.get("FERRY_TEST_ECHO")),
        env=env,
    )
    try:
        ready = await child.wait_for_line(lambda line: line.startswith("ferry-ready "), 120)
        url = ready.split()[1]
        # The printed example works as shown once the key is filled in, and does not print the key.
        assert not any(k in line for line in child.tail for k in (*KEYS, ADMIN))
        assert any("Authorization: Bearer" in line for line in child.tail)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert_401(await c.post(CHAT, json=chat()), None)
            r = await c.post(CHAT, json=chat(), headers=bearer(KEYS[0]))
            assert r.status_code == 200, r.text
            assert json.loads(r.text)["usage"]["completion_tokens"] == 4
            assert_401(await c.get(ADMIN_PATH, headers=bearer(KEYS[0])), "insufficient_permissions")
    finally:
        child.proc.send_signal(2)  # SIGINT, what Ctrl-C sends: the stack stops in order
        assert await child.stop(30) == 0
