"""LoRA adapters end to end: loaded through the frontend's admin API onto real vLLM workers, selected by
model name, listed, routed only to workers holding them, cached apart from the base model, unloaded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from kvstore.hashing import block_hashes, chain_seed
from kvstore.kv_index import KVIndex
from schemas.names import RedisKeys
from schemas.settings import DEFAULT_MODEL_NAME as BASE
from server.model_files import ModelFiles
from server.router import PromptMemo
from tests.vllm.lora_adapter import make_adapter
from tests.vllm.stack import LORA_SLOTS, VllmStack
from workers.kv_bridge import KVBridge

pytestmark = pytest.mark.vllm

ADAPTER = "tiny-lora"
LORA_WORKER = VllmStack.worker_id(next(i for i, slots in LORA_SLOTS.items() if slots))
QUESTION = "What is the capital of France?"


@pytest_asyncio.fixture(scope="module")
async def adapter_dir(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 adapter for the default model, made with peft (random A and B, so it changes outputs)."""
    out = tmp_path_factory.mktemp("lora") / ADAPTER
    return await asyncio.to_thread(make_adapter, model_path, out)


def chat_body(model: str, content: str, max_tokens: int = 24) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }


async def test_adapter_loads_changes_answers_and_unloads(vllm_stack: VllmStack, adapter_dir: Path) -> None:
    stack = vllm_stack
    await stack.ensure_workers()
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
        r = await c.post(
            "/v1/admin/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_dir)}
        )
        assert r.status_code == 200, r.text
        # Only the worker with LoRA slots takes it; the other says it cannot and is left out.
        assert r.json()["workers"] == [LORA_WORKER]
        st = await stack.status(LORA_WORKER)
        assert st is not None and st.lora_adapters == [ADAPTER]

        models = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        assert models[ADAPTER]["parent"] == BASE
        assert models[ADAPTER]["root"] == str(adapter_dir)
        assert models[BASE]["parent"] is None
        listed = (await c.get("/v1/admin/lora_adapters")).json()["data"]
        assert [(a["lora_name"], a["base_model"], a["workers"]) for a in listed] == [
            (ADAPTER, BASE, [LORA_WORKER])
        ]

        base = await c.post("/v1/chat/completions", json=chat_body(BASE, QUESTION))
        tuned = await c.post("/v1/chat/completions", json=chat_body(ADAPTER, QUESTION))
        assert base.status_code == tuned.status_code == 200, (base.text, tuned.text)
        assert "Paris" in base.json()["choices"][0]["message"]["content"]
        assert tuned.json()["model"] == ADAPTER
        assert (
            tuned.json()["choices"][0]["message"]["content"]
            != base.json()["choices"][0]["message"]["content"]
        )

        # Concurrent adapter requests would spread over both workers by load; all must go where the adapter is.
        burst = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=chat_body(ADAPTER, f"Count to {k}.", 8)) for k in range(4))
        )
        assert [r.status_code for r in burst] == [200] * 4
        assert {r.headers["x-ferry-worker"] for r in burst} == {LORA_WORKER}

        # Loading the same adapter again from the same path is a no-op; from another path, a conflict.
        again = await c.post(
            "/v1/admin/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_dir)}
        )
        assert again.status_code == 200, again.text
        clash = await c.post(
            "/v1/admin/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_dir.parent)}
        )
        assert (clash.status_code, clash.json()["error"]["code"]) == (400, "lora_exists")

        r = await c.post("/v1/admin/unload_lora_adapter", json={"lora_name": ADAPTER})
        assert r.status_code == 200, r.text
        assert r.json()["workers"] == [LORA_WORKER]
        assert ADAPTER not in {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
        assert (await c.get("/v1/admin/lora_adapters")).json()["data"] == []
        gone = await c.post("/v1/chat/completions", json=chat_body(ADAPTER, QUESTION))
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "model_not_found")
        r = await c.post("/v1/admin/unload_lora_adapter", json={"lora_name": ADAPTER})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "lora_not_found")


async def test_admin_errors_are_clear(vllm_stack: VllmStack, adapter_dir: Path, tmp_path: Path) -> None:
    stack = vllm_stack
    await stack.ensure_workers()
    no_slots = VllmStack.worker_id(next(i for i, slots in LORA_SLOTS.items() if not slots))
    load = "/v1/admin/load_lora_adapter"
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
        cases = [
            (
                {"lora_name": "x", "lora_path": str(adapter_dir), "worker_id": no_slots},
                400,
                "lora_not_supported",
            ),
            ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "lora_invalid"),  # no adapter_config.json
            ({"lora_name": "x", "lora_path": "relative/dir"}, 400, "lora_invalid"),
            ({"lora_name": BASE, "lora_path": str(adapter_dir)}, 400, "invalid_value"),
            (
                {"lora_name": "x", "lora_path": str(adapter_dir), "worker_id": "nobody"},
                404,
                "worker_not_found",
            ),
            ({"lora_name": "x"}, 400, "missing_required_parameter"),
        ]
        for body, status, code in cases:
            r = await c.post(load, json=body)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body, r.text)
        assert (await c.get("/v1/admin/lora_adapters")).json()["data"] == []


async def test_cached_prefixes_never_cross_adapters(
    vllm_stack: VllmStack, adapter_dir: Path, model_path: Path
) -> None:
    stack = vllm_stack
    await stack.ensure_workers()
    files = ModelFiles.load(model_path, BASE)
    system = "You answer in one word. " * 50  # many full 32-token blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    tokens = files.encode(files.render_chat(messages), add_special_tokens=False)
    adapter_chain = block_hashes(tokens, 32, chain_seed(BASE, ADAPTER))
    base_chain = block_hashes(tokens, 32, chain_seed(BASE))
    assert len(adapter_chain) >= 8 and not set(adapter_chain) & set(base_chain)
    index = KVIndex(stack.redis, RedisKeys(stack.prefix))
    body = {"max_tokens": 2, "temperature": 0, "messages": messages}

    async def held(chain: list[int]) -> dict[str, int]:
        return await index.overlaps(BASE, chain)

    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
        r = await c.post(
            "/v1/admin/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_dir)}
        )
        assert r.status_code == 200, r.text
        try:
            first = await c.post("/v1/chat/completions", json={**body, "model": ADAPTER})
            assert first.status_code == 200, first.text
            assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # The worker's KV events put the adapter's blocks in the index under the salted chain.
            deadline = time.monotonic() + 10
            while (await held(adapter_chain)).get(LORA_WORKER, 0) < len(adapter_chain):
                assert time.monotonic() < deadline, await held(adapter_chain)
                await asyncio.sleep(0.1)  # KV events arrive after the engine step; poll with a deadline
            assert await held(base_chain) == {}

            # The base model asks for the same tokens: neither the router nor vLLM treats them as cached.
            plain = await c.post("/v1/chat/completions", json={**body, "model": BASE})
            assert plain.status_code == 200, plain.text
            if plain.headers["x-ferry-worker"] == LORA_WORKER:
                assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert plain.headers["x-ferry-predicted-cached-blocks"] == "0"

            # The adapter again: its own blocks are found and reused.
            second = await c.post("/v1/chat/completions", json={**body, "model": ADAPTER})
            assert second.status_code == 200, second.text
            assert int(second.headers["x-ferry-predicted-cached-blocks"]) == len(adapter_chain)
            assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * 32
        finally:
            await c.post("/v1/admin/unload_lora_adapter", json={"lora_name": ADAPTER})


class _Stored:
    """The fields of vLLM's BlockStored event the bridge reads."""

    def __init__(self, tokens: list[int], lora_name: str | None) -> None:
        self.block_hashes = [1000 + i for i in range(len(tokens) // 32)]
        self.parent_block_hash = None
        self.token_ids = tokens
        self.block_size = 32
        self.lora_id = 1 if lora_name else None
        self.lora_name = lora_name
        self.medium = "GPU"


class _Batch:
    def __init__(self, event: object) -> None:
        self.ts = 0.0
        self.events = [event]


_Stored.__name__ = "BlockStored"


def test_router_and_worker_salt_the_same_way() -> None:
    tokens = list(range(100, 100 + 4 * 32))
    bridge = KVBridge(BASE, 32)
    for lora in (None, ADAPTER, "other"):
        batch = bridge.translate(_Batch(_Stored(tokens, lora)))  # type: ignore[arg-type]
        assert batch is not None
        worker_side = batch.events[0].block_hashes  # type: ignore[union-attr]
        router_side = PromptMemo(tokens, lora_name=lora).chain(BASE, 32)
        assert worker_side == router_side
        bridge.reset()
    chains = {lora: PromptMemo(tokens, lora_name=lora).chain(BASE, 32) for lora in (None, ADAPTER, "other")}
    # No block of one adapter's chain is a block of another's (or the base model's).
    seen: set[int] = set()
    for chain in chains.values():
        assert not seen & set(chain)
        seen |= set(chain)
