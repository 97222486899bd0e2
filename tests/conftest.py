"""Session-wide fixtures: the default model directory, a real Kafka broker and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from launch.services import Child, start_broker, start_redis
from schemas.settings import DEFAULT_MODEL_NAME
from server.model_files import ModelFiles
from tests.harness import Harness, harness

# pytest-timeout's signal lands inside an event-loop callback, where asyncio logs the exception and goes on:
# an async test that hangs would hang the whole run. Each one runs under an asyncio deadline of its own,
# a little shorter, so a hang fails that test with the traceback of what it was waiting for.
TIMEOUT_MARGIN_S = 20.0


def _bounded(fn: Callable[..., Awaitable[Any]], limit_s: float) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> Any:
        async with asyncio.timeout(limit_s):
            return await fn(*args, **kwargs)

    return run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every async test under an asyncio deadline just inside pytest-timeout's."""
    limit_s = float(config.getini("timeout")) - TIMEOUT_MARGIN_S
    for item in items:
        fn = getattr(item, "obj", None)
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(fn):
            item.obj = _bounded(fn, limit_s)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remember the run's exit status for `pytest_unconfigure`."""
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave at once once the summary is out, when Triton was imported (vLLM's in-process tests do)."""
    # Triton's nanobind module holds objects to the end, and nanobind then prints some 600 "leaked" lines
    # after the summary at interpreter exit. Every test's processes and loops are gone by now.
    if "triton" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash.get(_EXIT_STATUS, 0))


@pytest.fixture(autouse=True)
def no_child_outlives_its_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kill, with its process group, every child process a test started and left running (a failed assertion
    skipped its clean-up): a sim worker left behind takes a tenth of a core from the rest of the run."""
    spawned: list[Child] = []
    spawn = Child.spawn.__func__  # type: ignore[attr-defined]

    async def tracked(cls: type[Child], *args: Any, **kwargs: Any) -> Child:
        child: Child = await spawn(cls, *args, **kwargs)
        spawned.append(child)
        return child

    monkeypatch.setattr(Child, "spawn", classmethod(tracked))
    yield
    for child in spawned:
        if child.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model directory, built once and reused across runs."""
    from launch.model_prepare import default_model_dir, prepare_model

    logging.getLogger("ferry").setLevel(logging.WARNING)
    return prepare_model(default_model_dir())


@pytest.fixture(scope="session")
def files(model_path: Path) -> ModelFiles:
    """The default model's tokenizer and chat template, loaded once."""
    return ModelFiles.load(model_path, DEFAULT_MODEL_NAME)


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
