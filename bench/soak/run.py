"""The soak run: start the stack, probe its capacity, load it for the set time while sampling every process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil

from bench.overhead import hotspots, machine_info, py_spy_binary
from bench.soak.report import (
    Outcome,
    Windows,
    cpu_per_request,
    per_minute,
    plot,
    print_summary,
    rss_slopes,
    stalls,
    targets,
)
from bench.sse_client import Connection, stream_stats
from bench.stack import FerryStack

REQUEST_TIMEOUT_S = 120.0
# The engine settings bench.vllm and the vLLM tests use (ARCHITECTURE.md, "Engines").
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_FLAGS = ["--engine", "vllm", "--block-size", "32", "--max-model-len", "2048"]
_WORDS = (
    "ferry harbour tide rope deck cargo engine captain island bridge wave north south lantern anchor "
    "gull signal crossing timetable passenger ticket vehicle ramp storm calm morning evening river"
).split()


def make_body(model: str, words: int, max_tokens: int) -> Callable[[int], bytes]:
    """Request `i`: a streamed chat of about `words` words, distinct per request, generating `max_tokens`."""
    rng = random.Random(11)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(1, words - 2)))

    def body(i: int) -> bytes:
        return msgspec.json.encode({
            "model": model,
            "messages": [{"role": "user", "content": f"Request {i}: {text}"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "ignore_eos": True,
        })  # fmt: skip

    return body


class Load:
    """Requests against one frontend, bounded by a deadline and a count; every outcome kept."""

    def __init__(self, stack: FerryStack, body: Callable[[int], bytes], t0: float, max_requests: int) -> None:
        self.stack = stack
        self.body = body
        self.t0 = t0
        self.max_requests = max_requests
        self.issued = 0
        self.outcomes: list[Outcome] = []
        self.shed = 0  # open loop: arrivals dropped because the in-flight cap was reached
        self.stack_exited_at: float | None = None
        self._idle: list[Connection] = []

    async def watch_stack(self) -> None:
        """Stop issuing requests once `ferry up` has exited (a dead stack would fail every request at once)."""
        await self.stack.child.proc.wait()
        self.stack_exited_at = time.perf_counter() - self.t0

    async def one(self, conn: Connection) -> None:
        """Issue one request on `conn` and record it."""
        self.issued += 1
        i = self.issued
        started = time.perf_counter()
        try:
            resp = await conn.post_json("/v1/chat/completions", self.body(i), REQUEST_TIMEOUT_S)
            st = stream_stats(resp)
            o = Outcome(
                started - self.t0, resp.finished - self.t0, st.ttft, st.ok, st.completion_tokens, st.error
            )
        except (OSError, TimeoutError) as exc:
            o = Outcome(started - self.t0, time.perf_counter() - self.t0, math.nan, False, 0, repr(exc))
            await asyncio.sleep(0.5)  # the frontend is unreachable: do not spin
        self.outcomes.append(o)

    def _more(self, deadline: float) -> bool:
        return (
            self.issued < self.max_requests
            and time.perf_counter() < deadline
            and self.stack_exited_at is None
        )

    async def closed(self, concurrency: int, deadline: float) -> None:
        """`concurrency` users, each streaming one request after another on its own connection."""

        async def user() -> None:
            conn = Connection(self.stack.host, self.stack.port)
            try:
                while self._more(deadline):
                    await self.one(conn)
            finally:
                conn.close()

        await asyncio.gather(*(user() for _ in range(concurrency)))

    async def open(self, rate: float, cap: int, deadline: float) -> None:
        """Poisson arrivals at `rate` per second, at most `cap` in flight (beyond it, arrivals are shed)."""
        rng = random.Random(5)
        tasks: set[asyncio.Task[None]] = set()
        next_at = time.perf_counter()
        while self._more(deadline):
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if len(tasks) >= cap:
                self.shed += 1
                continue
            conn = self._idle.pop() if self._idle else Connection(self.stack.host, self.stack.port)
            task = asyncio.ensure_future(self._pooled(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        for conn in self._idle:
            conn.close()

    async def _pooled(self, conn: Connection) -> None:
        try:
            await self.one(conn)
        finally:
            self._idle.append(conn)


class StampedLog(io.TextIOBase):
    """The stack's output lines with their time: since the load started, or before it since the stack started."""

    def __init__(self, path: Path) -> None:
        self.t0 = time.perf_counter()
        self.lines: list[tuple[float, str]] = []
        self._fh = open(path, "w", buffering=1)  # line by line: a killed run keeps its log

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


def stack_processes(stack: FerryStack) -> dict[str, psutil.Process]:
    """Every stack process by role (broker, Redis, frontend, each worker)."""
    out: dict[str, psutil.Process] = {}
    for role, pid in stack.pids.items():
        with contextlib.suppress(psutil.Error):
            out[role] = psutil.Process(pid)
    return out


class Sampler:
    """RSS and CPU of every stack process (each with its descendants, e.g. a vLLM EngineCore) every period."""

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


async def probe(
    stack: FerryStack, body: Callable[[int], bytes], concurrency: int, seconds: float
) -> dict[str, Any]:
    """Capacity: requests/s and tokens/s at `concurrency` streams back to back for `seconds`."""
    t0 = time.perf_counter()
    load = Load(stack, body, t0, 10**9)
    await load.closed(concurrency, t0 + seconds)
    wall = time.perf_counter() - t0
    ok = [o for o in load.outcomes if o.ok]
    return {"concurrency": concurrency, "seconds": round(wall, 2), "requests": len(load.outcomes), "ok": len(ok),
            "requests_per_s": round(len(ok) / wall, 2), "tokens_per_s": round(sum(o.tokens for o in ok) / wall, 1)}  # fmt: skip


async def served_model(stack: FerryStack) -> str:
    """The name of the model the frontend serves."""
    conn = Connection(stack.host, stack.port)
    try:
        resp = await conn.request("GET", "/v1/models", timeout_s=10)
    finally:
        conn.close()
    return str(json.loads(resp.body)["data"][0]["id"])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the stack, probe, soak, stop; the results document."""
    machine = machine_info()
    extra = list(args.stack_flags)
    if args.engine == "vllm":
        from launch.model_prepare import default_model_dir, prepare_model

        prepare_model(default_model_dir())
        os.environ.update(VLLM_ENV)
        extra = [*VLLM_FLAGS, "--ready-timeout-s", "600", *extra]
    if args.resume_ttl_s is not None:
        os.environ["FERRY_RESUME_TTL_S"] = str(args.resume_ttl_s)
    # `timeout` or a kill sends SIGTERM: cancel the run, so the stack below is still stopped.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    log = StampedLog(args.log)
    stack = await FerryStack.start(args.workers, args.speedup, extra, timeout_s=600.0)
    stack.child.log = log  # type: ignore[assignment]  # a TextIO in all but name
    print(f"ferry up at {stack.url}; processes {stack.pids}; log {args.log}", file=sys.stderr)
    profiles: dict[str, Any] = {}
    try:
        model = await served_model(stack)
        body = make_body(model, args.prompt_words, args.max_tokens)
        capacity: dict[str, Any] | None = None
        if args.warmup_requests:  # a cold engine's first steps are slow (vLLM on CPU: seconds): not measured
            t = time.perf_counter()
            warm = Load(stack, body, t, args.warmup_requests)
            await warm.closed(2, t + 300.0)
            print(
                f"warm-up: {args.warmup_requests} requests in {time.perf_counter() - t:.1f} s",
                file=sys.stderr,
            )
        if args.concurrency:
            load_desc = f"{args.concurrency} streams back to back"
        else:
            print(
                f"capacity probe: {args.probe_concurrency} streams for {args.probe_seconds:g} s ...",
                file=sys.stderr,
            )
            capacity = await probe(stack, body, args.probe_concurrency, args.probe_seconds)
            rate = args.load_fraction * capacity["requests_per_s"]
            load_desc = f"{rate:.1f} req/s open loop ({args.load_fraction:g} x probed {capacity['requests_per_s']} req/s)"
        print(f"soak: {load_desc} for {args.minutes:g} min ...", file=sys.stderr)
        t0 = time.perf_counter()
        log.t0 = t0
        sampler = Sampler(stack_processes(stack), t0)
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.run(args.sample_s, stop))
        load = Load(stack, body, t0, args.max_requests)
        watch = asyncio.ensure_future(load.watch_stack())
        deadline = t0 + args.minutes * 60.0
        profiling = [asyncio.ensure_future(_profile_at(stack, t0 + m * 60.0, args, f"min{m:g}"))
                     for m in args.profile_at]  # fmt: skip
        progress = asyncio.ensure_future(_progress(load, t0, deadline))
        if args.concurrency:
            await load.closed(args.concurrency, deadline)
        else:
            await load.open(rate, args.open_loop_cap, deadline)
        progress.cancel()
        watch.cancel()
        if load.stack_exited_at is not None:
            print(
                f"ferry up exited {load.stack_exited_at:.0f} s into the load; see {args.log}", file=sys.stderr
            )
        for fut in profiling:
            fut.cancel() if not fut.done() else profiles.update(fut.result())
        stop.set()
        await sampling
        wall = time.perf_counter() - t0
    finally:
        print("stopping ferry up ...", file=sys.stderr)
        await stack.stop()
        log.close()
    minutes = int(args.minutes)
    win = Windows.for_minutes(args.minutes)
    rows = per_minute(load.outcomes, minutes)
    slopes = rss_slopes(sampler.samples, win.settle_min)
    cpu_mean: dict[str, float] = {}
    for role in sampler.procs:
        xs = [s["processes"][role]["cpu_pct"] for s in sampler.samples[1:] if role in s["processes"]]
        if xs:
            cpu_mean[role] = round(sum(xs) / len(xs), 1)
    return {
        "benchmark": "soak",
        "command": " ".join(["python -m bench.soak", *sys.argv[1:]]),
        "machine": machine,
        "config": {
            "engine": args.engine,
            "workers": args.workers,
            "speedup": args.speedup,
            "minutes": args.minutes,
            "load": load_desc,
            "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens,
            "sample_s": args.sample_s,
            "max_requests": args.max_requests,
            "stack_flags": extra,
            "resume_ttl_s": args.resume_ttl_s,
            "stall_ms": args.stall_ms,
        },
        "capacity_probe": capacity,
        "wall_s": round(wall, 1),
        "requests": len(load.outcomes),
        "shed_by_client": load.shed,
        "stack_exited_at_s": None if load.stack_exited_at is None else round(load.stack_exited_at, 1),
        "errors": sorted({o.error or "?" for o in load.outcomes if not o.ok})[:10],
        "windows": {"window_min": win.window_min, "settle_min": win.settle_min},
        "per_minute": rows,
        "rss_slope_mb_per_min": slopes,
        "cpu_percent_mean": cpu_mean,
        "cpu_ms_per_request": cpu_per_request(sampler.samples, rows),
        "targets": targets(rows, slopes, win),
        "stalls": stalls(load.outcomes, log.lines, args.stall_ms / 1000.0),
        "log": str(args.log),
        "samples": sampler.samples,
        "profiles": profiles or None,
    }


async def _profile_at(stack: FerryStack, at: float, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    pids = {k: v for k, v in stack.pids.items() if k == "frontend" or k == min(w for w in stack.pids if w not in ("kafka", "redis", "frontend"))}  # fmt: skip
    args.profile_dir.mkdir(parents=True, exist_ok=True)
    print(f"py-spy {tag}: {pids}", file=sys.stderr)
    return await py_spy(pids, args.profile_seconds, args.profile_dir, tag)


async def _progress(load: Load, t0: float, deadline: float) -> None:
    last = 0
    while True:
        await asyncio.sleep(60.0)
        done = load.outcomes[last:]
        last = len(load.outcomes)
        tokens = sum(o.tokens for o in done if o.ok)
        print(f"  minute {(time.perf_counter() - t0) / 60:.0f}: {len(done)} requests, {tokens / 60:.0f} tokens/s, "
              f"{sum(1 for o in done if not o.ok)} failed", file=sys.stderr)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; `--smoke` and `--engine vllm` change the defaults."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--minutes", type=float, default=None, help="length of the load (default 60; --smoke 10; vllm 15)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="a 10-minute run (windows scaled: 2 min, RSS after 3)"
    )
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--workers", type=int, default=None, help="workers (default 2; vllm 1)")
    p.add_argument("--speedup", type=float, default=1000.0, help="sim speedup (default 1000)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="streams back to back; without it, an open-loop rate at --load-fraction of the probed capacity "
                        "(vllm default 4)")  # fmt: skip
    p.add_argument(
        "--load-fraction", type=float, default=0.7, help="share of the probed capacity (default 0.7)"
    )
    p.add_argument(
        "--probe-concurrency", type=int, default=16, help="streams of the capacity probe (default 16)"
    )
    p.add_argument(
        "--probe-seconds", type=float, default=30.0, help="length of the capacity probe (default 30)"
    )
    p.add_argument(
        "--open-loop-cap", type=int, default=64, help="most requests in flight in open loop (default 64)"
    )
    p.add_argument(
        "--warmup-requests", type=int, default=8, help="unmeasured requests first, 2 at a time (default 8)"
    )
    p.add_argument("--max-requests", type=int, default=5_000_000, help="most requests of the soak")
    p.add_argument("--prompt-words", type=int, default=100, help="words per prompt (default 100)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request, ignore_eos (default 128)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS/CPU samples (default 5)")
    p.add_argument("--stall-ms", type=float, default=1000.0, help="TTFT above which a request is a stall")
    p.add_argument("--resume-ttl-s", type=float, default=None, help="FERRY_RESUME_TTL_S for the stack")
    p.add_argument(
        "--profile-at", default="", help="minutes at which to py-spy the frontend and first worker, e.g. 1,9"
    )
    p.add_argument(
        "--profile-seconds", type=float, default=20.0, help="length of each py-spy record (default 20)"
    )
    p.add_argument("--stack-flag", dest="stack_flags", action="append", default=[],
                   help="a flag passed to `ferry up` (repeat; e.g. --stack-flag=--replies-roll-records=2000)")  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file (default bench/results/soak-<engine>[-smoke].json)"
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default next to the JSON)")
    args = p.parse_args(argv)
    vllm = args.engine == "vllm"
    if args.minutes is None:
        args.minutes = 10.0 if args.smoke else 15.0 if vllm else 60.0
    if args.workers is None:
        args.workers = 1 if vllm else 2
    if args.concurrency is None and vllm:
        args.concurrency = 4
    if args.speedup <= 0 or args.minutes <= 0 or args.workers < 1:
        p.error("--speedup, --minutes and --workers must be positive")
    if vllm:
        args.speedup = 1.0
    args.profile_at = [float(x) for x in str(args.profile_at).split(",") if x.strip()]
    stem = f"soak-{args.engine}{'-smoke' if args.smoke else ''}"
    args.out = args.out or Path("bench/results") / f"{stem}.json"
    args.plot = args.plot or args.out.with_suffix(".png")
    args.log = args.out.with_suffix(".log")
    args.profile_dir = args.out.parent / f"{args.out.stem}-profiles"
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak and write its outputs; exit status 1 if a target was missed."""
    import uvloop

    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = uvloop.run(run(args))
    print_summary(doc)
    for name, prof in (doc.get("profiles") or {}).items():
        print(f"py-spy {name} ({prof['samples']} samples), top self time:")
        for frame, share in prof["self_percent"][:6]:
            print(f"  {share:5.1f}%  {frame}")
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    drawn = plot(doc, args.plot)
    print(f"\nwrote {args.out}{f' and {args.plot}' if drawn else ''}; stack log {args.log}")
    return 0 if all(t["met"] for t in doc["targets"]) else 1
