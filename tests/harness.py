"""An in-process Ferry for integration tests: real broker and Redis, workers and a frontend as tasks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette

from launch.frontend import ReadyServer
from launch.services import Child, free_port
from schemas.settings import DEFAULT_MODEL_NAME, FrontendSettings, WorkerSettings
from server.app import create_app
from server.frontend import Frontend
from workers.engine_choice import build_engine
from workers.worker import Worker


@dataclasses.dataclass
class RunningWorker:
    """A worker running as a task of the test's event loop."""

    worker: Worker
    shutdown: asyncio.Event
    task: asyncio.Task[int]

    async def stop(self) -> int:
        """Drain and stop, like SIGTERM."""
        self.shutdown.set()
        return await self.task

    async def halt(self) -> None:
        """Stop without the drain: its clean-up (inbox, producer, engine) still runs, and the batch items it
        finished are committed before it leaves its pool group, so the next member of the group (a later
        test's worker on the same model) does not run them again."""
        if self.worker.pool is not None:
            with contextlib.suppress(Exception):
                await self.worker.pool.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


# The default model's own template cannot show tools: tests serve it with the shipped hermes template, as
# `make run` does (plain chats render the same).
TOOLS = {"chat_template": "hermes", "tool_call_parser": "hermes"}


class Harness:
    """Starts workers and frontends against one broker and Redis under a test's own key prefix."""

    def __init__(self, kafka: str, redis: str, prefix: str, model_path: Path) -> None:
        self.common = dict(
            kafka=kafka,
            redis=redis,
            redis_prefix=prefix,
            model_path=str(model_path),
            heartbeat_interval_s=0.5,
        )
        self.workers: list[RunningWorker] = []
        self._servers: list[tuple[ReadyServer, asyncio.Task[None]]] = []
        self.frontends: list[Frontend] = []
        self.apps: list[Starlette] = []  # each frontend's ASGI app (its `state`: the batch service)

    async def add_worker(self, **overrides: Any) -> RunningWorker:
        """Start one sim worker and wait until it is registered.

        Without batch pool work unless a test asks for it (`pool=True`): like the frontends' batch readers
        (`add_frontend`), its consumer group's first join takes the embedded broker ~3 s, and a worker stopped
        before that waits for it.
        """
        settings = WorkerSettings(
            **{**self.common, "worker_id": f"w-{uuid.uuid4().hex[:6]}", "speedup": 50.0, "pool": False,
               **overrides}
        )  # fmt: skip
        worker = Worker(settings, build_engine(settings), "sim")
        shutdown = asyncio.Event()
        task = asyncio.create_task(worker.run(shutdown))
        ready = asyncio.create_task(worker.ready.wait())
        await asyncio.wait([ready, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        assert worker.ready.is_set(), "worker did not become ready"
        running = RunningWorker(worker, shutdown, task)
        self.workers.append(running)
        for fe in self.frontends:
            await fe.svc.pool.refresh()
        return running

    async def add_frontend(self, **overrides: Any) -> tuple[Frontend, str]:
        """Start one frontend on uvicorn on a free loopback port; returns it and its base URL.

        Without the Batch API unless a test asks for it (`batch_api=True`): its consumer groups' first join
        takes the embedded broker ~5 s, and a frontend stopped before that waits for it.
        """
        port = free_port()
        settings = FrontendSettings(
            **{**self.common, "frontend_id": f"fe-{uuid.uuid4().hex[:6]}", "port": port, "batch_api": False,
               **TOOLS, **overrides}
        )  # fmt: skip
        app = create_app(settings)
        server = ReadyServer(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        task = asyncio.create_task(server.serve())
        bound = asyncio.create_task(server.bound.wait())
        await asyncio.wait([bound, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        self._servers.append((server, task))
        fe: Frontend = app.state.frontend
        self.frontends.append(fe)
        self.apps.append(app)
        return fe, f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        """Stop every frontend, then every worker (those of one kind together, as separate processes would).

        Workers halt without their drain: no test looks at them after this, and a drain waits out its inbox's
        last poll (a second), which over the suite's harnesses adds minutes.
        """

        async def bounded(stop: Awaitable[Any]) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stop, 15)

        for server, _task in self._servers:
            server.should_exit = True
        await asyncio.gather(*(bounded(task) for _server, task in self._servers))
        await asyncio.gather(*(bounded(w.halt()) for w in self.workers if not w.task.done()))


async def worker_process(
    worker_id: str, kafka: str, redis: str, prefix: str, model_path: Path, *extra: str
) -> Child:
    """A sim worker as a real child process (for tests that kill it), once it is registered."""
    child = await Child.spawn(
        worker_id,
        [
            sys.executable,
            "-m",
            "launch",
            "worker",
            "--worker-id",
            worker_id,
            "--kafka",
            kafka,
            "--redis",
            redis,
            "--redis-prefix",
            prefix,
            "--model-path",
            str(model_path),
            "--heartbeat-interval-s",
            "0.2",
            *extra,
        ],
        echo=False,
    )
    try:
        await child.wait_for_line(lambda line: line.startswith("ferry-worker-ready"), 60)
    except BaseException:
        await child.stop()
        raise
    return child


async def frontend_process(
    kafka: str, redis: str, prefix: str, model_path: Path, *extra: str
) -> tuple[Child, str]:
    """`ferry frontend` as a real child process on a free port (for tests that signal or measure it)."""
    port = free_port()
    child = await Child.spawn(
        "frontend",
        [sys.executable, "-m", "launch", "frontend", "--port", str(port), "--kafka", kafka, "--redis", redis,
         "--redis-prefix", prefix, "--model-path", str(model_path), "--frontend-id", f"fe-{uuid.uuid4().hex[:6]}",
         "--heartbeat-interval-s", "0.2", "--log-level", "warning", *extra],
        echo=False,
    )  # fmt: skip
    try:
        await child.wait_for_line(lambda line: line.startswith("ferry-frontend-ready"), 60)
    except BaseException:
        await child.stop()
        raise
    return child, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def harness(kafka: str, redis: str, prefix: str, model_path: Path) -> AsyncIterator[Harness]:
    """A Harness that is always closed."""
    h = Harness(kafka, redis, prefix, model_path)
    try:
        yield h
    finally:
        await h.close()


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, period_s: float = 0.05) -> None:
    """Poll `check` until it holds: for state that gives no notification of its change (another
    process's, a broker's). Raises TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - there is nothing to wait on instead
            await asyncio.sleep(period_s)


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(id, data) of each SSE event; comment lines are skipped."""
    event_id: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


async def stream_with_fault(
    url: str, body: dict[str, Any], victim_id: str, fault: Callable[[], Awaitable[None]]
) -> tuple[list[tuple[str | None, str]], str]:
    """Stream `body` (chat, ignore_eos) from the victim, calling `fault` after the third event; the events and the
    text, once checked: no error event, a `length` finish."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.headers.get("x-ferry-worker") == victim_id, (r.status_code, await r.aread())
            events = []
            async with asyncio.timeout(30):  # never a hang
                async for e in sse_events(r):
                    events.append(e)
                    if len(events) == 3:
                        await fault()
    assert not any('"error"' in d for _, d in events), events[-3:]
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c.get("choices", []))
    assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"
    return events, text


async def timed_chat(
    url: str, key: str, content: str, max_tokens: int, started: float
) -> tuple[float, float]:
    """Stream one chat with API key `key`; seconds from `started` to its first content token and to its end."""
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}  # fmt: skip
    first = None
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async with c.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            assert r.status_code == 200, await r.aread()
            async for _, data in sse_events(r):
                if data == "[DONE]":
                    break
                delta = json.loads(data)["choices"][0]["delta"]
                if first is None and delta.get("content"):
                    first = time.perf_counter() - started
    assert first is not None
    return first, time.perf_counter() - started


class Lines:
    """Output lines of a child that contain given texts, collected from now on, with an event per new match."""

    def __init__(self, child: Child) -> None:
        self.seen: dict[str, list[str]] = {}
        self._changed = asyncio.Event()
        # A watcher that never completes: it only looks at each line as the relay reads it.
        self._watch = asyncio.ensure_future(child.wait_for_line(self._match, 3600))
        self._watch.add_done_callback(lambda f: f.cancelled() or f.exception())

    def of(self, text: str) -> list[str]:
        """The lines containing `text` (a live list)."""
        return self.seen.setdefault(text, [])

    def _match(self, line: str) -> bool:
        for text, lines in self.seen.items():
            if text in line:
                lines.append(line)
                self._changed.set()
        return False

    async def until(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Wait until `condition` holds, re-checking at every matching line."""
        async with asyncio.timeout(timeout_s):
            while not condition():
                self._changed.clear()
                await self._changed.wait()

    def close(self) -> None:
        """Stop watching."""
        self._watch.cancel()
