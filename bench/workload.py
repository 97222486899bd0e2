"""Request streams for routing benchmarks: the Mooncake conversation trace, scaled down, and synthetic
shared-prefix workloads, as token-id prompts with arrival times; and the best cached fraction any router
could reach on them.

Prompts are token ids, not text, so every server sees exactly the same tokens (no tokenizer round trip can
differ between them) and two requests share exactly the prefix the workload says they share.

Scaling of the trace (stated in every result file through `Workload.description`):
- each trace hash id (one 512-token block in production) becomes one run of `block_tokens` token ids
  (default 64, one KV block of the engines at `--block-size 64`), so every length is divided by
  512 / block_tokens (8 by default): input_length and output_length alike;
- a sample of whole conversations (every request whose first two hash ids hash into the kept bucket, 1 in
  `sample_every`), so multi-turn reuse is kept while the request count drops;
- timestamps compressed to a target mean request rate, keeping the trace's burstiness.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the published trace
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
# Token ids drawn for prompts: above SmolLM2's special tokens, below its vocabulary size (49,152).
TOKEN_LOW, TOKEN_HIGH = 1_000, 49_000

_PACK_KEY = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload."""

    index: int
    at: float  # seconds after the start of the run
    prompt: list[int]  # token ids
    max_tokens: int  # sent with ignore_eos, so every server generates exactly this many


@dataclass(frozen=True)
class Workload:
    """A sequence of requests in arrival order, and how it was made."""

    name: str
    items: list[WorkItem]
    description: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival."""
        return self.items[-1].at - self.items[0].at if len(self.items) > 1 else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per second."""
        span = self.duration_s
        return (len(self.items) - 1) / span if span > 0 else math.inf

    def at_rate(self, rate: float) -> Workload:
        """The same requests with arrival times stretched or compressed to a mean of `rate` per second."""
        factor = self.rate / rate if math.isfinite(self.rate) else 1.0
        t0 = self.items[0].at
        items = [replace(it, at=(it.at - t0) * factor) for it in self.items]
        return replace(self, items=items, description={**self.description, "rate_rps": rate})

    def strided(self, n: int) -> Workload:
        """An evenly spaced subset of `n` requests (same length mix and time span), renumbered."""
        if n >= len(self.items):
            return self
        picks = np.linspace(0, len(self.items) - 1, n).round().astype(int)
        items = [replace(self.items[j], index=i) for i, j in enumerate(picks)]
        return replace(
            self,
            items=items,
            description={**self.description, "subset": f"{n} of {len(self.items)}, evenly spaced"},
        )

    def prompt_tokens(self) -> int:
        """Sum of prompt lengths."""
        return sum(len(it.prompt) for it in self.items)

    def output_tokens(self) -> int:
        """Sum of max_tokens."""
        return sum(it.max_tokens for it in self.items)


class TokenBank:
    """A fixed, deterministic run of `block_tokens` token ids for every (salt, id).

    Different salts give unrelated token runs: a benchmark gives each run its own salt so that no run can
    hit blocks an earlier run left in the engines' caches.
    """

    def __init__(self, block_tokens: int, salt: str) -> None:
        self.block_tokens = block_tokens
        self._salt = xxhash.xxh3_64_intdigest(salt.encode())
        self._memo: dict[int, np.ndarray] = {}

    def block(self, key: int) -> np.ndarray:
        """The token ids standing for hash id `key`."""
        run = self._memo.get(key)
        if run is None:
            seed = xxhash.xxh3_64_intdigest(_PACK_KEY.pack(self._salt, key & (2**64 - 1)))
            rng = np.random.Generator(np.random.PCG64(seed))
            run = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=self.block_tokens, dtype=np.int64)
            self._memo[key] = run
        return run

    def prompt(self, keys: Sequence[int], length: int) -> list[int]:
        """Concatenated runs of `keys`, cut to `length` tokens."""
        need = min(len(keys), -(-length // self.block_tokens))
        if need == 0:
            return []
        return np.concatenate([self.block(k) for k in keys[:need]])[:length].tolist()


# ---- the Mooncake conversation trace ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of the trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path = DEFAULT_TRACE) -> list[TraceRecord]:
    """Every line of a Mooncake-format trace."""
    out: list[TraceRecord] = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                d = json.loads(line)
                out.append(
                    TraceRecord(d["timestamp"], d["input_length"], d["output_length"], tuple(d["hash_ids"]))
                )
    return out


def _conversation_bucket(rec: TraceRecord, buckets: int) -> int:
    # Every request of the trace starts with the same hash id (a shared system prompt); the second one
    # starts the conversation, and later turns repeat it, so it identifies the conversation.
    key = np.asarray(rec.hash_ids[:2], dtype="<u8").tobytes()
    return xxhash.xxh3_64_intdigest(key) % buckets


def trace_workload(
    records: Sequence[TraceRecord],
    *,
    block_tokens: int = 64,
    sample_every: int = 32,
    max_requests: int | None = None,
    max_model_len: int = 8192,
    salt: str = "trace",
) -> Workload:
    """A scaled-down replay of the trace (see the module docstring); arrival times are the trace's own."""
    scale = TRACE_BLOCK_TOKENS / block_tokens
    kept = [r for r in records if sample_every <= 1 or _conversation_bucket(r, sample_every) == 0]
    if max_requests is not None:
        kept = kept[:max_requests]
    if not kept:
        raise ValueError("the trace sample is empty")
    bank = TokenBank(block_tokens, salt)
    t0 = kept[0].timestamp_ms
    items: list[WorkItem] = []
    clipped = 0
    for i, r in enumerate(kept):
        out_len = max(1, round(r.output_length / scale))
        in_len = min(max(1, math.ceil(r.input_length / scale)), len(r.hash_ids) * block_tokens)
        limit = max_model_len - out_len
        if in_len > limit:
            in_len, clipped = limit, clipped + 1
        items.append(WorkItem(i, (r.timestamp_ms - t0) / 1000.0, bank.prompt(r.hash_ids, in_len), out_len))
    wl = Workload("trace", items)
    return replace(
        wl,
        description={
            "source": "Mooncake FAST'25 conversation_trace.jsonl",
            "scaling": (
                f"1 trace hash id (512 tokens) -> {block_tokens} token ids; input and output lengths / {scale:g}; "
                f"1 in {sample_every} conversations (by hash of the first two hash ids) over the whole hour"
                + (f", first {max_requests} of them" if max_requests else "")
                + f"; inputs clipped to max_model_len - output ({clipped} of {len(items)} clipped); "
                "timestamps compressed to the stated mean rate"
            ),
            "requests": len(items),
            "trace_requests": len(records),
            "trace_span_s": round(wl.duration_s, 1),
            "block_tokens": block_tokens,
            "mean_input_tokens": round(wl.prompt_tokens() / len(items), 1),
            "mean_output_tokens": round(wl.output_tokens() / len(items), 1),
            "clipped": clipped,
            "salt": salt,
        },
    )


# ---- synthetic shared prefixes --------------------------------------------------------------------------


def prefix_workload(
    prefix_fraction: float,
    *,
    requests: int = 120,
    input_tokens: int = 2048,
    output_tokens: int = 32,
    groups: int = 16,
    rate: float = 10.0,
    block_tokens: int = 64,
    seed: int = 0,
    salt: str = "prefix",
) -> Workload:
    """Poisson arrivals; each prompt is one of `groups` shared prefixes (`prefix_fraction` of the prompt,
    rounded to whole blocks) followed by a suffix of its own."""
    if not 0.0 <= prefix_fraction <= 1.0:
        raise ValueError("prefix_fraction must be within [0, 1]")
    rng = np.random.Generator(np.random.PCG64(seed))
    bank = TokenBank(block_tokens, salt)
    prefix_blocks = round(prefix_fraction * input_tokens / block_tokens)
    prefix_len = min(prefix_blocks * block_tokens, input_tokens)
    gaps = rng.exponential(1.0 / rate, size=requests)
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    if requests > 1:  # exactly the stated mean rate
        times *= (requests - 1) / (rate * times[-1])
    group_of = rng.integers(0, groups, size=requests)
    suffix_blocks = -(-(input_tokens - prefix_len) // block_tokens)
    items: list[WorkItem] = []
    for i in range(requests):
        g = int(group_of[i])
        # Key spaces: prefixes are (group, block), suffixes (request, block); high bits keep them apart.
        prefix_keys = [(1 << 62) | (g << 20) | b for b in range(prefix_blocks)]
        suffix_keys = [(2 << 62) | (i << 20) | b for b in range(suffix_blocks)]
        prompt = bank.prompt(prefix_keys, prefix_len) + bank.prompt(suffix_keys, input_tokens - prefix_len)
        items.append(WorkItem(i, float(times[i]), prompt, output_tokens))
    return Workload(
        f"prefix-{prefix_fraction:g}",
        items,
        {
            "source": "synthetic shared prefixes",
            "prefix_fraction": prefix_fraction,
            "prefix_tokens": prefix_len,
            "requests": requests,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "groups": groups,
            "arrivals": f"Poisson, {rate:g}/s",
            "rate_rps": rate,
            "seed": seed,
            "salt": salt,
        },
    )


# ---- the bound ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheBound:
    """What an infinite prefix cache that has seen every earlier prompt would serve."""

    cached_tokens: int
    prompt_tokens: int

    @property
    def fraction(self) -> float:
        """Cached share of all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _chain(prompt: Sequence[int], block_size: int) -> list[int]:
    arr = np.asarray(prompt, dtype="<u4")
    h = 0
    out: list[int] = []
    step = block_size * 4
    raw = arr[: (len(arr) // block_size) * block_size].tobytes()
    for i in range(len(raw) // step):
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + raw[i * step : (i + 1) * step])
        out.append(h)
    return out


def infinite_cache_hits(prompts: Iterable[Sequence[int]], block_size: int) -> list[int]:
    """Cached prompt tokens of each prompt under an infinite cache that has seen every earlier prompt (in
    the order given, which is arrival order), at block granularity.

    Matches the engines' accounting: only full blocks are cached, a hit is the longest run of leading
    blocks already seen (blocks are chained, so a block only matches after the same prefix), and the last
    prompt token is always computed (at most (len - 1) // block_size blocks hit, as in vLLM).
    """
    seen: set[int] = set()
    hits: list[int] = []
    for prompt in prompts:
        chain = _chain(prompt, block_size)
        limit = (len(prompt) - 1) // block_size if prompt else 0
        hit = 0
        while hit < limit and chain[hit] in seen:
            hit += 1
        hits.append(hit * block_size)
        seen.update(chain)
    return hits


def prefix_sources(prompts: Sequence[Sequence[int]], block_size: int) -> list[int | None]:
    """For each prompt, the latest earlier prompt holding its longest cached prefix (None without a hit):
    the request whose blocks an infinite cache would serve it from."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, prompt in enumerate(prompts):
        chain = _chain(prompt, block_size)
        limit = (len(prompt) - 1) // block_size if prompt else 0
        hit = 0
        while hit < limit and chain[hit] in last:
            hit += 1
        out.append(last[chain[hit - 1]] if hit else None)
        for h in chain:
            last[h] = i
    return out


def per_worker_hits(
    prompts: Sequence[Sequence[int]], workers: Sequence[str | None], block_size: int
) -> list[int]:
    """Cached prompt tokens of each prompt if every worker had an infinite cache of what it was sent.

    The gap between `infinite_cache_hits` and this is lost to routing (a prefix was sent to a worker that
    had not seen it, while another had); the gap between this and what the engines report is lost in the
    engines (eviction, or a prefix still being prefilled when the next request arrived). Requests with no
    known worker (failed ones) count zero and are remembered nowhere.
    """
    seen: dict[str, set[int]] = {}
    hits: list[int] = []
    for prompt, worker in zip(prompts, workers, strict=True):
        if worker is None:
            hits.append(0)
            continue
        mine = seen.setdefault(worker, set())
        chain = _chain(prompt, block_size)
        limit = (len(prompt) - 1) // block_size if prompt else 0
        hit = 0
        while hit < limit and chain[hit] in mine:
            hit += 1
        hits.append(hit * block_size)
        mine.update(chain)
    return hits


def infinite_cache_bound(prompts: Iterable[Sequence[int]], block_size: int) -> CacheBound:
    """The best cached fraction of a workload: `infinite_cache_hits` summed over every prompt."""
    prompts = list(prompts)
    return CacheBound(sum(infinite_cache_hits(prompts, block_size)), sum(len(p) for p in prompts))
