"""Speculative decoding on a worker's /metrics: draft tokens proposed and accepted, as vLLM counts them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from workers.engine import EngineStats


class DraftMetrics:
    """Counters fed from the engine's running totals (EngineStats.spec_*) at each heartbeat."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.drafts = Counter("ferry_worker_spec_drafts", "Speculative draft proposals", registry=registry)
        self.draft_tokens = Counter(
            "ferry_worker_spec_draft_tokens",
            "Draft tokens proposed by speculative decoding",
            registry=registry,
        )
        self.accepted_tokens = Counter(
            "ferry_worker_spec_accepted_tokens", "Draft tokens the target model accepted", registry=registry
        )
        self._seen = (0, 0, 0)

    def observe(self, stats: EngineStats) -> None:
        """Add what the engine counted since the previous call (acceptance rate = accepted / draft tokens)."""
        now = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
        for counter, new, old in zip(
            (self.drafts, self.draft_tokens, self.accepted_tokens), now, self._seen, strict=True
        ):
            if new > old:
                counter.inc(new - old)
        self._seen = now
