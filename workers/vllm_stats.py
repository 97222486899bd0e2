"""What vLLM reports after each engine step, kept for Ferry's stats: load, KV usage, prefix hits, drafts."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import CachingMetrics, IterationStats, MultiModalCacheStats, SchedulerStats


class SchedulerStatsRecorder(StatLoggerBase):
    """Keeps the latest scheduler figures vLLM reports after each engine step."""

    def __init__(self, vllm_config: VllmConfig | None = None, engine_index: int = 0) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        # vLLM's own window: the hit rate of the most recent 1000 requests.
        self.prefix_cache = CachingMetrics()
        # Speculative decoding since start: draft proposals, draft tokens, and the tokens accepted of them.
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        """Take one step's scheduler stats."""
        if scheduler_stats is None:
            return
        self.running = scheduler_stats.num_running_reqs
        self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
        self.kv_usage = scheduler_stats.kv_cache_usage
        self.prefix_cache.observe(scheduler_stats.prefix_cache_stats)
        spec = scheduler_stats.spec_decoding_stats
        if spec is not None:
            self.spec_drafts += spec.num_drafts
            self.spec_draft_tokens += spec.num_draft_tokens
            self.spec_accepted_tokens += spec.num_accepted_tokens

    def log_engine_initialized(self) -> None:
        """Nothing to log: the engine logs its own start."""
