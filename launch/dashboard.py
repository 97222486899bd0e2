"""The Grafana dashboard of a Ferry fleet, generated: `python -m launch.dashboard --write` rewrites
docker/grafana/dashboards/ferry.json (tests/unit/test_dashboard.py keeps the file and this module in step;
tests/integration/test_dashboard_queries.py runs every panel's PromQL against a real Prometheus).

Plain dictionaries in Grafana's dashboard schema (version 39, Grafana 10/11): timeseries and stat panels,
each target a PromQL expression on the `prometheus` datasource, filtered by the `$model` variable.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docker" / "grafana" / "dashboards" / "ferry.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
M = 'model=~"$model"'  # every panel follows the model picked at the top
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    """One panel: its title, unit and PromQL targets (legend -> expression)."""

    title: str
    unit: str
    targets: dict[str, str]
    kind: str = "timeseries"
    # Series that exist only when an optional part runs (the planner): allowed to be absent.
    optional: str = ""
    description: str = ""


@dataclass(frozen=True)
class Row:
    """A titled row of panels."""

    title: str
    panels: list[Panel] = field(default_factory=list)


def _q(q: float, metric: str, by: str = "model, le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{M}}}[{RATE}])))"


def _quantiles(metric: str) -> dict[str, str]:
    return {f"p{int(q * 100)} {{{{model}}}}": _q(q, metric) for q in (0.5, 0.9, 0.99)}


ROWS: list[Row] = [
    Row("SLOs per model", [
        Panel("Time to first token", "s", _quantiles("ferry_time_to_first_token_seconds"),
              description="Request arrival at the frontend to its first token"),
        Panel("Inter-token latency", "s", _quantiles("ferry_inter_token_latency_seconds"),
              description="One observation per token after the first"),
        Panel("End-to-end latency", "s", _quantiles("ferry_request_duration_seconds"),
              description="Arrival to the last event of the response"),
        Panel("Where the time goes (p90)", "s", {
            "queue {{model}}": _q(0.9, "ferry_request_queue_seconds"),
            "prefill {{model}}": _q(0.9, "ferry_request_prefill_seconds"),
            "decode {{model}}": _q(0.9, "ferry_request_decode_seconds"),
        }),
        Panel("SLO attainment: first token within 1 s", "percentunit", {
            "{{model}}": f'sum by (model) (rate(ferry_time_to_first_token_seconds_bucket{{{M}, le="1.0"}}[{RATE}]))'
                         f" / sum by (model) (rate(ferry_time_to_first_token_seconds_count{{{M}}}[{RATE}]))",
        }, kind="stat"),
    ]),
    Row("Throughput", [
        Panel("Requests by endpoint and status", "reqps", {
            "{{endpoint}} {{status}}": f"sum by (endpoint, status) (rate(ferry_requests_total[{RATE}]))",
        }),
        Panel("Tokens per second", "short", {
            "generated {{model}}": f"sum by (model) (rate(ferry_worker_generated_tokens_total{{{M}}}[{RATE}]))",
            "prompt {{model}}": f"sum by (model) (rate(ferry_worker_prompt_tokens_total{{{M}}}[{RATE}]))",
        }),
        Panel("In flight", "short", {
            "frontend {{instance}}": "sum by (instance) (ferry_requests_inflight)",
            "worker {{worker}}": f"sum by (worker) (ferry_worker_inflight{{{M}}})",
        }),
        Panel("Prompt and completion length (p50, p90)", "short", {
            "prompt p50 {{model}}": _q(0.5, "ferry_request_prompt_tokens"),
            "prompt p90 {{model}}": _q(0.9, "ferry_request_prompt_tokens"),
            "completion p50 {{model}}": _q(0.5, "ferry_request_completion_tokens"),
            "completion p90 {{model}}": _q(0.9, "ferry_request_completion_tokens"),
        }),
    ]),
    Row("Errors", [
        Panel("Errors by type", "reqps", {
            "{{type}} ({{stage}})": f"sum by (type, stage) (rate(ferry_request_errors_total[{RATE}]))",
        }, description="stage=request: refused before the response started; stream: ended inside it"),
        Panel("Worker requests by outcome", "reqps", {
            "{{outcome}}": f"sum by (outcome) (rate(ferry_worker_requests_total{{{M}}}[{RATE}]))",
        }),
    ]),
    Row("Routing", [
        Panel("Decisions per worker", "reqps", {
            "{{worker}} ({{policy}})": f"sum by (worker, policy) (rate(ferry_router_decisions_total[{RATE}]))",
        }),
        Panel("Cached prompt tokens: predicted vs reported", "short", {
            "predicted by the router": f"sum(rate(ferry_router_predicted_cached_tokens_total[{RATE}]))",
            "reported by workers": f"sum(rate(ferry_cached_prompt_tokens_total[{RATE}]))",
        }),
        Panel("Busy waits and the wait queue", "short", {
            "waits {{outcome}}": f"sum by (outcome) (rate(ferry_router_busy_waits_total[{RATE}]))",
            "waiting now": "sum(ferry_router_queue_depth)",
        }),
        Panel("KV index reachable", "short", {"{{instance}}": "min by (instance) (ferry_router_kv_index_up)"},
              kind="stat"),
    ]),
    Row("KV cache per worker", [
        Panel("KV usage", "percentunit", {"{{worker}}": f"max by (worker) (ferry_worker_kv_usage{{{M}}})"}),
        Panel("Prefix-cache hit rate", "percentunit", {
            "{{worker}}": f"sum by (worker) (rate(ferry_worker_prefix_cache_hits_total{{{M}}}[{RATE}]))"
                          f" / sum by (worker) (rate(ferry_worker_prefix_cache_queries_total{{{M}}}[{RATE}]))",
        }),
        Panel("Engine running and waiting", "short", {
            "running {{worker}}": f"sum by (worker) (ferry_worker_engine_running{{{M}}})",
            "waiting {{worker}}": f"sum by (worker) (ferry_worker_engine_waiting{{{M}}})",
        }),
    ]),
    Row("Worker roles (prefill and decode pools)", [
        Panel("Workers by role", "short", {
            "{{worker_role}}": f"count by (worker_role) (ferry_worker_kv_usage{{{M}}})",
        }, description="worker_role: prefill, decode, or both (aggregated)"),
        Panel("Engine running and waiting by role", "short", {
            "running {{worker_role}}": f"sum by (worker_role) (ferry_worker_engine_running{{{M}}})",
            "waiting {{worker_role}}": f"sum by (worker_role) (ferry_worker_engine_waiting{{{M}}})",
        }),
        Panel("Tokens per second by role", "short", {
            "generated {{worker_role}}":
                f"sum by (worker_role) (rate(ferry_worker_generated_tokens_total{{{M}}}[{RATE}]))",
            "prompt {{worker_role}}": f"sum by (worker_role) (rate(ferry_worker_prompt_tokens_total{{{M}}}[{RATE}]))",
        }, description="A prefill worker generates each sequence's first token; its decode worker the rest"),
        Panel("KV usage by role (mean, max)", "percentunit", {
            "mean {{worker_role}}": f"avg by (worker_role) (ferry_worker_kv_usage{{{M}}})",
            "max {{worker_role}}": f"max by (worker_role) (ferry_worker_kv_usage{{{M}}})",
        }),
    ]),
    Row("Kafka", [
        Panel("Consumer lag by topic and group", "short", {
            "{{topic}} {{group}}": "max by (topic, group) (ferry_kafka_consumer_lag)",
        }),
        Panel("Produce latency p99", "s", {
            "requests": f"histogram_quantile(0.99, sum by (le) (rate(ferry_kafka_produce_seconds_bucket[{RATE}])))",
        }),
    ]),
    Row("Migrations", [
        Panel("Moves by reason and outcome", "short", {
            "{{reason}} {{outcome}}": f"sum by (reason, outcome) (increase(ferry_migrations_total[{RATE}]))",
        }),
        Panel("Sequences hit by a worker death", "short", {
            "affected": f"sum(increase(ferry_worker_failures_total[{RATE}]))",
        }),
    ]),
    Row("Batch", [
        Panel("Batch items by outcome", "short", {
            "{{outcome}}": f"sum by (outcome) (rate(ferry_worker_pool_items_total{{{M}}}[{RATE}]))",
        }),
        Panel("Batch sequences running", "short", {
            "{{worker}}": f"sum by (worker) (ferry_worker_pool_inflight{{{M}}})",
        }),
    ]),
    Row("Planner", [
        Panel("Workers: desired vs live", "short", {
            "desired {{instance}} {{pool}}": "max by (instance, pool) (ferry_planner_desired_workers)",
            "live": "max(ferry_live_workers)",
        }, optional="planner"),
        Panel("Planner decisions", "short", {
            "{{action}}: {{reason}}": f"sum by (action, reason) (increase(ferry_planner_decisions_total[{RATE}]))",
        }, optional="planner"),
    ]),
]  # fmt: skip


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
        for i, (legend, expr) in enumerate(p.targets.items())
    ]
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        if p.kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}},
        "targets": targets,
    }  # fmt: skip


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels: list[dict[str, Any]] = []
    y = 0
    pid = 1
    for row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        pid += 1
        y += 1
        for i, p in enumerate(row.panels):
            panels.append(_panel(p, pid, (i % 3) * 8, y + (i // 3) * 8))
            pid += 1
        y += ((len(row.panels) + 2) // 3) * 8
    model_var = {
        "name": "model", "label": "Model", "type": "query", "datasource": DATASOURCE,
        "query": {"query": "label_values(ferry_time_to_first_token_seconds_count, model)", "refId": "model"},
        "definition": "label_values(ferry_time_to_first_token_seconds_count, model)",
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }  # fmt: skip
    return {
        "uid": "ferry-fleet", "title": "Ferry fleet", "tags": ["ferry", "llm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [model_var]}, "annotations": {"list": []}, "panels": panels,
    }  # fmt: skip


def render() -> str:
    """The dashboard JSON as written to docker/grafana/dashboards/ferry.json."""
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    """Print the dashboard JSON, or write it with `--write`."""
    if argv[:1] == ["--write"]:
        OUT.write_text(render())
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
