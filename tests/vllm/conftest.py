"""One real vLLM engine (the default model on CPU) shared by every test of the session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest_asyncio

from schemas.settings import DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from workers.vllm_engine import VLLMEngine

@pytest_asyncio.fixture(scope="session")
async def vllm_engine(model_path: Path) -> AsyncIterator[VLLMEngine]:
    """A started VLLMEngine with the settings that suit a 2-core CPU host."""
    from workers.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine(DEFAULT_MODEL_NAME, model_path, VLLMConfig())
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
