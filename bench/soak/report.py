"""What a soak measured, summed per minute, and the issue's targets checked against it."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKENS_RATIO_MIN = 0.95  # last window's tokens/s over the first window's
TTFT_P99_RATIO_MAX = 2.0  # any minute's TTFT p99 over the first minute's
RSS_SLOPE_MAX_MB_PER_MIN = 1.0


@dataclass(slots=True)
class Outcome:
    """One request of the soak; times in seconds since the load started."""

    start: float
    end: float
    ttft: float  # NaN if no token arrived
    ok: bool
    tokens: int
    error: str | None = None


@dataclass(frozen=True)
class Windows:
    """How much of a run the targets compare: the first/last `window_min` minutes, RSS after `settle_min`."""

    window_min: int
    settle_min: int

    @classmethod
    def for_minutes(cls, minutes: float) -> Windows:
        """10 and 10 for a 60-minute run; proportional below (2 and 3 for a 10-minute smoke, 3 and 4 for 15)."""
        if minutes >= 60:
            return cls(10, 10)
        return cls(max(1, round(minutes / 5)), max(1, round(minutes * 0.3)))


def _pct(values: list[float], q: float) -> float | None:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    return round(float(np.percentile(arr, q)) * 1000.0, 1) if arr.size else None


def per_minute(outcomes: list[Outcome], minutes: int) -> list[dict[str, Any]]:
    """Per whole minute of the load: tokens/s and requests by the minute they ended in, TTFT by the minute
    they started in (a stall shows in the minute that caused it)."""
    rows: list[dict[str, Any]] = []
    ended: list[list[Outcome]] = [[] for _ in range(minutes)]
    started: list[list[float]] = [[] for _ in range(minutes)]
    for o in outcomes:
        m_end, m_start = int(o.end // 60), int(o.start // 60)
        if 0 <= m_end < minutes:
            ended[m_end].append(o)
        if 0 <= m_start < minutes and o.ok:
            started[m_start].append(o.ttft)
    for m in range(minutes):
        done = ended[m]
        tokens = sum(o.tokens for o in done if o.ok)
        rows.append(
            {
                "minute": m,
                "requests": len(done),
                "failed": sum(1 for o in done if not o.ok),
                "tokens_per_s": round(tokens / 60.0, 1),
                "ttft_ms": {
                    "p50": _pct(started[m], 50),
                    "p99": _pct(started[m], 99),
                    "max": _pct(started[m], 100),
                },
            }
        )
    return rows


def cpu_per_request(samples: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per minute, CPU milliseconds each process spent per finished request, and the machine's load average.

    Unlike tokens/s, this does not move when other jobs take the cores: a process that does more work per
    request as the run goes on drifts here even on a busy machine."""
    cpu_s: list[dict[str, float]] = [{} for _ in rows]
    load: list[list[float]] = [[] for _ in rows]
    prev_t = 0.0
    for s in samples:
        m = int((s["t"] + prev_t) / 2 // 60)  # the minute the sample's interval mostly lies in
        if 0 <= m < len(rows):
            for role, proc in s["processes"].items():
                cpu_s[m][role] = cpu_s[m].get(role, 0.0) + proc["cpu_pct"] / 100.0 * (s["t"] - prev_t)
            if "loadavg_1m" in s:
                load[m].append(s["loadavg_1m"])
        prev_t = s["t"]
    out: list[dict[str, float]] = []
    for m, row in enumerate(rows):
        n = row["requests"]  # a minute in which no request ended has no CPU per request
        d = {role: round(1000.0 * v / n, 2) for role, v in sorted(cpu_s[m].items())} if n else {}
        if load[m]:
            d["loadavg_1m"] = round(float(np.mean(load[m])), 2)
        out.append(d)
    return out


def add_cpu_per_request(rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` with each minute's CPU milliseconds per request of every process and the load average added."""
    for row, cpu in zip(rows, cpu_per_request(samples, rows), strict=True):
        load = cpu.pop("loadavg_1m", None)
        row["cpu_ms_per_request"] = cpu
        if load is not None:
            row["loadavg_1m"] = load
    return rows


def rss_slopes(samples: list[dict[str, Any]], settle_min: float) -> dict[str, float | None]:
    """Least-squares slope of every process's RSS after `settle_min` minutes, MB per minute."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for s in samples:
        if s["t"] < settle_min * 60.0:
            continue
        for role, proc in s["processes"].items():
            ts, ys = series.setdefault(role, ([], []))
            ts.append(s["t"] / 60.0)
            ys.append(proc["rss_mb"])
    out: dict[str, float | None] = {}
    for role, (ts, ys) in series.items():
        out[role] = round(float(np.polyfit(ts, ys, 1)[0]), 3) if len(ts) >= 3 and max(ts) > min(ts) else None
    return out


def _mean(xs: list[float]) -> float | None:
    return round(float(np.mean(xs)), 1) if xs else None


def targets(
    rows: list[dict[str, Any]], slopes: dict[str, float | None], win: Windows
) -> list[dict[str, Any]]:
    """The issue's four targets over the per-minute rows and the RSS slopes."""
    out: list[dict[str, Any]] = []
    first = _mean([r["tokens_per_s"] for r in rows[: win.window_min]])
    last = _mean([r["tokens_per_s"] for r in rows[-win.window_min :]])
    ratio = round(last / first, 3) if first and last is not None else None
    out.append({"name": f"tokens/s last {win.window_min} min / first {win.window_min} min", "value": ratio,
                "first": first, "last": last, "op": ">=", "target": TOKENS_RATIO_MIN,
                "met": ratio is not None and ratio >= TOKENS_RATIO_MIN})  # fmt: skip
    base = rows[0]["ttft_ms"]["p99"] if rows else None
    p99s = [r["ttft_ms"]["p99"] for r in rows if r["ttft_ms"]["p99"] is not None]
    worst = max(p99s) if p99s else None
    worst_ratio = round(worst / base, 2) if base and worst is not None else None
    over = [r["minute"] for r in rows if base and (r["ttft_ms"]["p99"] or 0) > TTFT_P99_RATIO_MAX * base]
    out.append({"name": "worst minute's TTFT p99 / first minute's", "value": worst_ratio, "first_ms": base,
                "worst_ms": worst, "minutes_over": over, "op": "<=", "target": TTFT_P99_RATIO_MAX,
                "met": worst_ratio is not None and worst_ratio <= TTFT_P99_RATIO_MAX})  # fmt: skip
    known = {k: v for k, v in slopes.items() if v is not None}
    steepest = max(known, key=lambda k: known[k]) if known else None
    out.append({"name": f"steepest RSS slope after minute {win.settle_min} (MB/min)",
                "value": known[steepest] if steepest else None, "process": steepest, "op": "<=",
                "target": RSS_SLOPE_MAX_MB_PER_MIN,
                "met": bool(known) and max(known.values()) <= RSS_SLOPE_MAX_MB_PER_MIN})  # fmt: skip
    failed = sum(r["failed"] for r in rows)
    out.append({"name": "failed requests", "value": failed, "op": "==", "target": 0, "met": failed == 0})
    return out


def stalls(
    outcomes: list[Outcome],
    log: list[tuple[float, str]],
    threshold_s: float,
    around_s: float = 2.0,
    limit: int = 20,
) -> list[dict[str, Any]]:
    """Requests whose first token took over `threshold_s`, merged into episodes, each with the stack's log
    lines from `around_s` before it started to its first token."""
    slow = sorted((o for o in outcomes if o.ok and o.ttft > threshold_s), key=lambda o: o.start)
    episodes: list[dict[str, Any]] = []
    for o in slow:
        if episodes and o.start <= episodes[-1]["until_s"]:
            ep = episodes[-1]
            ep["requests"] += 1
            ep["until_s"] = max(ep["until_s"], o.start + o.ttft)
            ep["worst_ttft_ms"] = max(ep["worst_ttft_ms"], round(o.ttft * 1000.0, 1))
            continue
        episodes.append({"from_s": round(o.start, 2), "until_s": o.start + o.ttft, "requests": 1,
                         "worst_ttft_ms": round(o.ttft * 1000.0, 1)})  # fmt: skip
    for ep in episodes[:limit]:
        lo, hi = ep["from_s"] - around_s, ep["until_s"]
        ep["until_s"] = round(hi, 2)
        ep["log"] = [f"{t:8.2f} {line}" for t, line in log if lo <= t <= hi][:15]
    return episodes[:limit]


def print_summary(doc: dict[str, Any]) -> None:
    """The human-readable part: per-minute rows, RSS slopes, targets."""
    cfg = doc["config"]
    m = doc["machine"]
    print()
    print(f"Soak of {doc.get('system', 'ferry')}: {cfg['engine']} engine, {cfg['workers']} worker(s), {cfg['minutes']:g} min, load {cfg['load']}, "
          f"commit {(m.get('commit') or '?')[:10]}{' (dirty)' if m.get('dirty') else ''}")  # fmt: skip
    print(
        f"{'min':>4}{'req':>7}{'fail':>6}{'tok/s':>9}{'TTFT50':>8}{'TTFT99':>8}{'TTFTmax':>9}"
        "   RSS MB | CPU ms per request, by process"
    )
    by_min: dict[int, dict[str, float]] = {}
    for s in doc["samples"]:
        by_min[int(s["t"] // 60)] = {k: v["rss_mb"] for k, v in s["processes"].items()}

    def f(x: float | None, w: int) -> str:
        return f"{'-':>{w}}" if x is None else f"{x:>{w}.0f}"

    for r in doc["per_minute"]:
        rss = by_min.get(r["minute"], {})
        rss_txt = " ".join(f"{k}={v:.0f}" for k, v in sorted(rss.items()))
        cpu_txt = " ".join(f"{k}={v:.0f}" for k, v in sorted(r.get("cpu_ms_per_request", {}).items()))
        t = r["ttft_ms"]
        print(f"{r['minute']:>4}{r['requests']:>7}{r['failed']:>6}{r['tokens_per_s']:>9.0f}"
              f"{f(t['p50'], 8)}{f(t['p99'], 8)}{f(t['max'], 9)}   {rss_txt} | {cpu_txt}")  # fmt: skip
    slopes = sorted(doc["rss_slope_mb_per_min"].items())
    slope_txt = ", ".join(f"{k} {v:+.2f}" if v is not None else f"{k} -" for k, v in slopes)
    print(f"RSS slope after minute {doc['windows']['settle_min']} (MB/min): {slope_txt}")
    cpu = doc.get("cpu_percent_mean") or {}
    print(
        "CPU % of one core, mean over the run: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items()))
    )
    if doc.get("stack_exited_at_s") is not None:
        print(
            f"WARNING: {doc.get('system', 'ferry')} exited {doc['stack_exited_at_s']:.0f} s into the load; "
            "the load stopped there"
        )
    for t in doc["targets"]:
        print(
            f"target {t['name']}: {t['value']} (want {t['op']} {t['target']}) -> {'MET' if t['met'] else 'MISSED'}"
        )
    if doc.get("stalls"):
        print(f"{len(doc['stalls'])} stall episode(s) (TTFT > {doc['config']['stall_ms']:g} ms); first ones:")
        for ep in doc["stalls"][:5]:
            print(
                f"  at {ep['from_s']:.1f} s: {ep['requests']} request(s), worst TTFT {ep['worst_ttft_ms']:.0f} ms"
            )
            for line in ep["log"][:4]:
                print(f"      {line[:160]}")


def plot(docs: dict[str, dict[str, Any]], path: Path) -> bool:
    """Three panels over time, one line per system: tokens/s and TTFT per minute, RSS of every process."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (`make bench-setup`); no plot drawn", file=sys.stderr)
        return False
    several = len(docs) > 1
    fig, ax = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    for k, (system, doc) in enumerate(docs.items()):
        rows = doc["per_minute"]
        mins = [r["minute"] + 0.5 for r in rows]
        color = f"C{k}"
        prefix = f"{system} " if several else ""
        ax[0].plot(mins, [r["tokens_per_s"] for r in rows], "o-", color=color, label=system)
        ax[1].plot(
            mins, [r["ttft_ms"]["p99"] or math.nan for r in rows], "o-", color=color, label=f"{prefix}p99"
        )
        ax[1].plot(mins, [r["ttft_ms"]["p50"] or math.nan for r in rows], "s--", color=color, alpha=0.6,
                   label=f"{prefix}p50")  # fmt: skip
        if rows and rows[0]["ttft_ms"]["p99"]:
            ax[1].axhline(TTFT_P99_RATIO_MAX * rows[0]["ttft_ms"]["p99"], color=color, lw=1, ls=":",
                          label=f"{prefix}2x first minute's p99")  # fmt: skip
        roles = sorted({r for s in doc["samples"] for r in s["processes"]})
        for role in roles:
            pts = [
                (s["t"] / 60.0, s["processes"][role]["rss_mb"])
                for s in doc["samples"]
                if role in s["processes"]
            ]
            ax[2].plot([p[0] for p in pts], [p[1] for p in pts], label=role if role == system else f"{prefix}{role}",
                       ls="-" if k == 0 else "--")  # fmt: skip
    ax[0].set_ylabel("tokens/s (per minute)")
    ax[0].set_ylim(bottom=0)
    if several:
        ax[0].legend()
    ax[1].set_ylabel("TTFT (ms)")
    ax[1].set_yscale("log")
    ax[1].legend(fontsize=8)
    ax[2].set_ylabel("RSS (MB)")
    ax[2].set_xlabel("minutes since the load started")
    ax[2].legend(fontsize=8)
    first = next(iter(docs.values()))
    cfg = first["config"]
    fig.suptitle(f"bench.soak: {' vs '.join(docs)}, {cfg['engine']}, {cfg['workers']} worker(s), load {cfg['load']}, "
                 f"commit {(first['machine'].get('commit') or '?')[:10]}")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
