"""Routing policies: which live worker gets a sequence.

`kv` (default) weighs how much of the prompt a worker already caches against its load:

    prefill_blocks(w) = (in-flight prefill tokens of w + prompt tokens) / block_size - overlap(w)
    decode_blocks(w)  = active decode blocks of w + reread * rereads(w) + prompt blocks
    cost(w)           = overlap_weight * prefill_blocks(w) + decode_blocks(w)

Decode load (`decode_load`) counts each distinct block once by default, as the engine stores it: sequences
sharing a prefix on one worker share its blocks, so a worker caching a popular prefix is not charged for it
once per sequence and the next request on that prefix is not pushed away from its cache. But an engine's
decode step reads every sequence's whole context (its time grows with the sum of the context lengths), a
shared prefix once per sequence: rereads(w) counts those extra reads, at `decode_reread_weight` (0.1), and
a new sequence's blocks that decoding sequences on w already hold count at that weight too. Without it a
worker that took a long conversation's turns looked no busier than the others while its steps read 5x what
the router counted, and requests there could not finish (docs/benchmarks.md, "A quiet fleet"). `sequences`
charges every sequence all its blocks in full; on the conversation trace it lost a quarter of the cache
hits and had a worse TTFT at every rate (docs/benchmarks.md, Routing), so it stays an option.

overlap(w) counts a block on w's device pool as 1 and one only on its host offload tier (it must be loaded back
first) as `host_block_weight` (0.75, Dynamo's default); it is the larger of what the KV index says w caches (`kv_lookup`:
this frontend's copy of the KV log once it has caught up, by default, else the index in Redis) and (`inflight_overlap`, default) the leading
blocks of the prompt that sequences this frontend sent to w are holding, and of those that sequences it saw
finish on w in the last RECENT_S left behind: the index hears of a prompt's blocks only once the engine has
prefilled them and the worker has published the event, and a conversation's next turn or a burst on one
system prompt often arrives sooner. A sequence asking for at most one token never decodes: it adds no
decode load (decode_blocks is 0 for it, and its prompt blocks are not counted as decoding).

Lowest cost wins, ties at random; with a temperature T > 0 the choice is sampled with probability
proportional to exp(-(cost - min) / ((max - min) * T)). Load is this frontend's own exact in-flight
counts plus what other frontends published through Redis.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from redis.exceptions import RedisError

from kvstore.hashing import block_hashes, chain_seed
from kvstore.kv_index import KVIndex
from kvstore.load import WorkerLoad
from schemas.settings import RouterSettings
from schemas.status import WorkerStatus
from server.approx_index import ApproxIndex
from server.errors import APIError
from server.metrics import FrontendMetrics

log = logging.getLogger("ferry.router")

# How long KV index lookups must go without an error before the index counts as back.
INDEX_RECOVERY_S = 1.0
# How long the prompt blocks of a finished sequence count as held by its worker without the index saying so:
# the engine's KV events reach the index some milliseconds after the first token reaches the frontend, and
# on a quiet fleet the next request (often the conversation's next turn) is routed in between.
RECENT_S = 2.0
# No cached blocks: (leading blocks held, of which only on the host tier).
_NONE = (0, 0)


class AllBusy(Exception):
    """Every live worker is over a busy threshold."""


@dataclass
class Decision:
    """The chosen worker, what the router expected there, and the load it charged."""

    worker_id: str
    predicted_cached_blocks: int = 0  # leading prompt blocks cached on the worker, on either tier
    predicted_host_blocks: int = 0  # of those, how many only on its host tier
    prefill_tokens: int = 0
    decode_blocks: int = 0
    decodes: bool = True  # False: at most one token asked for, so no decode phase and no decode load
    prefilled: bool = False
    # Tokens the sequence may still generate, as this frontend counts them (its max_tokens less those it got).
    remaining: int = 0
    model: str = ""  # the base model whose index holds the blocks
    # kv policy: the prompt's full-block hashes (held while the sequence runs) and its partial block.
    blocks: list[int] = field(default_factory=list)
    partial_block: int = 0


@dataclass
class PromptMemo:
    """Block hashes of one prompt, computed once for all its choices."""

    tokens: list[int]
    lora_name: str | None = None
    max_tokens: int | None = None  # None: unknown, assumed to decode
    # Goes to a busy worker rather than waiting for one: its engine priority is ahead of what they hold waiting.
    overtake: bool = False
    hashes: dict[int, list[int]] = field(default_factory=dict)

    def chain(self, model: str, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks."""
        if block_size not in self.hashes:
            self.hashes[block_size] = block_hashes(self.tokens, block_size, chain_seed(model, self.lora_name))
        return self.hashes[block_size]


class Standby(Protocol):
    """A copy of the KV index (the KV log's, server/kv_indexer.py): asked first once it has caught up with the
    log (`kv_lookup` mirror), and instead of the index while the index is incomplete or unreachable."""

    rebuilding: bool
    caught_up: bool

    def overlaps(self, model: str, chain: list[int]) -> dict[str, tuple[int, int]]:
        """As `KVIndex.tiered_overlaps`."""
        ...

    def marker_changed(self, marker: str | None) -> bool:
        """Whether the registry marker a lookup read says Redis lost its data since the copy last looked (the
        copy then answers, and starts rebuilding the index at once)."""
        ...


class Router:
    """Chooses workers and keeps this frontend's in-flight load per worker."""

    def __init__(
        self,
        config: RouterSettings,
        metrics: FrontendMetrics,
        index: KVIndex | None = None,
        rng: random.Random | None = None,
        index_recovery_s: float = INDEX_RECOVERY_S,
        recent_s: float = RECENT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.policy = config.router_policy
        self._metrics = metrics
        self._index = index if config.kv_events else None
        self.approx = ApproxIndex(config.approx_ttl_s) if not config.kv_events else None
        # Prompts of sequences that finished in the last `recent_s`, per worker (kv events only; see RECENT_S).
        self.recent = ApproxIndex(recent_s) if config.kv_events and recent_s > 0 else None
        self._clock = clock
        self._rng = rng or random.Random()
        self._rr = 0
        self.local: dict[str, WorkerLoad] = {}
        self.remote: dict[str, WorkerLoad] = {}
        # Distinct full blocks of this frontend's active sequences per worker, with reference counts; and of
        # those that will decode (the decode load counts these).
        self.active_blocks: dict[str, Counter[int]] = {}
        self.decoding_blocks: dict[str, Counter[int]] = {}
        # This frontend's sequences that produced a token (running in their engine), per worker.
        self.running: dict[str, dict[int, Decision]] = {}
        self.index_ok = True
        # The KV log's copy of the index (server/kv_indexer.py). Asked first once caught up: the same blocks as the
        # index in Redis, up to ~0.1 s later (which the in-flight and recent overlaps cover), with no round trip
        # that waits for Redis to get a core (docs/benchmarks.md, "Overhead"); and instead of the index while
        # Redis lost it or cannot be reached.
        self.standby: Standby | None = None
        self._index_failed_at = -math.inf
        self._index_recovery_s = index_recovery_s

    # ---- choosing --------------------------------------------------------------------------------

    def available(self, workers: list[WorkerStatus]) -> list[WorkerStatus]:
        """Workers under the busy thresholds."""
        c = self.config

        def busy(w: WorkerStatus) -> bool:
            return w.kv_usage >= c.busy_kv_usage or (c.busy_waiting > 0 and w.waiting >= c.busy_waiting)

        return [w for w in workers if not busy(w)]

    async def choose(self, model: str, workers: list[WorkerStatus], prompt: PromptMemo) -> Decision:
        """Pick a worker for one sequence; raises AllBusy, or a 503 APIError if none is live."""
        if not workers:
            raise APIError(
                503, f"No live worker serves the model `{model}` right now.", code="no_workers", retry_after=1
            )
        candidates = self.available(workers)
        if prompt.overtake:
            # It goes ahead of what the engines hold waiting: where a running slot is free it starts at once
            # (the fair queue's reserve keeps some free, server/tenants_fair.py), else when one ends.
            free = [w for w in candidates if self._free_slot(w)]
            candidates = free or self._soonest_slot(candidates or workers)
        if not candidates:
            raise AllBusy()
        t0 = time.perf_counter()
        decodes = prompt.max_tokens is None or prompt.max_tokens > 1
        block_size = candidates[0].block_size
        prompt_blocks = math.ceil(len(prompt.tokens) / block_size)
        overlap = host = 0
        chain: list[int] = []
        if self.policy == "random":
            w = self._rng.choice(candidates)
        elif self.policy == "round_robin":
            ordered = sorted(candidates, key=lambda w: w.worker_id)
            w = ordered[self._rr % len(ordered)]
            self._rr += 1
        elif self.policy == "least_loaded":
            w = self._least_loaded(candidates)
        else:
            # A request names a LoRA adapter as its model (workers report their base model): its blocks
            # live in the base model's index, in chains salted with the adapter, apart from the base's.
            base = candidates[0].model
            if model != base and prompt.lora_name is None:
                prompt.lora_name = model
            chain = prompt.chain(base, block_size)
            overlaps = await self._overlaps(base, chain)
            if self.recent is not None:
                for wid, n in self.recent.overlaps(base, chain, self._clock()).items():
                    # Blocks of sequences that just ran there are on the device.
                    if n > self._weighted(overlaps.get(wid, _NONE)):
                        overlaps[wid] = (n, 0)
            w, (overlap, host) = self._cheapest(
                candidates, overlaps, len(prompt.tokens), prompt_blocks if decodes else 0, chain
            )
            if self.approx is not None:
                self.approx.record(base, w.worker_id, chain, self._clock())
        self._metrics.router_decision_seconds.observe(time.perf_counter() - t0)
        self._metrics.router_decisions.labels(self.policy, w.worker_id).inc()
        self._metrics.predicted_cached_tokens.inc(overlap * block_size)
        return Decision(
            worker_id=w.worker_id,
            predicted_cached_blocks=overlap,
            predicted_host_blocks=host,
            prefill_tokens=max(0, len(prompt.tokens) - overlap * block_size),
            decode_blocks=prompt_blocks if decodes else 0,
            decodes=decodes,
            blocks=chain,
            partial_block=prompt_blocks - len(chain) if chain else 0,
            model=candidates[0].model,
        )

    def _free_slot(self, w: WorkerStatus) -> bool:
        """Whether the sequences routers have in flight on `w` leave one of its running slots free (batch items,
        which no router sends, are not counted)."""
        return 0 < w.max_num_seqs and self.load(w.worker_id).sequences < w.max_num_seqs

    def _soonest_slot(self, workers: list[WorkerStatus]) -> list[WorkerStatus]:
        """Of `workers` (none with a running slot free), those where a running sequence is nearest its end, as
        far as this frontend knows (all of them when it knows none): a request that goes ahead of what they
        hold waiting starts there when one ends, as neither engine preempts a running sequence for it."""

        def left(w: WorkerStatus) -> float:
            return min((d.remaining for d in self.running.get(w.worker_id, {}).values()), default=math.inf)

        soonest = min(left(w) for w in workers)
        return [w for w in workers if left(w) == soonest]

    def _weighted(self, overlap: tuple[int, int]) -> float:
        """Cached blocks with those only on host counted at `host_block_weight`."""
        blocks, host = overlap
        return blocks - (1.0 - self.config.host_block_weight) * host if host else blocks

    async def _overlaps(self, model: str, chain: list[int]) -> dict[str, tuple[int, int]]:
        if self.approx is not None:
            return {w: (n, 0) for w, n in self.approx.overlaps(model, chain, self._clock()).items()}
        if self._index is None or not chain:
            return {}
        if self.standby is not None and (
            self.standby.rebuilding or (self.config.kv_lookup == "mirror" and self.standby.caught_up)
        ):
            return self.standby.overlaps(model, chain)
        t0 = time.perf_counter()
        try:
            found, marker = await self._index.lookup(model, chain)
        except (RedisError, OSError) as exc:  # OSError: sockets' and timeouts'
            # Never fail a request because the index is down: route by load alone meanwhile.
            self._metrics.redis_errors.inc()
            self._index_failed_at = time.monotonic()
            if self.index_ok:
                by = "the KV log's copy of the index" if self.standby is not None else "load only"
                log.error("KV index unreachable (%r): routing by %s until it is back", exc, by)
                self.index_ok = False
                self._metrics.kv_index_up.set(0)
            return self.standby.overlaps(model, chain) if self.standby is not None else {}
        self._metrics.redis_seconds.labels("kv_lookup").observe(time.perf_counter() - t0)
        # Back only after a quiet second: while Redis restarts, some pooled connections fail and others
        # already work, and flipping with each would log the outage once per lookup.
        if not self.index_ok and time.monotonic() - self._index_failed_at >= self._index_recovery_s:
            log.info("KV index reachable again: cache-aware routing resumed")
            self.index_ok = True
            self._metrics.kv_index_up.set(1)
        if self.standby is not None and self.standby.marker_changed(marker):
            # Redis came back empty since the indexer last read the marker: its answer is an empty index.
            return self.standby.overlaps(model, chain)
        return found

    def load(self, worker_id: str) -> WorkerLoad:
        """This frontend's plus the other frontends' in-flight load on `worker_id`."""
        total = WorkerLoad()
        for part in (self.local.get(worker_id), self.remote.get(worker_id)):
            if part is not None:
                total.add(part)
        return total

    def _cheapest(
        self,
        workers: list[WorkerStatus],
        overlaps: dict[str, tuple[int, int]],
        prompt_tokens: int,
        decode_blocks: int,
        chain: list[int],
    ) -> tuple[WorkerStatus, tuple[int, int]]:
        weight = self.config.overlap_weight
        distinct = self.config.decode_load == "distinct"
        reread = self.config.decode_reread_weight
        costs: list[float] = []
        best: dict[str, tuple[int, int]] = {}
        for w in workers:
            wid = w.worker_id
            local, remote = self.local.get(wid), self.remote.get(wid)
            pending = (local.prefill_tokens if local else 0) + (remote.prefill_tokens if remote else 0)
            decoding: float = (local.decode_blocks if local else 0) + (remote.decode_blocks if remote else 0)
            if distinct and reread:
                # What w's decode steps read beyond the distinct blocks: a shared prefix once more per sequence.
                reads = (local.read_blocks if local else 0) + (remote.read_blocks if remote else 0)
                decoding += reread * max(0, reads - decoding)
            active = self.active_blocks.get(wid)
            # Blocks of this prompt that active sequences on w already hold: a leading run of the chain (a
            # chained hash held implies its whole prefix is held). Those held by decoding sequences add no
            # decode load there.
            shared = _leading(chain, active) if active else 0
            held = self.decoding_blocks.get(wid)
            shared_decoding = _leading(chain, held) if held and decode_blocks else 0
            # The index learns of a prompt's blocks only once the engine has prefilled them; until then
            # the sequences this frontend sent are the freshest evidence of what a worker will hold.
            tiers = overlaps.get(wid, _NONE)
            overlap = self._weighted(tiers)
            if self.config.inflight_overlap and shared > overlap:
                tiers, overlap = (shared, 0), shared
            best[wid] = tiers
            prefill_blocks = (pending + prompt_tokens) / w.block_size - overlap
            # Its blocks already held by decoding sequences there take no memory, but each step reads them again.
            new_decode = decode_blocks - (1.0 - reread) * shared_decoding if distinct else decode_blocks
            costs.append(weight * prefill_blocks + decoding + new_decode)
        lo, hi = min(costs), max(costs)
        t = self.config.router_temperature
        if t > 0 and hi > lo:
            weights = [math.exp(-(c - lo) / ((hi - lo) * t)) for c in costs]
            i = self._rng.choices(range(len(workers)), weights=weights)[0]
        else:
            i = self._rng.choice([j for j, c in enumerate(costs) if c == lo])
        chosen = workers[i]
        return chosen, best[chosen.worker_id]

    def _least_loaded(self, workers: list[WorkerStatus]) -> WorkerStatus:
        # In-flight sequences from every frontend, plus what the worker itself reports queued.
        def load(w: WorkerStatus) -> int:
            return self.load(w.worker_id).sequences + w.waiting

        best = min(load(w) for w in workers)
        return self._rng.choice([w for w in workers if load(w) == best])

    # ---- load accounting -------------------------------------------------------------------------

    def started(self, d: Decision) -> None:
        """A sequence was sent to `d.worker_id`."""
        load = self.local.setdefault(d.worker_id, WorkerLoad())
        load.prefill_tokens += d.prefill_tokens
        load.sequences += 1
        load.read_blocks += d.decode_blocks
        added = d.decode_blocks
        if d.blocks:
            self.active_blocks.setdefault(d.worker_id, Counter()).update(d.blocks)
            if d.decodes:
                held = self.decoding_blocks.setdefault(d.worker_id, Counter())
                before = len(held)
                held.update(d.blocks)
                if self.config.decode_load == "distinct":
                    added = len(held) - before + d.partial_block
        load.decode_blocks += added

    def prefilled(self, d: Decision) -> None:
        """The sequence produced its first token: its prompt is no longer pending prefill."""
        if not d.prefilled:
            d.prefilled = True
            self.running.setdefault(d.worker_id, {})[id(d)] = d
            load = self.local.get(d.worker_id)
            if load is not None:
                load.prefill_tokens -= d.prefill_tokens

    def finished(self, d: Decision) -> None:
        """The sequence ended."""
        running = self.running.get(d.worker_id)
        if running is not None and running.pop(id(d), None) is not None and not running:
            del self.running[d.worker_id]
        load = self.local.get(d.worker_id)
        if load is None:
            return
        if not d.prefilled:
            load.prefill_tokens -= d.prefill_tokens
        load.sequences -= 1
        load.read_blocks -= d.decode_blocks
        removed = d.decode_blocks
        if d.blocks:
            _release(self.active_blocks.get(d.worker_id), d.blocks)
            held = self.decoding_blocks.get(d.worker_id)
            if d.decodes and held is not None:
                before = len(held)
                _release(held, d.blocks)
                if self.config.decode_load == "distinct":
                    removed = before - len(held) + d.partial_block
        load.decode_blocks -= removed
        # A prefilled prompt stays in the engine's cache; until the index hears of it, remember it here.
        if d.prefilled and d.blocks and self.recent is not None:
            self.recent.record(d.model, d.worker_id, d.blocks, self._clock())
        if load.sequences <= 0:
            del self.local[d.worker_id]
            self.active_blocks.pop(d.worker_id, None)
            self.decoding_blocks.pop(d.worker_id, None)

    def forget_worker(self, worker_id: str) -> None:
        """A worker died: drop what the approximate index believed about it."""
        for approx in (self.approx, self.recent):
            if approx is not None:
                approx.forget_worker(worker_id)


def _release(held: Counter[int] | None, blocks: list[int]) -> None:
    """Drop one reference to each of `blocks`."""
    if held is None:
        return
    for h in blocks:
        held[h] -= 1
        if held[h] <= 0:
            del held[h]


def _leading(chain: list[int], held: Counter[int]) -> int:
    """How many leading blocks of `chain` are in `held`.

    Chained hashes: holding block i implies holding blocks 0..i-1, so membership is a prefix of the chain
    and a binary search finds its end.
    """
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi) // 2
        if chain[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo
