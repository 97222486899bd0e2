"""What a run was measured on, and its table and plot."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.overhead.measure import TARGET_TOKENS_PER_S, TARGET_TPS_CONCURRENCY, TARGET_TTFT_P50_MS

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
        **git_info(Path(__file__).resolve().parents[2]),
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
