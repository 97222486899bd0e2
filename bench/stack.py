"""`ferry up` as a child of a benchmark, and the CPU time of each of its processes read from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from launch.services import Child, free_port

_CLK_TCK = os.sysconf("SC_CLK_TCK")

T = TypeVar("T")


def run_cleanly(main: Coroutine[Any, Any, T], uv: bool = False) -> T:
    """`asyncio.run(main)` (`uvloop.run` with `uv`), with SIGTERM cancelling it as Ctrl-C does: the stacks and
    peers it started are stopped on the way out (their children run in sessions of their own, so a plain SIGTERM
    left them running)."""
    terminated: list[bool] = []

    async def guarded() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def terminate() -> None:
            terminated.append(True)
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            return await main
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        if uv:
            import uvloop

            return uvloop.run(guarded())
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if not terminated:
            raise
        print("terminated (SIGTERM): what the benchmark started is stopped", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM) from None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may contain spaces)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of all threads of `pid`, or None once it is gone."""
    f = _stat_fields(pid)
    if f is None:
        return None
    # After the name: state(0) ppid(1) ... utime(11) stime(12)
    return (int(f[11]) + int(f[12])) / _CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (the `cpu` line of /proc/stat)."""
    with open("/proc/stat") as fh:
        parts = fh.readline().split()[1:]
    ticks = [int(x) for x in parts]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    # guest time is already counted in user/nice
    return (sum(ticks[:8]) - idle) / _CLK_TCK


def children_of(ppid: int) -> list[int]:
    """Direct children of `ppid`."""
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None and int(f[1]) == ppid:
                out.append(int(entry))
    return out


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU seconds used so far by `root_pid` and all its descendants (broker, Redis, EngineCore included)."""
    pids, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children_of(pid))
    return sum(process_cpu_seconds(p) or 0.0 for p in pids)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def stack_pids(launcher_pid: int) -> dict[str, int]:
    """The processes a `ferry up` (`launcher_pid`) runs, by role: kafka, redis, frontend, each worker by its id."""
    pids: dict[str, int] = {}
    for pid in children_of(launcher_pid):
        role = _role(_cmdline(pid))
        if role is not None:
            pids[role] = pid
    return pids


def _role(cmdline: list[str]) -> str | None:
    joined = " ".join(cmdline)
    if "tansu" in joined:
        return "kafka"
    if "redis-server" in joined:
        return "redis"
    if "launch worker" in joined:
        m = re.search(r"--worker-id (\S+)", joined)
        return m.group(1) if m else "worker"
    if "launch frontend" in joined:
        return "frontend"
    return None


@dataclass
class CpuSnapshot:
    """CPU seconds used so far by each stack process, this benchmark process and the whole machine."""

    at: float
    processes: dict[str, float]
    bench: float
    machine: float


@dataclass
class CpuUsage:
    """CPU used between two snapshots, in percent of one core (a 2-core machine has 200%)."""

    wall_s: float
    processes: dict[str, float]
    bench: float
    machine: float
    other: float  # machine minus everything above: processes that are not part of this benchmark

    def to_json(self) -> dict[str, object]:
        """Rounded for the results file."""
        return {
            "wall_s": round(self.wall_s, 3),
            "percent_of_one_core": {k: round(v, 1) for k, v in self.processes.items()},
            "bench_client": round(self.bench, 1),
            "machine_total": round(self.machine, 1),
            "other_processes": round(self.other, 1),
        }


@dataclass
class FerryStack:
    """A running `ferry up` and the pids of its broker, Redis, workers and frontend."""

    child: Child
    url: str
    host: str
    port: int
    kafka: str
    pids: dict[str, int] = field(default_factory=dict)

    @classmethod
    async def start(
        cls,
        workers: int,
        speedup: float,
        extra: list[str] | None = None,
        timeout_s: float = 120.0,
        tree: Path | None = None,
    ) -> FerryStack:
        """Start `ferry up` on a free loopback port and wait for its `ferry-ready` line.

        `tree` runs the Ferry of another checkout (PYTHONPATH, and PYTHONSAFEPATH so that no process of the
        stack imports from its working directory instead)."""
        port = free_port()
        argv = [
            sys.executable, "-m", "launch", "up",
            "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(workers), "--speedup", repr(speedup),
            # The launcher waits for each worker's info-level "ready" line, so no quieter level than info.
            "--log-level", "info",
            *(extra or []),
        ]  # fmt: skip
        env = {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"} if tree is not None else None
        child = await Child.spawn("ferry-up", argv, echo=False, env=env)
        kafka_line = asyncio.ensure_future(child.wait_for_line(lambda s: s.startswith("Kafka "), timeout_s))
        try:
            ready = await child.wait_for_line(lambda s: s.startswith("ferry-ready "), timeout_s)
            kafka = (await kafka_line).split()[1]
        except BaseException as exc:
            kafka_line.cancel()
            stack = cls(child, "", "127.0.0.1", port, "")
            stack.pids = stack._discover()
            await stack.stop()
            if isinstance(exc, Exception):
                tail = "\n".join(child.tail[-25:])
                raise RuntimeError(
                    f"ferry up did not become ready ({exc}); its last output:\n{tail}"
                ) from exc
            raise
        url = ready.split()[1]
        stack = cls(child, url, "127.0.0.1", port, kafka)
        stack.pids = stack._discover()
        return stack

    def _discover(self) -> dict[str, int]:
        return stack_pids(self.child.proc.pid)

    def snapshot(self) -> CpuSnapshot:
        """CPU seconds so far of every stack process, this process and the machine."""
        procs = {name: process_cpu_seconds(pid) or 0.0 for name, pid in self.pids.items()}
        return CpuSnapshot(time.perf_counter(), procs, time.process_time(), machine_busy_seconds())

    @staticmethod
    def usage(a: CpuSnapshot, b: CpuSnapshot) -> CpuUsage:
        """CPU percent of one core used between snapshots `a` and `b`."""
        wall = max(b.at - a.at, 1e-9)
        procs = {k: 100.0 * (b.processes.get(k, 0.0) - v) / wall for k, v in a.processes.items()}
        bench = 100.0 * (b.bench - a.bench) / wall
        machine = 100.0 * (b.machine - a.machine) / wall
        return CpuUsage(wall, procs, bench, machine, max(0.0, machine - bench - sum(procs.values())))

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT (what Ctrl-C sends), as `ferry up` expects; kill whatever is left after `timeout_s`."""
        proc = self.child.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                await self.child.stop(5.0)
        # The stack's children run in sessions of their own: make sure none outlives a failed stop.
        for role, pid in self.pids.items():
            if _role(_cmdline(pid)) == role:  # still the process we started, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.child.stop(1.0)
