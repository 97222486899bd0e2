"""The routing benchmark's table and plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pct(x: float | None) -> str:
    return _f(None if x is None else 100 * x, "{:.1f}")


def table(results: dict[str, Any]) -> str:
    """All runs, systems side by side per workload and rate, then the targets."""
    cfg = results["config"]
    k = cfg["engine"]
    lines = [
        f"Routing: {k['workers']} simulated workers, block {k['block_size']}, {k['num_blocks']} KV blocks each, "
        f"speedup {k['speedup']:g}, max_num_seqs {k['max_num_seqs']}, batched tokens {k['max_num_batched_tokens']}",
        f"trace: {results['workloads']['trace']['scaling'] if results['workloads'].get('trace') else 'not run'}",
        "",
    ]
    head = (
        f"{'run':<16} {'system':<20} {'ok':>8} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p99':>6} "
        f"{'tok/s':>7} {'req/s':>6} {'cached%':>8} {'routed%':>8} {'inflt%':>7} {'bound%':>7} {'of bnd':>7} {'cpu%':>6}"
    )
    lines += [head, "-" * len(head)]
    last = None
    for r in results["runs"]:
        if last is not None and r["run"] != last:
            lines.append("")
        last = r["run"]
        t, i, tp = r["ttft_ms"], r["itl_ms"], r["throughput"]
        lines.append(
            f"{r['run']:<16} {r['system']:<20} {r['ok']:>4}/{r['requests']:<3} {_f(t['p50']):>9} {_f(t['p90']):>7} "
            f"{_f(t['p99']):>7} {_f(i['p50'], '{:.1f}'):>8} {_f(i['p99']):>6} "
            f"{_f(tp['output_tokens_per_s']):>7} {_f(tp['requests_per_s'], '{:.2f}'):>6} "
            f"{_pct(r['cached_fraction']):>8} {_pct(r.get('routed_bound_fraction')):>8} "
            f"{_pct(r.get('missed_while_source_prefilling')):>7} "
            f"{_pct(r['bound_fraction']):>7} {_pct(r['of_bound']):>7} "
            f"{_f(r['cpu']['system_pct']):>6}"
        )
    lines.append("")
    lines.append(
        "(ms; ITL = gaps between streamed tokens; cached% = cached / prompt tokens the engines reported;"
    )
    notes = (
        " routed% = an infinite cache per worker over what the router sent it: bound - routed is lost to routing",
        " choices, routed - cached inside the engines (eviction, timing); inflt% = the part of bound - routed whose",
        " source request had not produced its first token yet when this one was sent; bound% = one infinite",
        " cache that has seen every earlier request; cpu% = the system's processes, % of one core)",
    )
    lines += notes
    t = results["targets"]
    if "kv_vs_round_robin" in t:
        e = t["kv_vs_round_robin"]
        lines += ["", f"Target: {e['target']}", f"  unloaded ({e['unloaded_run']}) round_robin TTFT p90 "
                  f"{_f(e['unloaded_ttft_p90_ms'])} ms"]  # fmt: skip
        for x in e["rates"]:
            lines.append(
                f"  {x['run']:<14} round_robin p90 {_f(x['round_robin_ttft_p90_ms'])} ms "
                f"({_f(x['round_robin_vs_unloaded'], '{:.1f}')}x unloaded{', loaded' if x['qualifies'] else ''})"
                + (
                    f"; kv p90 {_f(x['kv_ttft_p90_ms'])} ms, cut {_f(x['ttft_p90_cut'], '{:.2f}')}x, "
                    f"{_pct(x['kv_of_bound'])}% of bound -> {'PASS' if x['pass'] else 'FAIL'}"
                    if "pass" in x
                    else ""
                )
            )
        lines.append(f"  result: {e['result']}")
    if "kv_vs_dynamo" in t:
        e = t["kv_vs_dynamo"]
        lines += ["", f"Target: {e['target']}", f"  ({e['noise']})"]
        for x in e["runs"]:
            s = (
                f"  {x['run']:<16} dynamo kv: cached {_pct(x['dynamo_cached_fraction'])}%, "
                f"TTFT p90 {_f(x['dynamo_ttft_p90_ms'])} ms"
            )
            if "ferry_cached_fraction" in x:
                s += (
                    f" | ferry kv: cached {_pct(x['ferry_cached_fraction'])}%, TTFT p90 "
                    f"{_f(x['ferry_ttft_p90_ms'])} ms ({_f(x['ttft_p90_ratio_ferry_over_dynamo'], '{:.2f}')}x)"
                    f" -> {'ok' if x['cached_ok'] and x['ttft_ok'] else 'within noise' if x['ok_within_noise'] else 'NOT MET'}"
                )
            if "common_requests" in x:
                s += (
                    f" | over the {x['common_requests']} both finished: cached ferry "
                    f"{_pct(x['ferry_cached_common'])}% / dynamo {_pct(x['dynamo_cached_common'])}%"
                )
            if x.get("round_robin_ttft_p90_ferry_over_dynamo") is not None:
                s += f" | round_robin p90 ferry/dynamo {x['round_robin_ttft_p90_ferry_over_dynamo']:.2f}x"
            lines.append(s)
        lines.append(f"  result: {e['result']}")
    return "\n".join(lines)


def _style(system: str) -> dict[str, Any]:
    if system.startswith("dynamo"):
        return {"linestyle": "--", "marker": "s"}
    return {"linestyle": "-", "marker": "o"}


def plot(results: dict[str, Any], ttft_path: Path, cache_path: Path) -> list[Path]:
    """TTFT against load per system, and cached fraction per system against the bound (PNG files)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    runs = results["runs"]
    if not runs:
        return []
    systems = list(dict.fromkeys(r["system"] for r in runs))
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    # One panel for the trace (x = rate), one per rate of the prefix sweep (x = shared-prefix fraction).
    panels: list[tuple[str, float | None]] = (
        [("trace", None)] if any(r["kind"] == "trace" for r in runs) else []
    )
    panels += [("prefix", rate) for rate in sorted({r["rate_rps"] for r in runs if r["kind"] == "prefix"})]
    k = results["config"]["engine"]
    subtitle = (
        f"{k['workers']} workers, block {k['block_size']}, {k['num_blocks']} blocks/worker, speedup {k['speedup']:g}; "
        f"{results['machine']['nproc']} CPUs, commit {(results['machine']['commit'] or '?')[:10]}"
    )

    def series(kind: str, rate: float | None, system: str, x: str, y: Any) -> tuple[list[float], list[float]]:
        pts = sorted(
            (r[x], y(r))
            for r in runs
            if r["kind"] == kind
            and r["system"] == system
            and (rate is None or r["rate_rps"] == rate)
            and y(r) is not None
        )
        return [p[0] for p in pts], [p[1] for p in pts]

    # TTFT against load (trace) and against the shared-prefix fraction (prefix sweep).
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    for ax, (kind, rate) in zip(axes[0], panels, strict=True):
        x = "rate_rps" if kind == "trace" else "prefix_fraction"
        for s in systems:
            xs, ys = series(kind, rate, s, x, lambda r: r["ttft_ms"]["p90"])
            if kind == "trace":  # the unloaded reference sits at rate 0
                xs, ys = [a for a in xs if a > 0], [b for a, b in zip(xs, ys, strict=True) if a > 0]
            if xs:
                ax.plot(xs, ys, color=colors[s], label=f"{s}", **_style(s))
            xs, ys = series(kind, rate, s, x, lambda r: r["ttft_ms"]["p50"])
            if kind == "trace":
                xs, ys = [a for a in xs if a > 0], [b for a, b in zip(xs, ys, strict=True) if a > 0]
            if xs:
                ax.plot(xs, ys, color=colors[s], alpha=0.4, linewidth=1, linestyle=":")
        ax.set_yscale("log")
        ax.set_ylabel("time to first token (ms): p90 solid/dashed, p50 dotted")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        if kind == "trace":
            ref = [
                r["ttft_ms"]["p90"]
                for r in runs
                if r["run"] == "trace@unloaded" and r["system"] == "ferry round_robin" and r["ttft_ms"]["p90"]
            ]
            if ref:
                ax.axhline(
                    ref[0], color="gray", linewidth=1, linestyle="-.", label="round_robin unloaded p90"
                )
                ax.axhline(3 * ref[0], color="gray", linewidth=1, linestyle=":", label="3x that (loaded)")
                ax.legend(fontsize=8)
            ax.set_xlabel("request rate (req/s)")
            ax.set_title("Mooncake conversation trace (scaled): TTFT vs. load", fontsize=10)
        else:
            ax.set_xlabel("shared-prefix fraction")
            ax.set_title(f"synthetic prefix sweep {_at(rate)}", fontsize=10)
    fig.suptitle(f"Routing: time to first token per policy\n{subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(ttft_path, dpi=110)
    plt.close(fig)

    # Cached fraction per system against the bound.
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    for ax, (kind, rate) in zip(axes[0], panels, strict=True):
        if kind == "trace":
            trace_runs = sorted({(r["rate_rps"], r["run"]) for r in runs if r["kind"] == "trace"})
            width = 0.8 / len(systems)
            for j, s in enumerate(systems):
                idx = {r["run"]: r for r in runs if r["system"] == s}
                pts = [
                    (i + (j - (len(systems) - 1) / 2) * width, 100 * idx[run]["cached_fraction"])
                    for i, (_rate, run) in enumerate(trace_runs)
                    if run in idx and idx[run]["cached_fraction"] is not None
                ]
                ax.bar([p[0] for p in pts], [p[1] for p in pts], width=width, color=colors[s], label=s)
            for i, (_rate, run) in enumerate(trace_runs):
                b = [r["bound_fraction"] for r in runs if r["run"] == run and r["bound_fraction"] is not None]
                if b:
                    ax.hlines(100 * max(b), i - 0.45, i + 0.45, colors="black", linewidth=2,
                              label="bound" if i == 0 else None)  # fmt: skip
            ax.set_xticks(
                range(len(trace_runs)), [f"{rate:g} req/s" if rate else "unloaded" for rate, _ in trace_runs]
            )
            ax.set_title("Mooncake conversation trace (scaled)", fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        else:
            for s in systems:
                xs, ys = series("prefix", rate, s, "prefix_fraction", lambda r: r["cached_fraction"])
                if xs:
                    ax.plot(xs, [100 * y for y in ys], color=colors[s], label=s, **_style(s))
            xs, ys = series("prefix", rate, systems[0], "prefix_fraction", lambda r: r["bound_fraction"])
            if xs:
                ax.plot(xs, [100 * y for y in ys], color="black", linewidth=2, label="bound")
            ax.set_xlabel("shared-prefix fraction")
            ax.set_title(f"synthetic prefix sweep {_at(rate)}", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        ax.set_ylabel("cached prompt tokens (%)")
    fig.suptitle(f"Routing: cached fraction reported by the engines vs. the infinite-cache bound\n{subtitle}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(cache_path, dpi=110)
    plt.close(fig)
    return [ttft_path, cache_path]


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(
        prog="python -m bench.routing.report", description="table and plots of a results file"
    )
    ap.add_argument("results", type=Path)
    ap.add_argument("--plot-prefix", type=Path, help="writes <prefix>_ttft.png and <prefix>_cache.png")
    a = ap.parse_args()
    doc = json.loads(a.results.read_text())
    print(table(doc))
    if a.plot_prefix:
        pp = a.plot_prefix
        print(*plot(doc, pp.with_name(pp.name + "_ttft.png"), pp.with_name(pp.name + "_cache.png")), sep="\n")


def _at(rate: float | None) -> str:
    return "unloaded (one request per worker at a time)" if not rate else f"at {rate:g} req/s"
