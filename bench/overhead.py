"""The system's own cost: what Ferry adds to a request when the engine takes no time at all.

`python -m bench.overhead` starts `ferry up` on a free loopback port with the simulated engine sped up so
far (`--speedup 1e6`) that engine time is ~0, then measures, through one frontend:

- time to first token (p50/p90/p99), inter-token latency (p50/p99, the gap between SSE events carrying
  text) and streamed tokens per second (from the `usage` chunk; `ignore_eos` makes every request generate
  exactly `--max-tokens`) at each concurrency level; every level stops after `--requests-per-level`
  requests or `--level-seconds`, whichever comes first;
- the floor to compare with: a produce -> consume round trip through the same Kafka broker (aiokafka);
- whether tokenizing huge prompts stalls other streams: the same concurrency-16 streaming load twice, once
  alone and once while another client keeps sending ~100k-character prompts to /v1/completions.

Each phase runs on a fresh `ferry up` (`--reuse-stack` shares one): Tansu's per-record cost grows with the
length of a partition, so a shared broker would make later phases pay for the records of earlier ones. The
CPU of every stack process, of this client and of the rest of the machine is recorded per phase.

It prints a table, writes JSON (with the machine, Python version and git commit) and draws a PNG plot when
matplotlib is installed (an optional benchmark dependency: `pip install matplotlib`). `--profile DIR`
also samples the frontend and workers with py-spy during the busiest level (this perturbs the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import random
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.sse_client import Connection, Response, StreamStats, stream_stats
from bench.stack import CpuUsage, FerryStack
from schemas.names import reply_topic

TARGET_TTFT_P50_MS = 5.0  # added time to first token at concurrency 1 (issue 2, item 8)
TARGET_TOKENS_PER_S = 5000.0  # streamed tokens/s through one frontend at concurrency 64
TARGET_TPS_CONCURRENCY = 64
INTERFERENCE_CONCURRENCY = 16
REQUEST_TIMEOUT_S = 60.0

_WORDS = (
    "ferry harbour tide rope deck cargo engine captain island bridge wave north south lantern anchor "
    "gull signal crossing timetable passenger ticket vehicle ramp storm calm morning evening river"
).split()


# ---- statistics ----------------------------------------------------------------------------------


def pct(values: Iterable[float], q: float) -> float:
    """The q-th percentile (linear interpolation); NaN for no values."""
    arr = np.fromiter((v for v in values if not math.isnan(v)), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan


def ms(seconds: float) -> float | None:
    """Seconds to milliseconds rounded for reports; None (JSON null) for NaN."""
    return None if math.isnan(seconds) else round(seconds * 1000.0, 3)


@dataclass
class PhaseResult:
    """One measured phase: many streamed requests at a fixed concurrency."""

    name: str
    concurrency: int
    stats: list[StreamStats]
    wall_s: float
    cpu: CpuUsage | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> list[StreamStats]:
        """Requests that streamed to the end with usage."""
        return [s for s in self.stats if s.ok]

    @property
    def tokens(self) -> int:
        """Completion tokens of the successful requests."""
        return sum(s.completion_tokens for s in self.ok)

    @property
    def tokens_per_s(self) -> float:
        """Streamed tokens per second of wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    def ttft(self, q: float) -> float:
        """Percentile of time to first token, seconds."""
        return pct((s.ttft for s in self.ok), q)

    def ttfb(self, q: float) -> float:
        """Percentile of time to the first SSE event (the role chunk), seconds."""
        return pct((s.ttfb for s in self.ok), q)

    def itl(self, q: float) -> float:
        """Percentile of the gaps between text-carrying events, pooled over all requests, seconds."""
        return pct((x for s in self.ok for x in s.itls), q)

    def summary(self, max_tokens: int) -> dict[str, Any]:
        """The phase as a JSON-ready dict."""
        ok = self.ok
        errors = Counter(s.error or f"HTTP {s.status}" for s in self.stats if not s.ok)
        short = sum(1 for s in ok if s.completion_tokens != max_tokens)
        events = [s.content_events for s in ok]
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "requests": len(self.stats),
            "ok": len(ok),
            "failed": len(self.stats) - len(ok),
            "errors": dict(errors.most_common(5)),
            "completion_tokens_not_max_tokens": short,
            "wall_s": round(self.wall_s, 3),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "requests_per_s": round(len(ok) / self.wall_s, 2) if self.wall_s > 0 else None,
            "ttfb_ms": {"p50": ms(self.ttfb(50)), "p99": ms(self.ttfb(99))},
            "ttft_ms": {"p50": ms(self.ttft(50)), "p90": ms(self.ttft(90)), "p99": ms(self.ttft(99))},
            "itl_ms": {"p50": ms(self.itl(50)), "p90": ms(self.itl(90)), "p99": ms(self.itl(99))},
            "itl_samples": sum(len(s.itls) for s in ok),
            "content_events_per_request": round(float(np.mean(events)), 2) if events else None,
            "tokens_per_content_event": round(self.tokens / sum(events), 2) if sum(events) else None,
            "e2e_ms": {
                "p50": ms(pct((s.duration for s in ok), 50)),
                "p99": ms(pct((s.duration for s in ok), 99)),
            },
            "cpu": self.cpu.to_json() if self.cpu else None,
            **self.extra,
        }


# ---- load generation -----------------------------------------------------------------------------


def chat_body(model: str, max_tokens: int, i: int) -> bytes:
    """A short streamed chat request that generates exactly `max_tokens` tokens."""
    return msgspec.json.encode(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell me about ferry crossing number {i}."}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    )


async def run_streams(
    host: str,
    port: int,
    concurrency: int,
    max_requests: int,
    seconds: float,
    body: Callable[[int], bytes],
) -> tuple[list[StreamStats], float]:
    """`concurrency` users, each streaming one request after another on its own keep-alive connection.

    New requests stop once `max_requests` were issued or `seconds` passed; requests in flight then finish.
    Returns the per-request stats and the wall time from the first request to the last response.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + seconds
    issued = 0
    stats: list[StreamStats] = []
    last_end = t0

    async def user() -> None:
        nonlocal issued, last_end
        conn = Connection(host, port)
        try:
            while issued < max_requests and loop.time() < deadline:
                issued += 1
                payload = body(issued)
                started = time.perf_counter()
                try:
                    resp = await conn.post_json("/v1/chat/completions", payload, REQUEST_TIMEOUT_S)
                    stats.append(stream_stats(resp))
                except (OSError, TimeoutError) as exc:
                    nan = math.nan
                    elapsed = time.perf_counter() - started
                    stats.append(StreamStats(0, False, nan, nan, [], elapsed, 0, 0, 0, repr(exc)))
                last_end = loop.time()
        finally:
            conn.close()

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return stats, last_end - t0


def long_prompts(chars: int, variants: int, seed: int = 7) -> list[str]:
    """Distinct prose-like prompts of about `chars` characters each."""
    rng = random.Random(seed)
    out = []
    for v in range(variants):
        words: list[str] = [f"variant{v}"]
        size = 0
        while size < chars:
            w = rng.choice(_WORDS)
            words.append(w)
            size += len(w) + 1
        out.append(" ".join(words)[:chars])
    return out


async def long_prompt_load(
    host: str, port: int, model: str, prompts: list[str], clients: int, stop: asyncio.Event
) -> list[tuple[int, float]]:
    """Keep sending non-streamed /v1/completions with huge prompts (max_tokens 1) until `stop` is set."""
    bodies = [msgspec.json.encode({"model": model, "prompt": p, "max_tokens": 1}) for p in prompts]
    results: list[tuple[int, float]] = []

    async def client(k: int) -> None:
        conn = Connection(host, port)
        i = k
        try:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    resp = await conn.post_json("/v1/completions", bodies[i % len(bodies)], REQUEST_TIMEOUT_S)
                    results.append((resp.status, resp.finished - resp.started))
                except (OSError, TimeoutError):
                    results.append((0, time.perf_counter() - t))
                i += clients
        finally:
            conn.close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return results


# ---- the Kafka floor -----------------------------------------------------------------------------


async def kafka_floor(bootstrap: str, n: int, fetch_wait_ms: int, payload_bytes: int = 200) -> dict[str, Any]:
    """Produce -> consume round trips of one small record at a time through `bootstrap`.

    Producer and consumer are configured as the frontend's and workers' are (linger 0, the same fetch
    wait), so this is the least one Kafka hop of a request can cost. Two series: back to back (the consumer
    has just re-issued its fetch, as on a busy reply topic) and after 10 ms of quiet (the consumer is parked
    in a long poll, as an idle worker's inbox is when a request arrives). Also times produce -> ack.
    """
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = f"ferry.bench.floor.{secrets.token_hex(4)}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=fetch_wait_ms
    )
    await producer.start()
    await consumer.start()
    pad = b"x" * max(0, payload_bytes - 8)
    seq = 0

    async def round_trips(count: int, gap_s: float) -> list[float]:
        nonlocal seq
        out = []
        for _ in range(count):
            if gap_s:
                await asyncio.sleep(gap_s)
            seq += 1
            value = seq.to_bytes(8, "little") + pad
            t0 = time.perf_counter()
            await producer.send(topic, value, key=b"k")
            while (await consumer.getone()).value != value:
                pass
            out.append(time.perf_counter() - t0)
        return out

    def dist(xs: list[float]) -> dict[str, Any]:
        d: dict[str, Any] = {f"p{q}": ms(pct(xs, q)) for q in (50, 90, 99)}
        d["share_over_10ms"] = round(sum(1 for x in xs if x > 0.010) / len(xs), 3) if xs else None
        return d

    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        await round_trips(20, 0.0)  # warm-up
        hot = await round_trips(n, 0.0)
        idle = await round_trips(n, 0.010)
        ack = []
        for i in range(n):
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, b"a" * payload_bytes, key=str(i).encode())
            ack.append(time.perf_counter() - t0)
    finally:
        await consumer.stop()
        await producer.stop()
    return {
        "fetch_max_wait_ms": fetch_wait_ms,
        "round_trips_per_series": n,
        "payload_bytes": payload_bytes,
        "produce_consume_ms": dist(hot),
        "produce_consume_after_idle_ms": dist(idle),
        "produce_ack_ms": {f"p{q}": ms(pct(ack, q)) for q in (50, 99)},
    }


# ---- py-spy --------------------------------------------------------------------------------------


def py_spy_binary() -> str | None:
    """py-spy next to this interpreter, else on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


async def py_spy_record(pids: dict[str, int], seconds: float, out_dir: Path, tag: str) -> list[Path]:
    """Sample every named process for `seconds` with py-spy, writing collapsed stacks (`--format raw`)."""
    exe = py_spy_binary()
    if exe is None:
        print("py-spy not found; install it with `pip install py-spy` to use --profile", file=sys.stderr)
        return []
    procs = []
    paths = []
    for name, pid in pids.items():
        if name in ("kafka", "redis"):
            continue
        path = out_dir / f"{name}-{tag}.txt"
        argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "200",
                "--nonblocking", "--format", "raw", "--output", str(path)]  # fmt: skip
        procs.append(
            await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
        )
        paths.append(path)
    await asyncio.gather(*(p.wait() for p in procs))
    return [p for p in paths if p.exists()]


def hotspots(path: Path, top: int = 12) -> dict[str, Any]:
    """Self and inclusive sample shares per frame (`function (file:line)`) of a py-spy raw profile."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        self_counts[frames[-1]] += n
        for f in set(frames):
            incl_counts[f] += n

    def share(c: Counter[str], keep: Callable[[str], bool]) -> list[tuple[str, float]]:
        return [(f, round(100.0 * k / total, 1)) for f, k in c.most_common() if keep(f)][:top]

    ours = ("server/", "workers/", "schemas/", "kvstore/")
    return {
        "samples": total,
        "self_percent": share(self_counts, lambda f: True),
        "inclusive_percent_project_code": share(incl_counts, lambda f: any(p in f for p in ours)),
    }


# ---- report --------------------------------------------------------------------------------------


def git_info(repo: Path) -> dict[str, Any]:
    """Commit of the checkout and whether tracked files differ from it."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        mem_gb = round(mem_kb / 1024 / 1024, 1)
    versions = {}
    for pkg in ("aiokafka", "uvicorn", "uvloop", "starlette", "msgspec", "tokenizers"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[pkg] = version(pkg)
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "memory_gb": mem_gb,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "packages": versions,
        **git_info(Path(__file__).resolve().parent.parent),
    }


async def busy_percent(seconds: float) -> float:
    """CPU in use on the whole machine over `seconds` (percent of one core), this process excluded."""
    from bench.stack import machine_busy_seconds

    m0, p0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - t0
    return round(100.0 * ((machine_busy_seconds() - m0) - (time.process_time() - p0)) / wall, 1)


def _f(x: float | None, width: int = 8, digits: int = 2) -> str:
    return (
        f"{'-':>{width}}"
        if x is None or (isinstance(x, float) and math.isnan(x))
        else f"{x:>{width}.{digits}f}"
    )


def print_table(results: dict[str, Any]) -> None:
    """The human-readable summary."""
    floor = results["kafka_floor"]["produce_consume_ms"]
    m = results["machine"]
    print()
    print(
        f"Ferry overhead, engine time ~0 (sim --speedup {results['config']['speedup']:g}), "
        f"max_tokens {results['config']['max_tokens']}, {results['config']['workers']} worker(s), "
        f"{m['nproc']} CPUs, Python {m['python']}, commit {(m['commit'] or '?')[:10]}{' (dirty)' if m['dirty'] else ''}"
    )
    kf = results["kafka_floor"]
    idle = kf["produce_consume_after_idle_ms"]
    print(
        f"Kafka floor, one produce->consume hop on the same broker (fetch_max_wait_ms {kf['fetch_max_wait_ms']}): "
        f"back to back p50 {_f(floor['p50'], 0)} / p90 {_f(floor['p90'], 0)} / p99 {_f(floor['p99'], 0)} ms; "
        f"after 10 ms idle p50 {_f(idle['p50'], 0)} / p90 {_f(idle['p90'], 0)} / p99 {_f(idle['p99'], 0)} ms; "
        f"produce->ack p50 {_f(kf['produce_ack_ms']['p50'], 0)} ms"
    )
    print()
    head = (
        f"{'phase':<22}{'conc':>5}{'ok':>6}{'fail':>5}{'TTFB50':>8}{'TTFT50':>8}{'TTFT90':>8}{'TTFT99':>8}{'feTTFT':>8}"
        f"{'ITL50':>8}{'ITL99':>8}{'ITLn':>7}{'tok/s':>9}{'tok/ev':>7}"
        f"{'cpu% fe':>8}{'wk':>5}{'kafka':>6}{'client':>7}{'other':>6}"
    )
    print(head)
    print("-" * len(head))
    for p in [*results["levels"], *(results.get("interference") or {}).get("phases", [])]:
        cpu = p.get("cpu") or {}
        procs = cpu.get("percent_of_one_core", {})
        wk = sum(v for k, v in procs.items() if k.startswith("worker"))
        print(
            f"{p['name']:<22}{p['concurrency']:>5}{p['ok']:>6}{p['failed']:>5}"
            f"{_f(p['ttfb_ms']['p50'])}{_f(p['ttft_ms']['p50'])}{_f(p['ttft_ms']['p90'])}{_f(p['ttft_ms']['p99'])}"
            f"{_f((p.get('frontend_metrics_mean_ms') or {}).get('ttft'))}"
            f"{_f(p['itl_ms']['p50'])}{_f(p['itl_ms']['p99'])}{p['itl_samples']:>7}{_f(p['tokens_per_s'], 9, 0)}"
            f"{_f(p['tokens_per_content_event'], 7, 1)}"
            f"{_f(procs.get('frontend'), 8, 0)}{_f(wk, 5, 0)}{_f(procs.get('kafka'), 6, 0)}"
            f"{_f(cpu.get('bench_client'), 7, 0)}{_f(cpu.get('other_processes'), 6, 0)}"
        )
    print(
        "(times in ms; TTFB = first SSE event (role chunk); feTTFT = the frontend's own mean TTFT (request in ->"
        " first token chunk from Kafka); ITL = gap between SSE events carrying text, pooled;"
    )
    print(
        " tok/ev = tokens per text event; cpu% = percent of one core, 'other' = processes outside this benchmark)"
    )
    inter = results.get("interference")
    if inter:
        lp = inter["long_prompts"]
        print()
        print(
            f"Tokenization interference at concurrency {inter['concurrency']}: ITL p99 "
            f"{_f(inter['itl_p99_ms_quiet'], 0)} ms alone vs {_f(inter['itl_p99_ms_loaded'], 0)} ms with "
            f"{lp['requests']} long prompts ({lp['chars']} chars, {lp['requests_per_s']:.1f}/s, "
            f"statuses {lp['statuses']}, latency p50 {_f(lp['latency_ms']['p50'], 0)} ms; "
            f"tokenizing one takes {_f(lp['tokenize_ms_in_process'], 0)} ms)"
        )
    print()
    for t in results["targets"]:
        verdict = "MET" if t["met"] else "MISSED"
        print(f"target {t['name']}: {t['value']} {t['unit']} (want {t['op']} {t['target']}) -> {verdict}")
    r = results["ratios_vs_kafka_floor"]

    def x(v: float | None) -> str:
        return "n/a" if v is None else f"{v}x"

    print(
        f"vs Kafka floor p50 (back to back): TTFT p50 at c=1 is {x(r['ttft_p50_c1'])} one hop (a request makes "
        f"two hops), ITL p50 at c=1 is {x(r['itl_p50_c1'])}"
    )
    busy = m.get("busy_before_start_percent")
    if busy is not None and busy > 20:
        print(
            f"WARNING: the machine was busy before the run ({busy:.0f}% of one core in use by other processes)"
        )


def plot(results: dict[str, Any], path: Path) -> bool:
    """Four panels: TTFT, ITL and tokens/s against concurrency, and the tokenization interference."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed (optional: pip install matplotlib); no plot drawn", file=sys.stderr
        )
        return False
    levels = results["levels"]
    conc = [p["concurrency"] for p in levels]
    floor = results["kafka_floor"]["produce_consume_ms"]["p50"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))

    def series(key: str, q: str) -> list[float]:
        return [p[key][q] if p[key][q] is not None else math.nan for p in levels]

    a = ax[0][0]
    for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
        a.plot(conc, series("ttft_ms", q), style, label=f"TTFT {q}")
    a.axhline(TARGET_TTFT_P50_MS, color="red", lw=1, label=f"target p50 @c=1 ({TARGET_TTFT_P50_MS:g} ms)")
    idle_p90 = results["kafka_floor"]["produce_consume_after_idle_ms"]["p90"]
    if floor:
        a.axhline(floor, color="gray", lw=1, ls="--", label=f"Kafka hop p50 ({floor:.2f} ms)")
    if idle_p90:
        a.axhline(idle_p90, color="gray", lw=1, ls=":", label=f"Kafka hop p90 after idle ({idle_p90:.1f} ms)")
    a.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="Time to first token")
    a.set_xticks(conc, [str(c) for c in conc])
    a.legend(fontsize=8)

    a = ax[0][1]
    for q, style in (("p50", "o-"), ("p99", "^:")):
        a.plot(conc, series("itl_ms", q), style, label=f"ITL {q}")
    if floor:
        a.axhline(floor, color="gray", lw=1, ls="--", label="Kafka hop p50")
    a.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms",
          title="Inter-token latency (gap between text events)")  # fmt: skip
    a.set_xticks(conc, [str(c) for c in conc])
    a.legend(fontsize=8)

    a = ax[1][0]
    tps = [p["tokens_per_s"] for p in levels]
    a.bar([str(c) for c in conc], tps, color="tab:blue")
    a.axhline(TARGET_TOKENS_PER_S, color="red", lw=1, label=f"target @c={TARGET_TPS_CONCURRENCY}")
    for i, v in enumerate(tps):
        a.annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    a.set(xlabel="concurrent streams", ylabel="tokens/s", title="Streamed tokens/s through one frontend")
    a.legend(fontsize=8)

    a = ax[1][1]
    inter = results.get("interference")
    if inter:
        quiet, loaded = inter["phases"]
        labels = ["ITL p50", "ITL p99", "TTFT p50", "TTFT p99"]
        get = [("itl_ms", "p50"), ("itl_ms", "p99"), ("ttft_ms", "p50"), ("ttft_ms", "p99")]
        x = np.arange(len(labels))
        a.bar(x - 0.2, [quiet[k][q] or 0 for k, q in get], 0.4, label="streams alone")
        a.bar(x + 0.2, [loaded[k][q] or 0 for k, q in get], 0.4, label="+ 100k-char prompts")
        a.set_xticks(x, labels)
        a.set(ylabel="ms", title=f"Tokenization load, {inter['concurrency']} streams")
        a.legend(fontsize=8)
    else:
        a.axis("off")
    m = results["machine"]
    fig.suptitle(
        f"Ferry overhead (sim speedup {results['config']['speedup']:g}, max_tokens "
        f"{results['config']['max_tokens']}, {m['nproc']} CPUs, commit {(m['commit'] or '?')[:10]})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the run -------------------------------------------------------------------------------------


async def measure(
    stack: FerryStack, name: str, concurrency: int, args: argparse.Namespace, model: str, seconds: float
) -> PhaseResult:
    """One streaming phase with CPU accounting and the frontend's own timings over the same span."""
    metrics_before = await scrape_metrics(stack)
    before = stack.snapshot()
    stats, wall = await run_streams(
        stack.host, stack.port, concurrency, args.requests_per_level, seconds,
        functools.partial(chat_body, model, args.max_tokens),
    )  # fmt: skip
    cpu = stack.usage(before, stack.snapshot())
    server = server_means(metrics_before, await scrape_metrics(stack))
    return PhaseResult(name, concurrency, stats, wall, cpu, {"frontend_metrics_mean_ms": server})


# Histograms of the frontend whose mean over a phase is reported next to the client's view.
_SERVER_HISTOGRAMS = {
    "ttft": "ferry_time_to_first_token_seconds",
    "kafka_produce": "ferry_kafka_produce_seconds",
    "tokenize": "ferry_tokenize_seconds",
}


async def scrape_metrics(stack: FerryStack) -> dict[str, float]:
    """`_sum` and `_count` samples of the frontend's Prometheus metrics, summed over their labels (such as
    `model`); empty if unavailable."""
    conn = Connection(stack.host, stack.port)
    try:
        resp = await conn.request("GET", "/metrics", timeout_s=10)
    except (OSError, TimeoutError):
        return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in resp.body.decode(errors="replace").splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        if name.endswith(("_sum", "_count")):
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
    return out


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean of each frontend histogram over the samples taken between two scrapes, in ms."""
    means: dict[str, float | None] = {}
    for key, metric in _SERVER_HISTOGRAMS.items():
        n = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        total = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
        means[key] = round(1000.0 * total / n, 3) if n > 0 else None
    return means


async def served_model(stack: FerryStack) -> tuple[str, str | None]:
    """Name and directory of the model the frontend serves."""
    conn = Connection(stack.host, stack.port)
    try:
        resp: Response = await conn.request("GET", "/v1/models", timeout_s=10)
    finally:
        conn.close()
    card = json.loads(resp.body)["data"][0]
    return card["id"], card.get("root")


def tokenize_ms(model_dir: str | None, text: str) -> float:
    """Wall time of tokenizing `text` once with the model's tokenizer, in this process."""
    if not model_dir:
        return math.nan
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.encode("warm up")
    t = time.perf_counter()
    tok.encode(text)
    return (time.perf_counter() - t) * 1000.0


@dataclass(frozen=True)
class Phase:
    """One measured phase of the run."""

    name: str
    concurrency: int
    seconds: float
    long_prompts: bool = False  # a second client keeps sending huge prompts meanwhile
    profile_tag: str | None = None  # sample the stack with py-spy under this tag (--profile only)


def plan(args: argparse.Namespace) -> tuple[list[Phase], list[Phase]]:
    """The concurrency levels, then the tokenization-interference pair."""
    top = max(args.concurrency)
    levels = [
        Phase(f"streams c={c}", c, args.level_seconds, profile_tag=f"c{c}" if c == top else None)
        for c in args.concurrency
    ]
    pair: list[Phase] = []
    if args.interference_seconds > 0:
        c = INTERFERENCE_CONCURRENCY
        pair = [
            Phase(f"c={c} alone", c, args.interference_seconds),
            Phase(
                f"c={c} + long prompts",
                c,
                args.interference_seconds,
                long_prompts=True,
                profile_tag="tokenize",
            ),
        ]
    return levels, pair


async def topic_records(bootstrap: str, topic: str) -> int | None:
    """How many records partition 0 of `topic` holds (its end offset)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        await consumer.start()
        tp = TopicPartition(topic, 0)
        return int((await consumer.end_offsets([tp]))[tp])
    except Exception:
        return None
    finally:
        await consumer.stop()


async def run_phase(
    args: argparse.Namespace, phase: Phase, stack: FerryStack, model: str, model_dir: str | None
) -> tuple[PhaseResult, dict[str, Any]]:
    """Measure one phase on a running stack; returns its result and any py-spy profiles."""
    print(f"{phase.name} ({phase.seconds:g} s) ...", file=sys.stderr)
    profiles: dict[str, Any] = {}
    stop = asyncio.Event()
    load = None
    prompts: list[str] = []
    if phase.long_prompts:
        prompts = long_prompts(args.long_prompt_chars, 4)
        load = asyncio.ensure_future(
            long_prompt_load(stack.host, stack.port, model, prompts, args.long_prompt_clients, stop)
        )
        await asyncio.sleep(0.2)
    spy = None
    if args.profile and phase.profile_tag:
        spy = asyncio.ensure_future(
            py_spy_record(stack.pids, phase.seconds * 0.8, args.profile, phase.profile_tag)
        )
    try:
        result = await measure(stack, phase.name, phase.concurrency, args, model, phase.seconds)
    finally:
        stop.set()
        lp = await load if load is not None else []
    if spy is not None:
        for path in await spy:
            profiles[path.name] = {"file": str(path), **hotspots(path)}
    result.extra["reply_topic_records_after"] = await topic_records(stack.kafka, reply_topic("frontend-0"))
    if phase.long_prompts:
        lat = [t for _, t in lp]
        result.extra["long_prompts"] = {
            "chars": args.long_prompt_chars,
            "clients": args.long_prompt_clients,
            "endpoint": "/v1/completions (max_tokens 1)",
            "requests": len(lp),
            "requests_per_s": round(len(lp) / result.wall_s, 2) if result.wall_s else 0.0,
            "statuses": dict(Counter(str(s) for s, _ in lp)),
            "latency_ms": {"p50": ms(pct(lat, 50)), "p99": ms(pct(lat, 99))},
            "tokenize_ms_in_process": round(tokenize_ms(model_dir, prompts[0]), 2),
        }
    return result, profiles


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every phase, each on a fresh `ferry up` unless --reuse-stack; returns the results document."""
    from workers.sim_timing import decode_ms, prefill_ms

    machine = machine_info()
    machine["busy_before_start_percent"] = await busy_percent(1.0)
    level_phases, pair_phases = plan(args)
    results: list[PhaseResult] = []
    profiles: dict[str, Any] = {}
    floor: dict[str, Any] = {}
    stack: FerryStack | None = None
    model, model_dir = "", None
    try:
        for phase in [*level_phases, *pair_phases]:
            if stack is None or not args.reuse_stack:
                if stack is not None:
                    await stack.stop()
                    stack = None
                t0 = time.perf_counter()
                stack = await FerryStack.start(args.workers, args.speedup)
                print(
                    f"ferry up ready in {time.perf_counter() - t0:.1f} s at {stack.url}; kafka {stack.kafka}; "
                    f"processes {stack.pids}",
                    file=sys.stderr,
                )
                model, model_dir = await served_model(stack)
                if not floor:  # on a fresh broker, before any load
                    print("kafka floor ...", file=sys.stderr)
                    floor = await kafka_floor(stack.kafka, args.floor_round_trips, args.floor_fetch_wait_ms)
                # Connections, topics, code paths: warm, not measured.
                await run_streams(
                    stack.host, stack.port, 4, 40, 3.0, functools.partial(chat_body, model, args.max_tokens)
                )
            result, prof = await run_phase(args, phase, stack, model, model_dir)
            results.append(result)
            profiles.update(prof)
    finally:
        if stack is not None:
            print("stopping ferry up ...", file=sys.stderr)
            await stack.stop()

    levels = results[: len(level_phases)]
    interference: dict[str, Any] | None = None
    if pair_phases:
        quiet, loaded = results[len(level_phases) :]
        interference = {
            "concurrency": INTERFERENCE_CONCURRENCY,
            "phases": [quiet.summary(args.max_tokens), loaded.summary(args.max_tokens)],
            "itl_p99_ms_quiet": ms(quiet.itl(99)),
            "itl_p99_ms_loaded": ms(loaded.itl(99)),
            "long_prompts": loaded.extra["long_prompts"],
        }
    summaries = [p.summary(args.max_tokens) for p in levels]
    by_c = {p["concurrency"]: p for p in summaries}
    targets = []
    if 1 in by_c and by_c[1]["ttft_ms"]["p50"] is not None:
        v = by_c[1]["ttft_ms"]["p50"]
        targets.append({"name": "added TTFT p50 at concurrency 1", "value": v, "unit": "ms", "op": "<=",
                        "target": TARGET_TTFT_P50_MS, "met": v <= TARGET_TTFT_P50_MS})  # fmt: skip
    if TARGET_TPS_CONCURRENCY in by_c:
        v = by_c[TARGET_TPS_CONCURRENCY]["tokens_per_s"]
        targets.append({"name": f"streamed tokens/s at concurrency {TARGET_TPS_CONCURRENCY}", "value": v,
                        "unit": "tokens/s", "op": ">=", "target": TARGET_TOKENS_PER_S,
                        "met": v >= TARGET_TOKENS_PER_S})  # fmt: skip
    floor_p50 = floor["produce_consume_ms"]["p50"] or math.nan

    def ratio(x: float | None) -> float | None:
        return None if x is None or math.isnan(floor_p50) else round(x / floor_p50, 2)

    c1 = by_c.get(1) or (summaries[0] if summaries else {"ttft_ms": {"p50": None}, "itl_ms": {"p50": None}})
    engine_ms = (prefill_ms(32) + args.max_tokens * decode_ms(0.0)) / args.speedup
    return {
        "benchmark": "overhead",
        "command": " ".join(["python -m bench.overhead", *sys.argv[1:]]),
        "machine": machine,
        "config": {
            "workers": args.workers,
            "speedup": args.speedup,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "requests_per_level": args.requests_per_level,
            "level_seconds": args.level_seconds,
            "interference_seconds": args.interference_seconds,
            "fresh_stack_per_phase": not args.reuse_stack,
            "simulated_engine_ms_per_request": engine_ms,
            "client": "bench.sse_client (asyncio.Protocol on uvloop, one keep-alive connection per stream)",
        },
        "kafka_floor": floor,
        "levels": summaries,
        "interference": interference,
        "targets": targets,
        "ratios_vs_kafka_floor": {
            "ttft_p50_c1": ratio(c1["ttft_ms"]["p50"]),
            "itl_p50_c1": ratio(c1["itl_ms"]["p50"]),
        },
        "profiles": profiles or None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--concurrency", default="1,16,64", help="comma-separated concurrency levels (default 1,16,64)"
    )
    p.add_argument(
        "--requests-per-level", type=int, default=3000, help="most requests per level (default 3000)"
    )
    p.add_argument("--level-seconds", type=float, default=20.0, help="most seconds per level (default 20)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens every request generates (default 128)")
    p.add_argument("--workers", type=int, default=1, help="sim workers behind the frontend (default 1)")
    p.add_argument("--speedup", type=float, default=1e6, help="sim speedup; 1e6 makes engine time ~0")
    p.add_argument(
        "--floor-round-trips", type=int, default=200, help="Kafka floor samples per series (default 200)"
    )
    p.add_argument("--floor-fetch-wait-ms", type=int, default=100,
                   help="consumer fetch_max_wait_ms of the floor; match the frontend's and workers' (default 100)")  # fmt: skip
    p.add_argument("--interference-seconds", type=float, default=15.0,
                   help="seconds of each tokenization-interference phase; 0 skips it (default 15)")  # fmt: skip
    p.add_argument("--long-prompt-chars", type=int, default=100_000, help="size of the long prompts")
    p.add_argument("--long-prompt-clients", type=int, default=1, help="clients sending long prompts")
    p.add_argument("--reuse-stack", action="store_true",
                   help="run every phase on one `ferry up` instead of a fresh one per phase")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/overhead.json"), help="JSON results file")
    p.add_argument(
        "--plot", type=Path, default=Path("bench/results/overhead.png"), help="PNG plot ('' = none)"
    )
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for py-spy profiles of the frontend and workers during the busiest level "
                        "and the interference phase (perturbs the numbers)")  # fmt: skip
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its outputs."""
    import uvloop

    args = parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    results = uvloop.run(run(args))
    print_table(results)
    if results.get("profiles"):
        print()
        for name, prof in results["profiles"].items():
            print(f"py-spy {name} ({prof['samples']} samples), top self time:")
            for frame, share in prof["self_percent"][:8]:
                print(f"  {share:5.1f}%  {frame}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}", end="")
    if str(args.plot) and str(args.plot) != "." and plot(results, args.plot):
        print(f" and {args.plot}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
