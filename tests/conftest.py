"""Session-wide fixtures: the default model directory, a real Kafka broker and a real Redis."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from launch.services import start_broker, start_redis
from tests.harness import Harness, harness


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model directory, built once and reused across runs."""
    from launch.model_prepare import default_model_dir, prepare_model

    logging.getLogger("ferry").setLevel(logging.WARNING)
    return prepare_model(default_model_dir())


@pytest_asyncio.fixture(scope="session")
async def kafka() -> AsyncIterator[str]:
    """Bootstrap address of an embedded Tansu broker on a free loopback port."""
    child, addr = await start_broker(echo=bool(os.environ.get("FERRY_TEST_ECHO_BROKER")))
    yield addr
    await child.stop()


@pytest_asyncio.fixture(scope="session")
async def redis_url() -> AsyncIterator[str]:
    """URL of a throwaway Redis on a free loopback port."""
    child, url = await start_redis()
    yield url
    await child.stop()


@pytest_asyncio.fixture
async def h(kafka: str, redis_url: str, prefix: str, model_path: Path) -> AsyncIterator[Harness]:
    """An in-process Ferry of the test's own (workers and frontends added by the test) on the session's
    broker and Redis."""
    async with harness(kafka, redis_url, prefix, model_path) as hh:
        yield hh


@pytest.fixture
def prefix() -> str:
    """A Redis key prefix of this test's own, so tests sharing one Redis never see each other."""
    return f"t{uuid.uuid4().hex[:8]}:"
