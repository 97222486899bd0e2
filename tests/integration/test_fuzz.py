"""Schemathesis fuzzes a real frontend (with a real broker, Redis and a sim worker) from its own OpenAPI document.

Valid and invalid bodies generated from `GET /openapi.json` must never get a 5xx. The run is bounded in
examples per operation and in time, and seeded so a failure reproduces.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.harness import harness

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
EXAMPLES = 25
SEED = 20260501
TIME_BUDGET_S = 30


async def test_openapi_document_describes_the_api(kafka: str, redis_url: str, model_path: Path) -> None:
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        _fe, url = await h.add_frontend()
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            doc = (await c.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    # Generated from the Structs: the bounds the decoder enforces are the ones published.
    assert chat["properties"]["n"]["maximum"] == 128
    assert {"type": "string", "enum": [MODEL]} in chat["properties"]["model"]["anyOf"]
    assert "ErrorResponse" in schemas and "security" not in doc


async def test_schemathesis_finds_no_server_error(kafka: str, redis_url: str, model_path: Path) -> None:
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        # A short context keeps every generated request cheap to serve, whatever max_tokens and n say.
        # Slow heartbeats: on a busy machine the shared event loop may stall longer than the test's usual
        # 1.5 s registry TTL, and a worker that seems gone makes 503s that say nothing about the input.
        await h.add_worker(max_model_len=128, speedup=1000.0, heartbeat_interval_s=3.0)
        _fe, url = await h.add_frontend(max_body_bytes=256 * 1024, heartbeat_interval_s=3.0, batch_api=True)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            f"{url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            str(EXAMPLES),
            "--seed",
            str(SEED),
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--generation-database",
            "none",
            "--max-time",
            str(TIME_BUDGET_S),
            "--no-color",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(TIME_BUDGET_S + 120):
                out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    report = out.decode(errors="replace")
    assert proc.returncode == 0, report
    # It really ran: every operation was exercised.
    assert "/v1/chat/completions" in report and "/v1/completions" in report, report
