"""What every engine shares: a merging mailbox, the output stream that aborts on close, request checks, the KV-event queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Container

from schemas.kafka import GenerateRequest
from schemas.kv_events import KVEventBatch
from workers.engine import EngineError, EngineOutput

# Takes each output of a sequence as the engine makes it, synchronously (OutputStream.push_to).
OutputSink = Callable[[EngineOutput], None]


class Mailbox:
    """One request's pending output: deltas merge while the consumer lags (vLLM's RequestOutputCollector).

    With a sink (`push_to`) nothing waits here: each delta goes to the sink inside the engine's step, so a
    step's outputs cost no task wake-up per sequence.
    """

    __slots__ = ("_done", "_error", "_pending", "_ready", "_sink")

    def __init__(self) -> None:
        self._pending: EngineOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._sink: OutputSink | None = None
        self._done: asyncio.Future[None] | None = None

    def put(self, out: EngineOutput) -> None:
        """Add a delta, merged into one still unread (or handed to the sink)."""
        if self._sink is not None:
            self._deliver(out)
            return
        pending = self._pending
        if pending is None:
            self._pending = out
        else:
            pending.token_ids.extend(out.token_ids)
            pending.text += out.text
            pending.logprobs = pending.logprobs + out.logprobs
            pending.finish_reason = out.finish_reason
            pending.stop_reason = out.stop_reason
            pending.prompt_tokens = out.prompt_tokens or pending.prompt_tokens
            pending.cached_tokens = out.cached_tokens or pending.cached_tokens
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Make the next get() raise `error` once what is pending was read (with a sink: end it with `error`)."""
        self._error = error
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self._ready.set()

    async def get(self) -> EngineOutput:
        """Everything pending as one delta, waiting for the first."""
        while True:
            if self._pending is not None:
                out, self._pending = self._pending, None
                return out
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()

    def push_to(self, sink: OutputSink) -> asyncio.Future[None]:
        """Hand every delta to `sink` from now on; the future ends with the last one, or with what failed (the
        engine's error, or the sink's own exception). Once it is done (or cancelled) deltas are dropped."""
        self._done = asyncio.get_running_loop().create_future()
        self._sink = sink
        if self._pending is not None:
            out, self._pending = self._pending, None
            self._deliver(out)
        if self._error is not None:
            self.fail(self._error)
        return self._done

    def _deliver(self, out: EngineOutput) -> None:
        done = self._done
        assert self._sink is not None and done is not None
        if done.done():
            return
        try:
            self._sink(out)
        except Exception as exc:  # the consumer's failure ends its sequence, never the engine's step
            done.set_exception(exc)
            return
        if out.finish_reason is not None:
            done.set_result(None)


class OutputStream(AsyncIterator[EngineOutput]):
    """What generate() returns: iterating streams deltas, closing early aborts the request.

    `on_close` runs before the generator is closed: a stream closed before its first `__anext__` never
    runs the generator's `finally`, so the abort cannot live only there. An engine that can hand its outputs
    over inside its step passes `push`: then `push_to` replaces iterating. One that can say when a sequence
    first enters a step passes `scheduled`, which `when_scheduled` hands its callback to.
    """

    def __init__(
        self,
        gen: AsyncGenerator[EngineOutput, None],
        on_close: Callable[[], Awaitable[None] | None],
        push: Callable[[OutputSink], asyncio.Future[None]] | None = None,
        scheduled: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._gen = gen
        self._on_close = on_close
        self._push = push
        self._scheduled = scheduled

    async def __anext__(self) -> EngineOutput:
        return await self._gen.__anext__()

    def push_to(self, sink: OutputSink) -> asyncio.Future[None] | None:
        """Have the engine call `sink` with each delta as it makes it, instead of being iterated; the future
        ends with the sequence (cancelling it drops what follows). None if this engine only streams."""
        return None if self._push is None else self._push(sink)

    def when_scheduled(self, callback: Callable[[], None]) -> bool:
        """Have the engine call `callback` once, when the sequence first enters a step (before any of its
        outputs); False if this engine does not say (then nothing is called)."""
        if self._scheduled is None:
            return False
        self._scheduled(callback)
        return True

    async def aclose(self) -> None:
        """Abort the request if it is still running, then close the stream."""
        pending = self._on_close()
        if pending is not None:
            await pending
        await self._gen.aclose()


def check_request(request: GenerateRequest, running: Container[str], max_model_len: int) -> None:
    """Raise EngineError for a request no engine can take: a duplicate, an empty prompt, no room in the context."""
    if request.request_id in running:
        raise EngineError("duplicate_request", f"request {request.request_id!r} is already running")
    if not request.prompt_token_ids:
        raise EngineError("invalid_request", "the prompt is empty")
    if request.max_tokens < 1:
        raise EngineError("invalid_request", "max_tokens must be at least 1")
    total = len(request.prompt_token_ids) + len(request.generated_token_ids) + request.max_tokens
    if total > max_model_len:
        raise EngineError(
            "context_length_exceeded",
            f"prompt and max_tokens need {total} tokens; the model allows {max_model_len}",
            retriable=False,
        )


class KVEventQueue:
    """An engine's KV event batches on their way to the index, bounded.

    When the reader falls so far behind that batches must be dropped, it gets a snapshot of the whole
    cache (`AllBlocksCleared` then every block held) before anything else: every queued batch is already
    reflected in the cache, so the snapshot replaces them.
    """

    def __init__(self, max_pending: int, snapshot: Callable[[], KVEventBatch]) -> None:
        self._max_pending = max_pending
        self._snapshot = snapshot
        self._batches: deque[KVEventBatch] = deque()
        self._ready = asyncio.Event()
        self._resync = False
        self._closed = False
        self._error: BaseException | None = None
        self.dropped = 0

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch (nothing once closed)."""
        if self._closed:
            return
        if len(self._batches) >= self._max_pending:
            self._batches.popleft()
            self.dropped += 1
            self._resync = True
        self._batches.append(batch)
        self._ready.set()

    def close(self, error: BaseException | None = None) -> None:
        """End the stream after what is queued; with `error`, the stream raises it instead of ending."""
        self._closed = True
        if error is not None:
            self._error = error
        self._ready.set()

    async def stream(self) -> AsyncGenerator[KVEventBatch, None]:
        """The batches in order, until the queue is closed."""
        while True:
            if self._resync:
                self._resync = False
                self._batches.clear()
                yield self._snapshot()
            elif self._batches:
                yield self._batches.popleft()
            elif self._error is not None:
                raise self._error
            elif self._closed:
                return
            else:
                self._ready.clear()
                await self._ready.wait()


async def in_daemon_thread(fn: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run a blocking call in a daemon thread, waiting at most `timeout_s`; False if it did not finish.

    asyncio.to_thread's executor threads are joined when the event loop closes and at interpreter exit, so
    a call stuck on a dead peer (an engine process that was killed) would keep the process alive forever.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            fn()
        except Exception:
            logging.getLogger("ferry.engine").exception("%s failed", what)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop may already be closed
                loop.call_soon_threadsafe(finished)

    threading.Thread(target=run, name=what, daemon=True).start()
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(done)
    except TimeoutError:
        logging.getLogger("ferry.engine").warning("%s did not finish within %.0fs; left behind", what, timeout_s)
        return False
    return True
