"""What the soak watches besides the requests: every process's RSS and CPU, the system's log, py-spy profiles."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.overhead import hotspots, py_spy_binary


class StampedLog(io.TextIOBase):
    """The system's output lines with their time: since the load started, or before it since the system started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.perf_counter()
        self.lines: list[tuple[float, str]] = []
        self._fh = open(path, "w", buffering=1)  # line by line: a killed run keeps its log

    def startup(self, name: str, lines: list[str]) -> None:
        """The last lines a system printed while starting (engine settings among them), before the log was attached."""
        self.write("".join(f"[{name}] {line}\n" for line in lines))

    def write(self, s: str) -> int:
        """Keep every line with its time."""
        t = time.perf_counter() - self.t0
        for line in s.splitlines():
            self.lines.append((t, line))
            self._fh.write(f"{t:9.3f} {line}\n")
        return len(s)

    def close(self) -> None:
        """Close the file."""
        self._fh.close()
        super().close()


def processes(pids: dict[str, int]) -> dict[str, psutil.Process]:
    """Every process of a system by role (broker, Redis, frontend, each worker; or vLLM's server)."""
    out: dict[str, psutil.Process] = {}
    for role, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            out[role] = psutil.Process(pid)
    return out


class Sampler:
    """RSS and CPU of every process of a system (each with its descendants, e.g. a vLLM EngineCore) every period."""

    def __init__(self, procs: dict[str, psutil.Process], t0: float) -> None:
        self.procs = procs
        self.t0 = t0
        self.samples: list[dict[str, Any]] = []
        self._cpu: dict[int, float] = {}
        self._last = time.perf_counter()

    def _tree(self, p: psutil.Process) -> list[psutil.Process]:
        try:
            return [p, *p.children(recursive=True)]
        except psutil.Error:
            return []

    def sample(self) -> None:
        """One sample of every process."""
        now = time.perf_counter()
        wall = max(now - self._last, 1e-9)
        self._last = now
        row: dict[str, Any] = {"t": round(now - self.t0, 2), "processes": {}}
        for role, p in self.procs.items():
            rss = 0
            cpu_delta = 0.0
            for q in self._tree(p):
                with contextlib.suppress(psutil.Error):
                    rss += q.memory_info().rss
                    c = q.cpu_times()
                    total = c.user + c.system
                    cpu_delta += total - self._cpu.get(q.pid, total)
                    self._cpu[q.pid] = total
            if rss:
                row["processes"][role] = {
                    "rss_mb": round(rss / 2**20, 1),
                    "cpu_pct": round(100 * cpu_delta / wall, 1),
                }
        row["client_rss_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
        row["loadavg_1m"] = round(os.getloadavg()[0], 2)
        self.samples.append(row)

    async def run(self, period_s: float, stop: asyncio.Event) -> None:
        """Sample every `period_s` until `stop` is set."""
        self.sample()  # primes the CPU counters
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
            self.sample()

    def cpu_mean(self) -> dict[str, float]:
        """Mean CPU % of one core of each process over the samples."""
        out: dict[str, float] = {}
        for role in self.procs:
            xs = [s["processes"][role]["cpu_pct"] for s in self.samples[1:] if role in s["processes"]]
            if xs:
                out[role] = round(sum(xs) / len(xs), 1)
        return out


async def py_spy(pids: dict[str, int], seconds: float, out_dir: Path, tag: str) -> dict[str, Any]:
    """`py-spy dump` once, then `record --nonblocking` for `seconds`, of each named process."""
    exe = py_spy_binary()
    if exe is None:
        print("py-spy not found (`make bench-setup`); no profile", file=sys.stderr)
        return {}
    out: dict[str, Any] = {}
    procs = []
    for name, pid in pids.items():
        dump = out_dir / f"{name}-{tag}-dump.txt"
        p = await asyncio.create_subprocess_exec(exe, "dump", "--pid", str(pid), "--nonblocking",
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)  # fmt: skip
        dump.write_bytes((await p.communicate())[0])
        raw = out_dir / f"{name}-{tag}.txt"
        argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "100",
                "--nonblocking", "--format", "raw", "--output", str(raw)]  # fmt: skip
        procs.append((name, raw, await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)))  # fmt: skip
    for name, raw, proc in procs:
        await proc.wait()
        if raw.exists():
            out[f"{name}@{tag}"] = {"file": str(raw), **hotspots(raw)}
    return out
