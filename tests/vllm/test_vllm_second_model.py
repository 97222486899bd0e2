"""Any local Hugging Face model directory: a tiny random-weight Llama the test builds, served by vLLM with
Ferry's defaults sized to it (its own 1024-token context on CPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from tests.tiny_model import make_tiny_llama
from tests.vllm.test_vllm_engine import request, run
from workers.vllm_config import VLLMConfig
from workers.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm


async def test_a_second_model_directory_serves(model_path: Path, tmp_path: Path) -> None:
    tiny = await asyncio.to_thread(make_tiny_llama, model_path, tmp_path / "tiny")
    engine = VLLMEngine("tiny", tiny, VLLMConfig())
    await engine.start()
    try:
        assert engine.stats().max_model_len == 1024  # the model's own, under Ferry's CPU cap of 2048
        assert (
            engine._llm is not None and engine._llm.vllm_config.model_config.hf_config.num_hidden_layers == 2
        )
        req = msgspec.structs.replace(request([1, 520, 3151, 314], max_tokens=8), model="tiny")
        result = await run(engine, req)
        assert 1 <= len(result.token_ids) <= 8
        assert result.last.finish_reason in ("length", "stop")
    finally:
        await engine.stop()
