"""Routing policies: which live worker gets a request."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from schemas.status import WorkerStatus
from server.errors import APIError


@dataclass(frozen=True)
class Decision:
    """The chosen worker and what the router expected there."""

    worker_id: str
    predicted_cached_blocks: int = 0


class Router:
    """round_robin, random and least_loaded over live workers, with this frontend's in-flight counts."""

    def __init__(self, policy: str, rng: random.Random | None = None) -> None:
        self.policy = policy
        self._rng = rng or random.Random()
        self._rr = 0
        self.inflight: Counter[str] = Counter()

    def choose(self, model: str, workers: list[WorkerStatus], prompt_len: int) -> Decision:
        """Pick a worker for one sequence of `prompt_len` tokens."""
        if not workers:
            raise APIError(
                503, f"No live worker serves the model `{model}` right now.", code="no_workers", retry_after=1
            )
        if self.policy == "random":
            w = self._rng.choice(workers)
        elif self.policy == "round_robin":
            ordered = sorted(workers, key=lambda w: w.worker_id)
            w = ordered[self._rr % len(ordered)]
            self._rr += 1
        else:
            w = self._least_loaded(workers)
        return Decision(w.worker_id)

    def _least_loaded(self, workers: list[WorkerStatus]) -> WorkerStatus:
        # This frontend's own in-flight count is exact and current; the heartbeat's waiting count
        # adds what other frontends queued there.
        def load(w: WorkerStatus) -> int:
            return self.inflight[w.worker_id] + w.waiting

        best = min(load(w) for w in workers)
        return self._rng.choice([w for w in workers if load(w) == best])

    def started(self, worker_id: str) -> None:
        """A sequence was sent to `worker_id`."""
        self.inflight[worker_id] += 1

    def finished(self, worker_id: str) -> None:
        """A sequence on `worker_id` ended."""
        self.inflight[worker_id] -= 1
        if self.inflight[worker_id] <= 0:
            del self.inflight[worker_id]
