"""Prometheus HTTP service discovery: every live frontend and worker from the registry.

GET /discovery/prometheus answers the JSON an `http_sd_configs` job reads, one target group per process:
`[{"targets": ["host:port"], "labels": {"__metrics_path__": "/metrics", "role": "worker", ...}}]`. One
scrape job pointed at any frontend then covers a fleet whose workers and frontends come and go.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from schemas.openai import json_encoder
from server.errors import APIError
from server.frontend import Frontend


class TargetGroup(msgspec.Struct):
    """One entry of Prometheus's HTTP SD format."""

    targets: list[str]
    labels: dict[str, str]


def target_group(metrics_url: str, role: str, ferry_id: str, model: str) -> TargetGroup | None:
    """The scrape target of one process's /metrics URL; None if it advertises none."""
    url = urlsplit(metrics_url)
    if not url.netloc:
        return None
    # `role` and `ferry_id`, not `worker`/`model`: workers label their own samples with those.
    labels = {"__metrics_path__": url.path or "/metrics", "__scheme__": url.scheme or "http", "role": role,
              "ferry_id": ferry_id, "ferry_model": model}  # fmt: skip
    return TargetGroup([url.netloc], labels)


async def prometheus_targets(fe: Frontend, request: Request) -> Response:
    """GET /discovery/prometheus: live frontends (their announcements) and workers (the registry view)."""
    try:
        frontends = await fe.pool.registry.frontends()
    except Exception as exc:
        # Prometheus keeps the targets of its last successful discovery meanwhile.
        raise APIError(503, "The registry (Redis) is unreachable.", code="redis_unavailable", retry_after=2) from exc
    groups = [target_group(f.metrics_url, "frontend", f.frontend_id, f.model) for f in frontends]
    groups += [target_group(w.metrics_url, "worker", w.worker_id, w.model) for w in fe.pool.workers.values()]
    found = sorted((g for g in groups if g is not None), key=lambda g: (g.labels["role"], g.labels["ferry_id"]))
    return Response(json_encoder.encode(found), media_type="application/json")
