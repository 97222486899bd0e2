"""The frontend side of batches: submission to the pool, the status machine, expiry, cancel, finalization.

Every frontend runs one coordinator. All batch state is in Redis, so any frontend can carry on a
batch another one started: a sweep looks at every active batch a few times a second and does what
its status asks (submit, expire, finish cancelling, finalize), under a per-batch lock that expires
if its holder dies. Results come back through `server/batch/results.py`, which any coordinator may
be running (the results topic is read by one consumer group).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiokafka import AIOKafkaProducer

from kvstore.batch_store import BatchStore
from schemas.batch import FINAL_STATUSES, Batch, BatchError, BatchErrors, FileObject, ItemMeta
from schemas.names import batch_results_topic, pool_topic
from schemas.openai import json_encoder
from schemas.settings import FrontendSettings, default_home
from schemas.status import WorkerStatus
from server.batch.filestore import FileStore, LocalFileStore
from server.batch.items import ItemPreparer, PreparedItem, error_line, item_id, unrun_line
from server.batch.ordering import plan
from server.batch.rolling import BatchTopics
from server.batch.validate import allowed_windows, parse_batch_file
from server.errors import APIError
from server.preprocess import Preprocessor

log = logging.getLogger("ferry.batch")

# Items produced between two records of progress (a resumed submission skips what was recorded).
_PRODUCE_CHUNK = 256


def new_file_id() -> str:
    """An OpenAI-looking file id."""
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    """An OpenAI-looking batch id (items are `<batch id>:<index>`)."""
    return f"batch_{secrets.token_hex(12)}"


def result_file_id(batch_id: str, kind: str) -> str:
    """Id of a batch's output (`out`) or error (`err`) file: fixed, so finalizing twice writes one file."""
    return f"file-{kind}-{batch_id.removeprefix('batch_')}"


class BatchCoordinator:
    """Owns the sweep loop and the per-batch work of one frontend."""

    def __init__(
        self,
        settings: FrontendSettings,
        store: BatchStore,
        pre: Preprocessor,
        live_workers: Callable[[], list[WorkerStatus]],
        topics: BatchTopics,
    ) -> None:
        self.settings = settings
        self.topics = topics
        self.store = store
        self.model = settings.served_model_name
        self.on_items: Callable[[], None] | None = None  # items are in the pool: ring its sleeping readers
        self.files: FileStore = LocalFileStore(
            Path(settings.batch_dir) if settings.batch_dir else default_home() / "files"
        )
        self.windows = allowed_windows(settings.batch_windows)
        self.live_workers = live_workers
        self.owner = f"{settings.frontend_id}-{secrets.token_hex(3)}"
        self.pool_topic = pool_topic(self.model)
        self.preparer = ItemPreparer(
            pre, self.model, batch_results_topic(self.model), settings.batch_priority, settings.frontend_id
        )
        self.lock_ttl_s = max(2.0, 3 * settings.heartbeat_interval_s)
        self.tick_s = max(0.1, settings.heartbeat_interval_s / 2)
        self.producer: AIOKafkaProducer | None = None
        self._work: dict[str, asyncio.Task[None]] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, producer: AIOKafkaProducer) -> AsyncIterator[None]:
        """Sweep active batches until the context ends; per-batch work is cancelled (its lock expires)."""
        self.producer = producer
        self._task = asyncio.create_task(self._sweep_loop(), name="batch-sweep")
        try:
            yield
        finally:
            self._task.cancel()
            for t in list(self._work.values()):
                t.cancel()
            await asyncio.gather(self._task, *self._work.values(), return_exceptions=True)

    def kick(self) -> None:
        """Sweep now (a batch was created or cancelled)."""
        self._kick.set()

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: try again next tick
                log.warning("batch sweep failed: %r", exc)
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick_s):
                    await self._kick.wait()

    async def sweep(self) -> None:
        """Start the work each active batch needs that nobody here is doing yet."""
        now = time.time()
        for batch_id in await self.store.active_batches():
            if batch_id in self._work:
                continue
            status, expires_at, total, completed, failed, submitted, cancelling_at = await self.store.fields(
                batch_id, "status", "expires_at", "total", "completed", "failed", "submitted", "cancelling_at"
            )
            if status is None:
                continue
            accounted = total is not None and int(completed or 0) + int(failed or 0) >= int(total)
            job: Callable[[str], object] | None = None
            if status in FINAL_STATUSES:
                job = self._close_final
            elif status in ("validating", "in_progress") and expires_at and now >= float(expires_at):
                job = self._expire
            elif status == "validating":
                job = self._submit
            elif status == "in_progress" and accounted and submitted == total:
                job = self._complete
            elif status == "in_progress" and submitted != total:
                job = self._submit
            elif status == "finalizing":
                job = self._complete
            elif status == "cancelling" and (
                accounted or now >= float(cancelling_at or 0) + self.settings.batch_cancel_grace_s
            ):
                job = self._finish_cancel
            if job is not None:
                self._start(batch_id, job)

    def _start(self, batch_id: str, job: Callable[[str], object]) -> None:
        async def guarded() -> None:
            try:
                async with self._owning(batch_id) as mine:
                    if mine:
                        await job(batch_id)  # type: ignore[misc]
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "batch %s: %s failed; the sweep retries", batch_id, getattr(job, "__name__", job)
                )
            finally:
                self._work.pop(batch_id, None)

        self._work[batch_id] = asyncio.create_task(guarded(), name=f"batch-{batch_id}")

    @contextlib.asynccontextmanager
    async def _owning(self, batch_id: str) -> AsyncIterator[bool]:
        """Hold the batch's lock (renewed in the background) for the duration, if nobody else has it."""
        if not await self.store.lock(batch_id, self.owner, self.lock_ttl_s):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.lock_ttl_s / 3)  # renewal period
                with contextlib.suppress(Exception):
                    await self.store.renew(batch_id, self.owner, self.lock_ttl_s)

        renewer = asyncio.create_task(renew())
        try:
            yield True
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.unlock(batch_id, self.owner))

    # ---- submission ------------------------------------------------------------------------------

    async def _submit(self, batch_id: str) -> None:
        batch = await self.store.get_batch(batch_id)
        if batch is None or batch.status not in ("validating", "in_progress"):
            return
        workers = self.live_workers()
        if not workers:
            return  # stays as it is until a worker of the model is up; the sweep comes back
        max_len = min(w.max_model_len for w in workers)
        block_size = workers[0].block_size
        try:
            data = await self.files.read(batch.input_file_id)
        except FileNotFoundError:
            await self._fail(batch_id, "file_not_found", f"The input file {batch.input_file_id} is gone.")
            return
        parsed = await asyncio.to_thread(parse_batch_file, data, self.settings.batch_max_requests)
        errors = list(parsed.errors)
        for line_no, line in parsed.lines:
            if line.url != batch.endpoint and len(errors) < 10:
                errors.append(
                    _batch_error(
                        "mismatched_url",
                        f"Line {line_no}: `url` {line.url} differs from the batch's "
                        f"endpoint {batch.endpoint}.",
                        line_no,
                        "url",
                    )
                )
        if errors:
            await self._fail(batch_id, None, None, errors)
            return
        prepared: list[PreparedItem] = []
        refused: dict[int, bytes] = {}
        metas: dict[int, ItemMeta] = {}
        for index, (_line_no, line) in enumerate(parsed.lines):
            try:
                p = await self.preparer.prepare(
                    item_id(batch_id, index),
                    index,
                    line.custom_id,
                    batch.endpoint,  # type: ignore[arg-type]
                    bytes(line.body),
                    max_len,
                    float(batch.expires_at),
                    batch_id=batch_id,
                )
            except APIError as err:
                refused[index] = error_line(line.custom_id, err)
                metas[index] = ItemMeta(
                    custom_id=line.custom_id,
                    endpoint=batch.endpoint,  # type: ignore[arg-type]
                    model=self.model,
                    prompt_lens=[],
                )
                continue
            prepared.append(p)
            metas[index] = p.meta
        total = len(parsed.lines)
        if batch.status == "validating":
            tenant, key_id = await self.store.fields(batch_id, "tenant", "key_id")
            for m in metas.values():
                m.tenant, m.key_id = tenant or "", key_id or ""
            await self.store.put_items(batch_id, metas)
            await self.store.set_fields(batch_id, {"total": total})
            for index, line_bytes in refused.items():
                await self.store.record(batch_id, index, line_bytes, ok=False)
            moved, now_status = await self.store.transition(
                batch_id, ["validating"], "in_progress", {"in_progress_at": int(time.time())}
            )
            if not moved:
                log.info("batch %s became %s during validation; nothing submitted", batch_id, now_status)
                return
            log.info(
                "batch %s: %d request(s), %d refused, submitting to %s",
                batch_id,
                total,
                len(refused),
                self.pool_topic,
            )
        await self._produce(batch, prepared, block_size)

    async def _produce(self, batch: Batch, prepared: list[PreparedItem], block_size: int) -> None:
        assert self.producer is not None
        batch_id = batch.id
        (submitted_raw,) = await self.store.fields(batch_id, "submitted")
        submitted = int(submitted_raw or 0)
        partitions = await self._partitions()
        order = (
            plan(
                [(p.index, p.first_prompt) for p in prepared],
                partitions,
                self.model,
                block_size,
                self.settings.batch_order,
            )
            if prepared
            else []
        )
        by_index = {p.index: p for p in prepared}
        done = await self.store.done_items(batch_id)
        position = submitted
        while position < len(order):
            (status,) = await self.store.fields(batch_id, "status")
            if status != "in_progress" or time.time() >= batch.expires_at:
                log.info(
                    "batch %s is %s; stopped submitting at item %d of %d",
                    batch_id,
                    status,
                    position,
                    len(order),
                )
                return
            futures = []
            topic = await self.topics.pool_now()  # the epoch of the clock, with --pool-roll-s
            for index, partition in order[position : position + _PRODUCE_CHUNK]:
                if index in done:
                    continue
                futures.append(
                    await self.producer.send(
                        topic,
                        by_index[index].message,
                        key=item_id(batch_id, index).encode(),
                        partition=partition,
                    )
                )
            await asyncio.gather(*futures)
            if futures and self.on_items is not None:
                self.on_items()
            position = min(len(order), position + _PRODUCE_CHUNK)
            await self.store.set_fields(batch_id, {"submitted": position})
        # Items refused at validation count as submitted: they have their lines already.
        (total,) = await self.store.fields(batch_id, "total")
        await self.store.set_fields(batch_id, {"submitted": int(total or 0)})
        self.kick()

    async def _partitions(self) -> int:
        assert self.producer is not None
        return len(await self.producer.partitions_for(await self.topics.pool_now()))

    async def _fail(
        self, batch_id: str, code: str | None, message: str | None, errors: list[BatchError] | None = None
    ) -> None:
        data = (
            errors
            if errors is not None
            else [_batch_error(code or "failed", message or "failed", None, None)]
        )
        moved, _ = await self.store.transition(
            batch_id,
            ["validating"],
            "failed",
            {
                "failed_at": int(time.time()),
                "errors": json_encoder.encode(BatchErrors(data=data)).decode(),
                "closed": 1,
            },
        )
        if moved:
            log.info("batch %s failed validation", batch_id)
            await self.store.close(batch_id)

    # ---- ending ----------------------------------------------------------------------------------

    async def _complete(self, batch_id: str) -> None:
        moved, status = await self.store.transition(
            batch_id, ["in_progress"], "finalizing", {"finalizing_at": int(time.time())}
        )
        if not moved and status != "finalizing":
            return
        await self._finalize(batch_id, "finalizing", "completed", "completed_at")

    async def _expire(self, batch_id: str) -> None:
        await self.store.stop(batch_id)
        await self._fill_unrun(
            batch_id, "batch_expired", "The batch's completion window ended before this request ran."
        )
        await self._finalize(batch_id, "in_progress,validating", "expired", "expired_at")

    async def _finish_cancel(self, batch_id: str) -> None:
        await self._fill_unrun(
            batch_id, "batch_cancelled", "The batch was cancelled before this request ran."
        )
        await self._finalize(batch_id, "cancelling", "cancelled", "cancelled_at")

    async def _close_final(self, batch_id: str) -> None:
        await self.store.close(batch_id)

    async def _fill_unrun(self, batch_id: str, code: str, message: str) -> None:
        """An error line for every item that has no line yet."""
        (total,) = await self.store.fields(batch_id, "total")
        if total is None:
            return
        done = await self.store.done_items(batch_id)
        missing = [i for i in range(int(total)) if i not in done]
        for start in range(0, len(missing), 1000):
            part = missing[start : start + 1000]
            for index, meta in zip(part, await self.store.item_metas(batch_id, part), strict=True):
                custom_id = meta.custom_id if meta is not None else f"item-{index}"
                await self.store.record(batch_id, index, unrun_line(custom_id, code, message), ok=False)

    async def _finalize(self, batch_id: str, allowed: str, final: str, stamp: str) -> None:
        """Close the batch to late results, write its output and error files, enter the final status."""
        await self.store.set_fields(batch_id, {"closed": 1})
        (status,) = await self.store.fields(batch_id, "status")
        if status not in allowed.split(","):
            return
        values: dict[str, str | int] = {stamp: int(time.time())}
        for kind, field in (("out", "output_file_id"), ("err", "error_file_id")):
            lines = await self.store.lines(batch_id, kind)
            if not lines:
                continue
            fid = result_file_id(batch_id, kind)
            size = await self.files.write(fid, [line + b"\n" for line in lines])
            filename = "batch_output.jsonl" if kind == "out" else "batch_errors.jsonl"
            await self.store.put_file(
                FileObject(
                    id=fid,
                    bytes=size,
                    created_at=int(time.time()),
                    filename=f"{batch_id}_{filename}",
                    purpose="batch_output",
                )
            )
            values[field] = fid
        moved, before = await self.store.transition(batch_id, allowed.split(","), final, values)
        if moved:
            log.info("batch %s %s (was %s)", batch_id, final, before)
            await self.store.close(batch_id)

    # ---- API operations --------------------------------------------------------------------------

    async def cancel(self, batch_id: str) -> Batch:
        """Move a batch to `cancelling`; workers skip its queued items and abort its running ones."""
        moved, status = await self.store.transition(
            batch_id, ["validating", "in_progress"], "cancelling", {"cancelling_at": int(time.time())}
        )
        if status is None:
            raise APIError(404, f"No batch with id {batch_id}.", param="batch_id", code="not_found")
        if not moved and status not in ("cancelling", "cancelled"):
            raise APIError(409, f"A batch that is {status} cannot be cancelled.", code="invalid_state")
        if moved:
            await self.store.stop(batch_id)
            self.kick()
        batch = await self.store.get_batch(batch_id)
        assert batch is not None
        return batch


def _batch_error(code: str, message: str, line: int | None, param: str | None) -> BatchError:
    return BatchError(code=code, message=message, param=param, line=line)
