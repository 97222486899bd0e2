"""`python -m bench.cancel [--samples N] [--background K]`: see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn

from bench.stack import run_cleanly
from launch.frontend import ReadyServer
from launch.services import free_port, start_broker, start_redis
from schemas.settings import FrontendSettings, WorkerSettings, default_model_path
from server.app import create_app
from workers.engine import Engine
from workers.engine_choice import build_engine
from workers.worker import Worker

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
POLL_S = 0.0005


class Marks(logging.Handler):
    """Wall-clock times of the log lines that mark a cancel's way: sent by the frontend, read by the worker."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sent: list[float] = []
        self.read: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the time of the records we care about."""
        if record.name == "ferry.frontend" and str(record.msg).startswith("cancelling"):
            self.sent.append(record.created)
        elif record.name == "ferry.worker" and str(record.msg).startswith("cancel "):
            self.read.append(record.created)


def body(i: int, max_tokens: int, stream: bool) -> bytes:
    """A chat request that generates until cancelled (ignore_eos, a large max_tokens)."""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"cancel benchmark {i}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


async def open_request(port: int, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one POST /v1/chat/completions on a fresh connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    writer.write(head + payload)
    await writer.drain()
    return reader, writer


async def until(cond: Any, timeout_s: float = 30.0) -> float:
    """Poll `cond()` every POLL_S until true; the perf_counter() when it was seen true."""
    deadline = time.perf_counter() + timeout_s
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(POLL_S)
    return time.perf_counter()


async def one(port: int, engine: Engine, i: int, stream: bool, baseline: int, marks: Marks) -> list[float]:
    """Milliseconds from closing the client socket to the frontend sending Cancel, the worker reading it,
    and the engine no longer running the request."""
    reader, writer = await open_request(port, body(i, 4000, stream))
    if stream:
        seen = 0
        while seen < 4:  # the role event and a few tokens: generating
            line = await reader.readline()
            seen += line.startswith(b"data:")
    else:
        await until(lambda: engine.stats().running > baseline)
        await asyncio.sleep(0.05)  # let it generate a few tokens
    if engine.stats().running != baseline + 1:
        raise RuntimeError("the worker's load changed under the measurement (a background stream ended?)")
    marks.sent.clear()
    marks.read.clear()
    wall0, t0 = time.time(), time.perf_counter()
    writer.transport.abort()  # the client is gone (RST/FIN at once, nothing buffered)
    t1 = await until(lambda: engine.stats().running == baseline)
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    sent = (marks.sent[0] - wall0) * 1000 if marks.sent else float("nan")
    read = (marks.read[0] - wall0) * 1000 if marks.read else float("nan")
    return [sent, read, (t1 - t0) * 1000]


@contextlib.asynccontextmanager
async def background(port: int, k: int) -> AsyncIterator[None]:
    """Hold `k` long streams open (read and discarded) while the measurements run."""
    writers: list[asyncio.StreamWriter] = []
    tasks: list[asyncio.Task[None]] = []

    async def drain(reader: asyncio.StreamReader) -> None:
        while await reader.read(65536):
            pass

    for j in range(k):
        reader, writer = await open_request(port, body(10_000 + j, 8000, True))
        writers.append(writer)
        tasks.append(asyncio.create_task(drain(reader)))
    try:
        yield
    finally:
        for w in writers:
            w.transport.abort()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run(samples: int, k: int, model_path: str) -> dict[str, Any]:
    """Every variant, `samples` requests each; latencies in ms."""
    broker, kafka = await start_broker()
    redis_child, redis = await start_redis()
    common: dict[str, Any] = dict(kafka=kafka, redis=redis, redis_prefix="bcancel:", model_path=model_path)
    ws = WorkerSettings(**common, worker_id="bench-cancel-w", speedup=1.0)
    worker = Worker(ws, build_engine(ws), "sim")
    stop = asyncio.Event()
    wtask = asyncio.create_task(worker.run(stop))
    await worker.ready.wait()
    port = free_port()
    app = create_app(FrontendSettings(**common, frontend_id="bench-cancel-fe", port=port))
    server = ReadyServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    stask = asyncio.create_task(server.serve())
    await server.bound.wait()
    fe = app.state.frontend
    await until(lambda: bool(fe.pool.live(MODEL)))
    engine = worker.engine
    results: dict[str, list[list[float]]] = {}
    marks = Marks()
    for name in ("ferry.frontend", "ferry.worker"):
        logging.getLogger(name).addHandler(marks)
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        for load in (0, k):
            async with background(port, load):
                await until(lambda load=load: engine.stats().running == load)
                for stream in (True, False):
                    name = f"{'stream' if stream else 'whole'} / {load} busy"
                    results[name] = [await one(port, engine, i, stream, load, marks) for i in range(samples)]
            await until(lambda: engine.stats().running == 0)
    finally:
        server.should_exit = True
        await stask
        stop.set()
        await wtask
        await redis_child.stop()
        await broker.stop()
    out: dict[str, Any] = {}
    for name, rows in results.items():
        cols = list(zip(*rows, strict=True))
        out[name] = {"n": len(rows), "samples_ms": rows}
        for label, col in zip(("cancel_sent", "cancel_read", "aborted"), cols, strict=True):
            v = [x for x in col if x == x]  # without NaN (a log line not seen)
            if v:
                out[name][label] = {
                    "median_ms": statistics.median(v),
                    "max_ms": max(v),
                    "p90_ms": statistics.quantiles(v, n=10, method="inclusive")[-1],
                }
    return out


def main() -> None:
    """Run, print a table, write bench/results/cancel.json."""
    p = argparse.ArgumentParser(prog="python -m bench.cancel", description=__doc__)
    p.add_argument("--samples", type=int, default=20, help="requests per variant")
    p.add_argument("--background", type=int, default=16, help="long streams running in the busy variants")
    p.add_argument("--model-path", default=default_model_path())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cancel.json")
    args = p.parse_args()
    out = run_cleanly(asyncio.wait_for(run(args.samples, args.background, args.model_path), timeout=600))
    print("ms after the client closed its socket (median / p90 / max)")
    print(
        f"{'variant':<16} {'n':>3}  {'frontend sent Cancel':>22}  {'worker read it':>22}  {'engine aborted':>22}"
    )
    for name, r in out.items():
        cells = [
            f"{c['median_ms']:6.1f} /{c['p90_ms']:6.1f} /{c['max_ms']:6.1f}" if (c := r.get(k)) else "-"
            for k in ("cancel_sent", "cancel_read", "aborted")
        ]
        print(f"{name:<16} {r['n']:>3}  {cells[0]:>22}  {cells[1]:>22}  {cells[2]:>22}")
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "samples": args.samples,
        "background": args.background,
    }
    args.out.write_text(json.dumps({"meta": meta, "results": out}, indent=1))


if __name__ == "__main__":
    main()
