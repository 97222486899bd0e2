"""One real vLLM engine (the default model on CPU) shared by every test of the session, and one stack
of vLLM worker processes behind a frontend for the tests of the whole path."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from schemas.settings import DEFAULT_MODEL_NAME
from tests.harness import harness

if TYPE_CHECKING:
    from tests.vllm.stack import VllmStack
    from workers.vllm_engine import VLLMEngine


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker of tests that kill a shared worker."""
    config.addinivalue_line("markers", "kills_worker: kills a worker of the shared vLLM stack (runs last)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run tests that kill a shared worker last, so the others need not wait for a replacement."""
    items.sort(key=lambda item: item.get_closest_marker("kills_worker") is not None)


@pytest_asyncio.fixture(scope="session")
async def vllm_engine(model_path: Path) -> AsyncIterator[VLLMEngine]:
    """A started VLLMEngine with the settings that suit a 2-core CPU host."""
    from workers.vllm_config import VLLMConfig
    from workers.vllm_engine import VLLMEngine

    engine = VLLMEngine(DEFAULT_MODEL_NAME, model_path, VLLMConfig())
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest_asyncio.fixture(scope="session")
async def vllm_stack(kafka: str, redis_url: str, model_path: Path) -> AsyncIterator[VllmStack]:
    """Two vLLM worker processes (`vllm-0` with LoRA slots, `vllm-1` without) and a frontend."""
    from tests.vllm.stack import VllmStack

    prefix = f"v{uuid.uuid4().hex[:8]}:"
    async with harness(kafka, redis_url, prefix, model_path) as h:
        stack = VllmStack(h, kafka, redis_url, prefix, model_path)
        try:
            await stack.start()
            yield stack
        finally:
            await stack.close()
