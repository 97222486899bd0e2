"""Latency and rate inputs: TTFT and ITL p90 and the request rate, from Prometheus or the frontends' /metrics.

Both sources give the same three numbers for the last interval. Read directly, the frontends' cumulative
histograms are differenced between two scrapes (a counter that went down means the frontend restarted: its
new values are the interval's), summed over every label set of the model and over frontends, and the p90 is
interpolated inside its bucket as Prometheus's histogram_quantile does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Awaitable, Callable, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvstore.registry import Registry

log = logging.getLogger("ferry.planner")

TTFT = "ferry_time_to_first_token_seconds"
ITL = "ferry_inter_token_latency_seconds"


@dataclasses.dataclass(frozen=True)
class Latency:
    """One interval's interactive latency and load; None where nothing was observed."""

    ttft_p90_s: float | None
    itl_p90_s: float | None
    arrival_rate: float | None  # first tokens per second: interactive requests started


Buckets = dict[float, float]  # upper bound -> cumulative count


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a cumulative histogram, linearly interpolated within its bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: report that bound, as Prometheus does
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = upper, count
    return lower


def parse_histograms(text: str, names: Sequence[str], model: str) -> dict[str, Buckets]:
    """Cumulative buckets of each named histogram, summed over label sets of `model` (or without a model)."""
    out: dict[str, Buckets] = {n: {} for n in names}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        acc = out[family.name]
        for s in family.samples:
            if not s.name.endswith("_bucket") or s.labels.get("model", model) != model:
                continue
            le = float(s.labels["le"])
            acc[le] = acc.get(le, 0.0) + s.value
    return out


def _delta(now: Buckets, before: Buckets | None) -> Buckets:
    if before is None:
        return {}
    diff = {le: v - before.get(le, 0.0) for le, v in now.items()}
    if any(v < 0 for v in diff.values()):
        return dict(now)  # the frontend restarted: everything it counted is new
    return diff


def _merge(into: Buckets, add: Buckets) -> None:
    for le, v in add.items():
        into[le] = into.get(le, 0.0) + v


MetricsUrls = Callable[[], Awaitable[Sequence[str]]]


def fixed_frontends(urls: Sequence[str]) -> MetricsUrls:
    """The /metrics URLs of a fixed list of frontend base URLs (`--frontends`)."""
    metrics = [u.rstrip("/") + "/metrics" for u in urls if u]

    async def listed() -> Sequence[str]:
        return metrics

    return listed


def registered_frontends(registry: Registry, model: str) -> MetricsUrls:
    """The /metrics URLs the model's live frontends announce in the registry, read afresh each interval."""

    async def listed() -> Sequence[str]:
        return sorted(f.metrics_url for f in await registry.frontends() if f.model == model and f.metrics_url)

    return listed


class FrontendScraper:
    """Reads the frontends' /metrics each interval and turns two scrapes into one interval's Latency."""

    def __init__(self, client: httpx.AsyncClient, frontends: MetricsUrls, model: str) -> None:
        self._client = client
        self._frontends = frontends
        self._model = model
        self._last: dict[str, tuple[float, dict[str, Buckets]]] = {}

    async def read(self, now: float) -> Latency:
        """Scrape every frontend; an unreachable one is left out of this interval."""
        try:
            urls = await self._frontends()
        except Exception as exc:  # the registry (Redis) is down: no latency this interval, sized on load
            log.warning("planner: cannot list the frontends (%r)", exc)
            return Latency(None, None, None)
        for gone in self._last.keys() - set(urls):
            del self._last[gone]  # a frontend that left; one that comes back at the URL starts afresh
        ttft: Buckets = {}
        itl: Buckets = {}
        rate = 0.0
        seen = False
        for url in urls:
            try:
                r = await self._client.get(url, timeout=5.0)
                r.raise_for_status()
            except httpx.HTTPError as exc:
                log.warning("planner: cannot read %s (%r)", url, exc)
                continue
            hists = parse_histograms(r.text, (TTFT, ITL), self._model)
            before = self._last.get(url)
            self._last[url] = (now, hists)
            if before is None:
                continue
            elapsed = max(now - before[0], 1e-6)
            d_ttft = _delta(hists[TTFT], before[1][TTFT])
            _merge(ttft, d_ttft)
            _merge(itl, _delta(hists[ITL], before[1][ITL]))
            rate += max(d_ttft.values(), default=0.0) / elapsed
            seen = True
        if not seen:
            return Latency(None, None, None)
        return Latency(quantile(0.9, ttft), quantile(0.9, itl), rate)


class PrometheusSource:
    """Asks a Prometheus server for the same numbers over the last `window`."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, window_s: float) -> None:
        self._client = client
        self._url = url.rstrip("/") + "/api/v1/query"
        w = f"{max(int(window_s), 15)}s"  # at least a few scrapes, or rate() has too few points
        # `|` also matches series without a model label (an absent label is the empty string to PromQL).
        pattern = re.escape(model).replace("\\", "\\\\")
        sel = f'{{model=~"{pattern}|"}}'
        self._queries = {
            "ttft": f"histogram_quantile(0.9, sum by (le) (rate({TTFT}_bucket{sel}[{w}])))",
            "itl": f"histogram_quantile(0.9, sum by (le) (rate({ITL}_bucket{sel}[{w}])))",
            "rate": f"sum(rate({TTFT}_count{sel}[{w}]))",
        }

    async def _scalar(self, query: str) -> float | None:
        try:
            r = await self._client.get(self._url, params={"query": query}, timeout=5.0)
            r.raise_for_status()
            result = r.json()["data"]["result"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            log.warning("planner: Prometheus query failed (%r): %s", exc, query)
            return None
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    async def read(self, now: float) -> Latency:
        """Query the three numbers."""
        return Latency(
            await self._scalar(self._queries["ttft"]),
            await self._scalar(self._queries["itl"]),
            await self._scalar(self._queries["rate"]),
        )
