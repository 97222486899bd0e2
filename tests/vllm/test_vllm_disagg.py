"""Disaggregated prefill and decode with the real engine, through the two KV connectors that run on vLLM's CPU
build (docs/architecture.md, "KV tiers"): the example shared-storage one carries the prompt's KV through files
it finds by the prompt's tokens; NIXL pulls it from the prefill engine's memory, told where by the descriptor
the prefill engine wrote, which Ferry carries in the release. Ferry's part is otherwise the same as with the
simulated engine: the placement, the prefill-only attempt, the release, the parked decode attempt."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from launch.services import Child, free_port
from schemas.kafka import KVFrom, SamplingParams
from schemas.settings import DEFAULT_MODEL_NAME as MODEL
from tests.harness import harness, sse_events
from tests.integration.test_worker import Client
from workers.model_dir import load_model_info

pytestmark = pytest.mark.vllm

PROMPT = "Ferries cross the harbour every morning and carry commuters to the city. " * 12


def connector_config(kind: str, role: str, store: Path) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for a `role` worker's engine with connector `kind`."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if kind == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
    return {"kv_connector": "ExampleConnector", "kv_role": kv_role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}  # fmt: skip


async def worker(wid: str, role: str, kind: str, store: Path, kafka: str, redis_url: str, prefix: str,
                 model_path: Path) -> tuple[Child, str]:  # fmt: skip
    """A vLLM worker process of `role`, its engine's connector of `kind`; heartbeats 4 s apart (dead after
    12 s): two engines prefilling beside the session's other workers starve a worker's loop of the two cores
    for longer than the shared stack's 1.5 s. With the URL of its /metrics."""
    connector = connector_config(kind, role, store)
    port = free_port()
    argv = [sys.executable, "-m", "launch", "worker", "--engine", "vllm", "--role", role, "--worker-id", wid,
            "--block-size", "32", "--kafka", kafka, "--redis", redis_url, "--redis-prefix", prefix,
            "--model-path", str(model_path), "--kv-cache-gib", "0.25", "--heartbeat-interval-s", "4",
            "--max-loras", "0", "--log-level", "warning", "--metrics-port", str(port), "--", "--kv-transfer-config", json.dumps(connector)]  # fmt: skip
    child = await Child.spawn(wid, argv, echo=False)
    await child.wait_for_line(lambda line: line.startswith("ferry-worker-ready"), 240)
    return child, f"http://127.0.0.1:{port}/metrics"


async def connector_hits(metrics_url: str) -> float:
    """Prompt tokens the worker's engine loaded through its KV connector (vLLM's own counter)."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(metrics_url)).text
    name = "vllm:external_prefix_cache_hits_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def read(url: str, body: dict[str, Any]) -> tuple[httpx.Headers, str, dict[str, Any]]:
    """One streamed completion: its headers, its text and its usage."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        events = [json.loads(d) async for _, d in sse_events(r) if d != "[DONE]"]
    assert not any("error" in e for e in events), events[-2:]
    text = "".join(ch["text"] for e in events for ch in e.get("choices", []))
    return r.headers, text, events[-1]["usage"]


async def direct(kafka: str, worker_id: str, prompt: list[int], kv_from: KVFrom | None) -> tuple[str, str | None]:
    """Greedy 8 tokens of `prompt` from one worker, sent straight to its topic (as a frontend would, without the
    hand-off around it); its text and finish reason."""
    client = Client(kafka)
    await client.start()
    try:
        req = client.request(prompt, 8, sampling=SamplingParams(temperature=0.0), kv_from=kv_from)
        await client.send(worker_id, req)
        # NIXL's handshake with nobody times out well within the wait.
        chunks = (await client.until_finished({req.request_id}, wait_s=120))[req.request_id]
    finally:
        await client.stop()
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


@pytest.mark.parametrize("kind", ["example", "nixl"])
async def test_a_prompt_prefilled_on_one_vllm_engine_is_decoded_on_another_from_its_kv(
    kind: str, kafka: str, redis_url: str, model_path: Path, tmp_path: Path
) -> None:
    prefix = f"pd{uuid.uuid4().hex[:8]}:"
    async with harness(kafka, redis_url, prefix, model_path) as h:
        args = (tmp_path, kafka, redis_url, prefix, model_path)
        (_, _), (_, decode_metrics) = started = await asyncio.gather(
            worker("pd-prefill", "prefill", kind, *args),
            worker("pd-decode", "decode", kind, *args),
        )
        children = [child for child, _ in started]
        try:
            _, url = await h.add_frontend()
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            headers, text, usage = await read(url, body)
            assert headers["x-ferry-disagg"] == "remote"
            assert (headers["x-ferry-worker"], headers["x-ferry-decode-worker"]) == (
                "pd-prefill",
                "pd-decode",
            )
            assert usage["completion_tokens"] == 12
            # The prefill worker's engine wrote (or kept) the prompt's KV; the decode worker's loaded it through
            # its connector instead of computing it, up to its last whole block. NIXL loads nothing without the
            # prefill engine's descriptor, which only the release carries.
            assert await connector_hits(decode_metrics) >= usage["prompt_tokens"] - 32
            if kind == "example":
                assert await asyncio.to_thread(lambda: any(tmp_path.iterdir()))
                # vLLM counts what this connector loads (synchronously) as cached; NIXL's asynchronous
                # load comes after the count, as with vLLM's own server.
                assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 32
            # The same text as one engine computing it all: greedy decoding from the same KV.
            _, local_url = await h.add_frontend(disagg_min_uncached_tokens=1_000_000)
            local_headers, reference, _ = await read(local_url, {**body, "prompt": PROMPT})
            assert local_headers["x-ferry-disagg"] == "local"
            assert text == reference
            # Prompts vLLM's own example connector answers with a negative cache hit, killing its engine (the
            # second of each, once the first was stored): one token (as the canary's), and a block and one.
            for prompt in ([0], [0], list(range(1, 34)), list(range(1, 34))):
                await read(local_url, {**body, "prompt": prompt, "max_tokens": 2})
            if kind == "nixl":
                # A prefill worker lost after its release: the descriptor names an engine nobody answers for. vLLM
                # alone would fail the request; Ferry's decode engine computes the prompt itself (after NIXL's
                # handshake times out) and says the same as without a descriptor.
                prompt_ids = load_model_info(model_path).tokenizer.encode(PROMPT).ids
                gone = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3, 4, 5, 6]],
                        "remote_engine_id": "gone", "remote_request_id": "gone-1", "remote_host": "127.0.0.1",
                        "remote_port": free_port(), "tp_size": 1, "remote_num_tokens": len(prompt_ids)}  # fmt: skip
                lost = await direct(kafka, "pd-decode", prompt_ids, KVFrom("gone", len(prompt_ids), gone))
                assert lost == await direct(kafka, "pd-decode", prompt_ids, None)
                assert lost[1] == "length"
        except BaseException:
            for child in children:  # pytest shows what the workers said beside the failure
                print(f"--- {child.name}, last output:", *child.tail[-40:], sep="\n")
            raise
        finally:
            codes = await asyncio.gather(*(c.stop(30) for c in children))
        assert codes == [0, 0]  # both drained and stopped cleanly


def test_the_example_connector_never_counts_a_negative_cache_hit(tmp_path: Path) -> None:
    # vllm#53495: once any prompt shorter than a block was stored (its aligned prefix is empty), a one-token
    # prompt "hits" -block_size tokens, and the engine dies on its next step. Ferry runs the guarded class.
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    from workers.vllm_example_connector import GuardedExampleConnector

    def connector(cls: type[ExampleConnector]) -> ExampleConnector:
        c = cls.__new__(cls)  # the counting needs only these two of the engine's settings
        c._block_size, c._storage_path = 32, str(tmp_path)
        return c

    stored = connector(ExampleConnector)._generate_foldername_debug(torch.tensor([], dtype=torch.long), [])
    Path(stored).mkdir()
    one_token = SimpleNamespace(prompt_token_ids=[0], mm_features=[])
    assert connector(ExampleConnector).get_num_new_matched_tokens(one_token, 0)[0] == -32  # type: ignore[arg-type]
    assert connector(GuardedExampleConnector).get_num_new_matched_tokens(one_token, 0) == (0, False)  # type: ignore[arg-type]
    # k blocks and one token, the k blocks in the engine's own prefix cache: -32 again, unguarded.
    repeated = SimpleNamespace(prompt_token_ids=list(range(33)), mm_features=[])
    assert connector(ExampleConnector).get_num_new_matched_tokens(repeated, 32)[0] == -32  # type: ignore[arg-type]
    assert connector(GuardedExampleConnector).get_num_new_matched_tokens(repeated, 32) == (0, False)  # type: ignore[arg-type]
