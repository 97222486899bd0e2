"""What the load generators wrote, read into one shape; the failures, the Ferry-vs-vLLM ratios and the tables.

Pure functions over dicts (the JSON `vllm bench serve --save-result` and `aiperf profile` write), so the
logic that decides pass or fail is unit-tested without starting anything.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

TARGET_THROUGHPUT_RATIO = 0.95  # Ferry + vLLM output tokens/s >= 0.95 x vLLM's own server (issue 16)
TARGET_ADDED_TTFT_MS = 10.0  # Ferry + vLLM TTFT p50 - vLLM's own server's TTFT p50
FERRY_VLLM = "ferry-vllm"
VLLM_SERVER = "vllm-server"


@dataclass
class Summary:
    """One load-generator run against one system, in the load generator's own numbers."""

    requests: int  # requests the run was asked to send
    completed: int
    failed: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    e2e_p50_ms: float
    duration_s: float
    errors: dict[str, int] = field(default_factory=dict)  # distinct error texts and how often

    @property
    def ok(self) -> bool:
        """Every request asked for completed, none failed."""
        return self.failed == 0 and self.completed == self.requests and self.requests > 0


def _num(d: dict[str, Any], key: str) -> float:
    value = d.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def parse_vllm_bench(result: dict[str, Any], requests: int) -> Summary:
    """A `vllm bench serve --save-result` JSON (with --metric-percentiles 50,99)."""
    errors = Counter(e.strip().splitlines()[-1] if e.strip() else e for e in result.get("errors", []) if e)
    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", requests - completed))
    return Summary(
        requests=requests,
        completed=completed,
        failed=max(failed, requests - completed),
        output_tok_s=_num(result, "output_throughput"),
        ttft_p50_ms=_num(result, "p50_ttft_ms"),
        ttft_p99_ms=_num(result, "p99_ttft_ms"),
        itl_p50_ms=_num(result, "p50_itl_ms"),
        e2e_p50_ms=_num(result, "p50_e2el_ms"),
        duration_s=_num(result, "duration"),
        errors=dict(errors.most_common(5)),
    )


def _metric(export: dict[str, Any], name: str, stat: str) -> float:
    m = export.get(name)
    return _num(m, stat) if isinstance(m, dict) else math.nan


def parse_aiperf(export: dict[str, Any], requests: int) -> Summary:
    """aiperf's `profile_export_aiperf.json`."""
    completed = _metric(export, "completed_request_count", "avg")
    if math.isnan(completed):
        completed = _metric(export, "request_count", "avg")
    completed_n = 0 if math.isnan(completed) else int(completed)
    errors: Counter[str] = Counter()
    for item in export.get("error_summary") or []:
        details = item.get("error_details", item) if isinstance(item, dict) else {}
        text = " ".join(str(details.get(k, "")) for k in ("code", "type", "message")).strip() or repr(item)
        errors[text] += int(item.get("count", 1)) if isinstance(item, dict) else 1
    failed = max(sum(errors.values()), requests - completed_n)
    return Summary(
        requests=requests,
        completed=completed_n,
        failed=failed,
        output_tok_s=_metric(export, "output_token_throughput", "avg"),
        ttft_p50_ms=_metric(export, "time_to_first_token", "p50"),
        ttft_p99_ms=_metric(export, "time_to_first_token", "p99"),
        itl_p50_ms=_metric(export, "inter_token_latency", "p50"),
        e2e_p50_ms=_metric(export, "request_latency", "p50"),
        duration_s=_metric(export, "benchmark_duration", "avg"),
        errors=dict(errors.most_common(5)),
    )


@dataclass
class Cell:
    """One run: a load generator with one workload against one system."""

    system: str  # ferry-sim, ferry-vllm, vllm-server
    client: str  # vllm-bench, aiperf
    workload: str  # e.g. random/openai-chat
    round: int
    summary: Summary | None  # None when the load generator itself failed
    error: str = ""  # why there is no summary, or the client's exit status
    command: str = ""

    @property
    def ok(self) -> bool:
        """The run finished and every request succeeded."""
        return self.summary is not None and self.summary.ok and not self.error

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, NaN as null."""
        d = asdict(self)
        if self.summary is not None:
            d["summary"] = {k: _clean(v) for k, v in d["summary"].items()}
        d["ok"] = self.ok
        return d


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 3)
    return v


def failures(cells: list[Cell]) -> list[str]:
    """One line per run that did not complete every request; empty when all did."""
    out = []
    for c in cells:
        if c.ok:
            continue
        where = f"{c.client} {c.workload} against {c.system} (round {c.round})"
        if c.summary is None:
            out.append(f"{where}: no result: {c.error}")
        else:
            s = c.summary
            detail = "; ".join(f"{n}x {e}" for e, n in s.errors.items()) or c.error or "no error text"
            out.append(f"{where}: {s.completed}/{s.requests} completed, {s.failed} failed: {detail}")
    return out


def comparisons(cells: list[Cell]) -> list[dict[str, Any]]:
    """Ferry + vLLM against vLLM's own server, per client and workload: output tokens/s ratio and added
    TTFT p50, each the median over the rounds both ran successfully."""
    by_key: dict[tuple[str, str, int], dict[str, Summary]] = {}
    for c in cells:
        if c.ok and c.summary is not None and c.system in (FERRY_VLLM, VLLM_SERVER):
            by_key.setdefault((c.client, c.workload, c.round), {})[c.system] = c.summary
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (client, workload, _r), pair in sorted(by_key.items()):
        if len(pair) != 2:
            continue
        f, v = pair[FERRY_VLLM], pair[VLLM_SERVER]
        row = rows.setdefault((client, workload), {"ratio": [], "added": []})
        if v.output_tok_s > 0:
            row["ratio"].append(f.output_tok_s / v.output_tok_s)
        row["added"].append(f.ttft_p50_ms - v.ttft_p50_ms)
    return [
        {
            "client": client,
            "workload": workload,
            "rounds": len(vals["added"]),
            "throughput_ratio": _clean(statistics.median(vals["ratio"])) if vals["ratio"] else None,
            "added_ttft_p50_ms": _clean(statistics.median(vals["added"])) if vals["added"] else None,
        }
        for (client, workload), vals in rows.items()
    ]


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets over all rows measured by `vllm bench serve`: medians and whether each is met."""
    measured = [r for r in rows if r["client"] == "vllm-bench"]
    ratios = [r["throughput_ratio"] for r in measured if r["throughput_ratio"] is not None]
    added = [r["added_ttft_p50_ms"] for r in measured if r["added_ttft_p50_ms"] is not None]
    ratio = statistics.median(ratios) if ratios else None
    added_ms = statistics.median(added) if added else None
    return {
        "throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
        "throughput_ratio_median": _clean(ratio) if ratio is not None else None,
        "throughput_ratio_worst": _clean(min(ratios)) if ratios else None,
        "throughput_met": ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO,
        "added_ttft_p50_ms_max": TARGET_ADDED_TTFT_MS,
        "added_ttft_p50_ms_median": _clean(added_ms) if added_ms is not None else None,
        "added_ttft_p50_ms_worst": _clean(max(added)) if added else None,
        "added_ttft_met": added_ms is not None and added_ms <= TARGET_ADDED_TTFT_MS,
    }


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def runs_table(cells: list[Cell]) -> str:
    """Markdown: one row per run (rounds pooled by median), in the load generators' own numbers."""
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.client, c.workload, c.system), []).append(c)
    lines = [
        "| client | workload | system | ok / sent | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| E2E p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (client, workload, system), group in groups.items():
        sums = [c.summary for c in group if c.summary is not None]
        ok = sum(min(s.completed, s.requests - s.failed) for s in sums)
        sent = sum(s.requests for s in sums) or "-"

        def med(attr: str, sums: list[Summary] = sums) -> float | None:
            vals = [getattr(s, attr) for s in sums if not math.isnan(getattr(s, attr))]
            return statistics.median(vals) if vals else None

        mark = "" if all(c.ok for c in group) else " **FAILED**"
        lines.append(
            f"| {client} | {workload} | {system} | {ok} / {sent}{mark} | {_fmt(med('output_tok_s'))} "
            f"| {_fmt(med('ttft_p50_ms'))} | {_fmt(med('ttft_p99_ms'))} | {_fmt(med('itl_p50_ms'))} "
            f"| {_fmt(med('e2e_p50_ms'))} |"
        )
    return "\n".join(lines)


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: Ferry + vLLM / vLLM server per client and workload."""
    lines = [
        "| client | workload | rounds | output tok/s, Ferry / vLLM | added TTFT p50 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['client']} | {r['workload']} | {r['rounds']} | {_fmt(r['throughput_ratio'], 3)} "
            f"| {_fmt(r['added_ttft_p50_ms'])} |"
        )
    return "\n".join(lines)


def targets_line(t: dict[str, Any]) -> str:
    """The targets in one sentence."""
    return (
        f"vllm bench serve, median over workloads: throughput ratio {_fmt(t['throughput_ratio_median'], 3)} "
        f"(worst {_fmt(t['throughput_ratio_worst'], 3)}; target >= {t['throughput_ratio_min']}: "
        f"{'met' if t['throughput_met'] else 'NOT met'}), added TTFT p50 {_fmt(t['added_ttft_p50_ms_median'])} "
        f"ms (worst {_fmt(t['added_ttft_p50_ms_worst'])}; target <= {t['added_ttft_p50_ms_max']} ms: "
        f"{'met' if t['added_ttft_met'] else 'NOT met'})"
    )
