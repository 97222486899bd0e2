"""The simulated engine: vLLM-style scheduling over a prefix-cached block pool, with Dynamo's timing.

It behaves like a real engine towards the worker (continuous batching, chunked prefill, priority
admission, preemption by recompute, KV events in Ferry hashes) but "computes" by sleeping for the
time NVIDIA Dynamo's mocker model gives each step, and emits deterministic pseudo-random tokens so
streamed, non-streamed and migrated runs of the same request produce the same output. A request
with a structured-output constraint gets text valid for it instead (workers/sim_output.py).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

from tokenizers import Tokenizer

from kvstore.hashing import block_hashes, chain_seed
from schemas.kafka import FinishReason, GenerateRequest
from schemas.kv_events import KVEvent, KVEventBatch
from workers import sim_draws
from workers.block_pool import BlockPool, SequenceBlocks
from workers.detok import Detokenizer
from workers.engine import EngineDead, EngineLifecycle, EngineOutput, EngineStats
from workers.engine_base import KVEventQueue, Mailbox, OutputStream, check_request
from workers.host_tier import host_tier
from workers.sim_config import SimConfig
from workers.sim_draws import TAG_LENGTH, TAG_STRUCTURED, TAG_TOKEN, draw, logprob, output_vocab, stream_key
from workers.sim_output import OutputPlan, TokenSource, output_plan
from workers.sim_timing import StepPacer, step_seconds
from workers.sim_transfer import KVReceiver, admission

logger = logging.getLogger(__name__)


class _State(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class _Seq:
    request: GenerateRequest
    arrival: int
    # Prompt, tokens migrated in, then tokens generated here: everything the KV cache holds.
    tokens: list[int]
    kv: SequenceBlocks
    detok: Detokenizer
    stream_key: int
    # The token at each output position, and where the sequence ends by itself.
    plan: OutputPlan
    mailbox: Mailbox = field(default_factory=Mailbox)
    state: _State = _State.WAITING
    num_computed: int = 0
    # Tokens to (re)compute as prefill since the last admission; later tokens are decodes.
    prefill_end: int = 0
    generated: int = 0
    cached_tokens: int | None = None
    received: int = 0  # leading tokens whose KV came from a prefill worker, computed as of admission
    sent_first: bool = False
    # Called when the sequence is first admitted into a step (OutputStream.when_scheduled).
    on_scheduled: Callable[[], None] | None = None
    # When it was queued, and how long it waited until first scheduled (for the first output).
    queued_at: float = 0.0
    queued_s: float = 0.0

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)


@dataclass(slots=True)
class _Step:
    work: dict[str, tuple[_Seq, int]]
    seconds: float


class SimEngine(EngineLifecycle):
    """A simulated vLLM engine implementing the Engine protocol on the caller's event loop."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        config: SimConfig | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.model = model
        self.config = config or SimConfig()
        self._tokenizer = tokenizer
        self._eos = eos_token_id
        self._vocab = output_vocab(tokenizer, eos_token_id)
        self._pool = BlockPool(self.config.num_blocks, self.config.block_size, host_tier(self.config))
        self._kv_capacity = self.config.num_blocks * self.config.block_size
        self._seqs: dict[str, _Seq] = {}
        self._running: dict[str, _Seq] = {}
        self._waiting: list[tuple[int, int, _Seq]] = []
        self._num_waiting = 0
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._dead: str | None = None
        self._prompt_tokens_seen = 0
        self._cached_tokens_seen = 0
        self._kv_events = KVEventQueue(self.config.max_pending_kv_batches, self._pool.snapshot)
        self.receiver = KVReceiver(self.config, self._pool.longest_prefix)  # KV from prefill workers
        # Tests: an engine that stops stepping but still passes check_health (what the canary catches).
        self.hung = False
        # Tests: a step loop that dies at its next step (as vLLM's EngineCore process can), or at one that takes a
        # request `poison` picks (an engine bug that one request sets off).
        self.crash = False
        self.poison: Callable[[GenerateRequest], bool] | None = None
        self._room: Callable[[], Awaitable[None]] | None = None  # pace_outputs
        self.pacer = StepPacer()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background step loop."""
        if self._task is None and not self._stopped:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine:{self.model}")

    async def stop(self) -> None:
        """Abort every request, stop stepping, clear the cache and end the KV-event stream."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                if not self._task.cancelled():
                    raise  # the caller of stop() itself is being cancelled
        for seq in list(self._seqs.values()):
            self._abort_seq(seq)
        if self._pool.reset():
            self._publish(self._pool.take_events())
        self._kv_events.close()

    def pace_outputs(self, room: Callable[[], Awaitable[None]]) -> None:
        """Await `room()` before every step: outputs pushed inside a step queue up where it waits."""
        self._room = room

    async def check_health(self) -> None:
        """Raise EngineDead if the step loop died or the engine was stopped."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._stopped:
            raise EngineDead("engine stopped")

    # -- requests --------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Queue one sequence now and return its stream of deltas; closing the stream aborts it."""
        self._validate(request)
        prior = request.generated_token_ids
        tokens = [*request.prompt_token_ids, *prior]
        key = stream_key(request)
        natural_len = None
        if not request.sampling.ignore_eos:
            span = self.config.max_output_tokens - self.config.min_output_tokens + 1
            natural_len = self.config.min_output_tokens + self._draw(key, 0, TAG_LENGTH) % span
        plan = output_plan(
            request,
            TokenSource(self._tokenizer, self._vocab, self._eos),
            lambda pos: self._draw(key, pos, TAG_TOKEN),
            natural_len,
            seed=self._draw(key, 0, TAG_STRUCTURED),
        )
        seq = _Seq(
            request=request,
            arrival=next(self._arrivals),
            tokens=tokens,
            kv=SequenceBlocks(seed=chain_seed(self.model, request.lora_name), lora_name=request.lora_name),
            detok=Detokenizer(
                self._tokenizer,
                request.sampling,
                self._eos,
                prompt_token_ids=request.prompt_token_ids,
                prior_output_ids=prior,
            ),
            stream_key=key,
            plan=plan,
            queued_at=time.monotonic(),
        )
        self._seqs[request.request_id] = seq
        # Counted as waiting while its KV is on its way from a prefill worker (then queued by _arrive).
        self._num_waiting += 1
        seq.received = self.receiver.receive(request.kv_from, tokens, seq.kv.seed, lambda: self._arrive(seq))
        return OutputStream(
            self._stream(seq),
            lambda: self._abort_seq(seq),
            push=seq.mailbox.push_to,
            scheduled=functools.partial(self._when_scheduled, seq),
        )

    async def abort(self, request_id: str) -> None:
        """Stop one request and free its blocks; a no-op if it is unknown or done."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._abort_seq(seq)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks (AllBlocksCleared); False while any request holds blocks."""
        if not self._pool.reset():
            return False
        self._publish(self._pool.take_events())
        return True

    def kv_events(self) -> AsyncIterator[KVEventBatch]:
        """Batches of KV events, one per step that changed the cache; ends when the engine stops."""
        return self._kv_events.stream()

    def stats(self) -> EngineStats:
        """Current load and cache figures."""
        seen, c = self._prompt_tokens_seen, self.config
        return EngineStats(running=len(self._running), waiting=self._num_waiting, kv_usage=self._pool.usage(),
                           prefix_hit_rate=self._cached_tokens_seen / seen if seen else 0.0, total_blocks=c.num_blocks,
                           block_size=c.block_size, max_model_len=c.max_model_len)  # fmt: skip

    def first_token_eta(self, prompt_token_ids: list[int], lora_name: str | None = None) -> float:
        """Seconds until a prompt submitted now would produce its first token if nothing else arrived.

        The prefill work ahead of it (running prefills, then the waiting queue in order, each less what
        the cache already holds) is scheduled step by step with this engine's token budget and timing.
        Only a simulation can know this; benchmarks use it as a bound on routing (bench/routing/virtual.py).
        """
        bs, cfg = self.config.block_size, self.config

        def uncached(tokens: list[int], seed: int) -> int:
            full = (len(tokens) - 1) // bs  # the last token is always computed, as in admission
            return len(tokens) - self._pool.longest_prefix(block_hashes(tokens[: full * bs], bs, seed)) * bs

        decoding = [s for s in self._running.values() if s.num_computed >= s.prefill_end]
        context = sum(s.num_computed for s in decoding)
        queue = [s.prefill_end - s.num_computed for s in self._running.values() if s.num_computed < s.prefill_end]
        queue += [uncached(s.tokens, s.kv.seed) for _p, _a, s in sorted(self._waiting) if s.state is _State.WAITING]
        queue.append(uncached(list(prompt_token_ids), chain_seed(self.model, lora_name)))
        seconds, n_decoding, i = 0.0, len(decoding), 0
        while i < len(queue):
            budget, prefill, prefilled = max(1, cfg.max_num_batched_tokens - n_decoding), 0, 0
            while i < len(queue) and budget > 0:
                take = min(queue[i], budget)
                queue[i] -= take
                budget -= take
                prefill += take
                if queue[i] == 0:
                    i += 1
                    prefilled += 1
            seconds += step_seconds(prefill, context, n_decoding, self._kv_capacity, cfg.speedup)
            n_decoding += prefilled  # they decode from the next step on
        return seconds

    def _validate(self, request: GenerateRequest) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._stopped or self._task is None:
            raise EngineDead("engine is not running")
        check_request(request, self._seqs, self.config.max_model_len)

    async def _stream(self, seq: _Seq) -> AsyncGenerator[EngineOutput, None]:
        try:
            while True:
                out = await seq.mailbox.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            # Covers aclose, cancellation of the consumer, and a started-then-dropped stream being finalised.
            self._abort_seq(seq)

    @staticmethod
    def _when_scheduled(seq: _Seq, callback: Callable[[], None]) -> None:
        if seq.cached_tokens is None:
            seq.on_scheduled = callback
        else:  # already admitted
            callback()

    def _abort_seq(self, seq: _Seq) -> None:
        if seq.state is _State.FINISHED:
            return
        self._finish(seq)
        prompt, cached = len(seq.request.prompt_token_ids), seq.cached_tokens or 0
        seq.mailbox.put(EngineOutput([], finish_reason="abort", prompt_tokens=prompt, cached_tokens=cached))

    def _finish(self, seq: _Seq) -> None:
        if seq.state is _State.WAITING:
            # Left in the heap and skipped when it surfaces: removal from the middle is O(n).
            self._num_waiting -= 1
        self._running.pop(seq.request.request_id, None)
        self._pool.free(seq.kv)
        seq.state = _State.FINISHED
        if self._seqs.get(seq.request.request_id) is seq:
            del self._seqs[seq.request.request_id]

    # -- step loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            pacer = self.pacer
            pacer.working()
            while True:
                if self.crash:
                    raise RuntimeError("simulated engine crash")
                if self._room is not None:
                    pacer.waiting()
                    await self._room()
                    pacer.working()
                step = None if self.hung else self._schedule()
                if step is not None and self.poison is not None and any(self.poison(q.request) for q, _ in step.work.values()):
                    raise RuntimeError("simulated engine crash on a poison request")
                if step is None:
                    pacer.idle()
                    self._wake.clear()
                    await self._wake.wait()
                    pacer.working()
                    continue
                # The simulated forward pass, less what this step's scheduling and the last step's outputs took.
                await pacer.step(step.seconds)
                self._complete(step)
                self._publish(self._pool.take_events())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("simulated engine step loop crashed")
            self._dead = f"step loop crashed: {e!r}"
            error = EngineDead(self._dead)
            for seq in list(self._seqs.values()):
                seq.state = _State.FINISHED
                seq.mailbox.fail(error)
            self._seqs.clear()
            self._running.clear()
            self._waiting.clear()
            self._num_waiting = 0
            self._kv_events.close()

    def _schedule(self) -> _Step | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        work: dict[str, tuple[_Seq, int]] = {}
        preempted = False
        # Decodes first so running streams keep their pace; partial prefills take what is left.
        decoding = [s for s in self._running.values() if s.num_computed >= s.prefill_end]
        prefilling = [s for s in self._running.values() if s.num_computed < s.prefill_end]
        for seq in itertools.chain(decoding, prefilling):
            if budget == 0:
                break
            if seq.state is not _State.RUNNING:
                continue  # preempted earlier in this pass
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._pool.allocate(seq.kv, seq.tokens, seq.num_computed + n):
                victim = max(self._running.values(), key=lambda s: s.sort_key)
                self._preempt(victim)
                preempted = True
                undone = work.pop(victim.request.request_id, None)
                if undone is not None:
                    budget += undone[1]
                if victim is seq:
                    break
            else:
                work[seq.request.request_id] = (seq, n)
                budget -= n
        # Like vLLM, admit nothing in a step that had to preempt: the pool is already short.
        if not preempted:
            budget = self._admit(work, budget)
        if not work:
            return None
        # Host-tier loads (and offloads) in this step's allocations lengthen it.
        return _Step(work=work, seconds=self._step_seconds(work) + self._pool.take_transfer_seconds() / self.config.speedup)

    def _admit(self, work: dict[str, tuple[_Seq, int]], budget: int) -> int:
        bs = self.config.block_size
        while budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            hit_blocks = self._pool.match_prefix(seq.kv, seq.tokens)
            computed, prefill_end = admission(hit_blocks * bs, seq.received, len(seq.tokens))
            n = min(len(seq.tokens) - computed, budget)
            if not self._pool.allocate(seq.kv, seq.tokens, computed + n, num_hit_blocks=hit_blocks):
                break
            seq.received = 0  # in the pool now: a preempted sequence finds them there, or recomputes them
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.state = _State.RUNNING
            seq.num_computed = computed
            seq.prefill_end = prefill_end
            self._running[seq.request.request_id] = seq
            if seq.cached_tokens is None:
                prompt_len = len(seq.request.prompt_token_ids)
                seq.cached_tokens = min(computed, prompt_len)
                seq.queued_s = time.monotonic() - seq.queued_at
                self._prompt_tokens_seen += prompt_len
                self._cached_tokens_seen += seq.cached_tokens
                if seq.on_scheduled is not None:
                    scheduled, seq.on_scheduled = seq.on_scheduled, None
                    try:
                        scheduled()
                    except Exception:  # the caller's failure, never the engine's step
                        logger.exception("the scheduling callback of %s failed", seq.request.request_id)
            work[seq.request.request_id] = (seq, n)
            budget -= n
        return budget

    def _step_seconds(self, work: dict[str, tuple[_Seq, int]]) -> float:
        prefill_tokens = decode_context = decoding = 0
        for seq, n in work.values():
            if seq.num_computed < seq.prefill_end:
                prefill_tokens += n
            else:
                decoding += 1
                decode_context += seq.num_computed + n
        return step_seconds(prefill_tokens, decode_context, decoding, self._kv_capacity, self.config.speedup)

    def _preempt(self, seq: _Seq) -> None:
        # Recompute, not swap: drop the KV and prefill prompt + output again on readmission.
        del self._running[seq.request.request_id]
        self._pool.free(seq.kv)
        seq.num_computed = 0
        self._push_waiting(seq)

    def _push_waiting(self, seq: _Seq) -> None:
        seq.state = _State.WAITING
        self._num_waiting += 1
        self._arrive(seq)

    def _arrive(self, seq: _Seq) -> None:
        if seq.state is _State.WAITING and not self._stopped:  # (not aborted while its KV was on its way)
            heapq.heappush(self._waiting, (seq.request.priority, seq.arrival, seq))
            self._wake.set()

    def _peek_waiting(self) -> _Seq | None:
        while self._waiting:
            seq = self._waiting[0][2]
            if seq.state is _State.WAITING:
                return seq
            heapq.heappop(self._waiting)
        return None

    def _complete(self, step: _Step) -> None:
        for seq, n in step.work.values():
            if seq.state is not _State.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                self._emit_token(seq)

    def _emit_token(self, seq: _Seq) -> None:
        request = seq.request
        pos = len(request.generated_token_ids) + seq.generated
        token, natural_end = seq.plan.next_token(pos)
        seq.tokens.append(token)
        seq.generated += 1
        length_end = seq.generated >= request.max_tokens
        delta = seq.detok.step(token, final=natural_end or length_end)
        finish: FinishReason | None = None
        if delta.stopped or natural_end:
            finish = "stop"
        elif length_end:
            finish = "length"
        out = EngineOutput(
            token_ids=[token], text=delta.text, finish_reason=finish, stop_reason=delta.stop_reason
        )
        if request.sampling.logprobs is not None:
            out.logprobs = [
                logprob(self._vocab, self.config.seed, seq.stream_key, pos, token, request.sampling.logprobs)
            ]
        if not seq.sent_first and (k := request.sampling.prompt_logprobs) is not None:
            out.prompt_logprobs = sim_draws.prompt_logprobs(
                self._vocab, self.config.seed, seq.stream_key, request, k
            )
        if not seq.sent_first or finish is not None:
            seq.sent_first = True
            out.prompt_tokens = len(request.prompt_token_ids)
            out.cached_tokens = seq.cached_tokens or 0
            out.queued_s = seq.queued_s
        if finish is not None:
            self._finish(seq)
        seq.mailbox.put(out)

    def _draw(self, key: int, pos: int, tag: int) -> int:
        return draw(self.config.seed, key, pos, tag)

    @property
    def kv_batches_dropped(self) -> int:
        """KV event batches dropped because the reader fell behind (it got a snapshot instead)."""
        return self._kv_events.dropped

    def _publish(self, events: list[KVEvent]) -> None:
        if events:
            self._kv_events.publish(KVEventBatch(ts=time.time(), events=events))
