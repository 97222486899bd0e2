"""`ferry usage`: sum the usage topic's records since a time, by tenant, model or key."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime as dt
import io
import re
import sys
import time
from collections.abc import Sequence

import msgspec
from aiokafka import TopicPartition

from bus.log_watch import positions_and_ends
from bus.read_spec import Batch, Hooks, Options, Poll
from bus.reader import Reader
from launch.flags import load
from schemas.names import usage_topic
from schemas.ops_settings import UsageSettings
from schemas.tenants import UsageRecord

COLUMNS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """Unix time of `--since`: a duration back from now (`90m`, `24h`, `7d`) or an ISO time (UTC by default)."""
    now = time.time() if now is None else now
    m = _DURATION.fullmatch(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise SystemExit(
            f"ferry usage: --since {text!r}: expected a duration (90m, 24h, 7d) or an ISO time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


async def read_usage(kafka: str, since: float, timeout_s: float = 10.0) -> list[UsageRecord]:
    """Every record of the usage topic at or after `since`, up to the topic's end as the read finds it."""
    out: list[UsageRecord] = []
    starts: dict[TopicPartition, int] = {}
    read_all = asyncio.Event()

    async def handle(batch: Batch[UsageRecord]) -> None:
        out.extend(rec for _r, rec in batch.messages if rec.at >= since)

    async def after_poll(_brought: bool) -> None:
        # The end is the high watermark fetches carry, never a ListOffsets answer: the embedded broker's
        # stops short of the end by the rest of the last batch (docs/architecture.md, broker quirk "ListOffsets
        # short of the end"), and records a frontend sent within one linger went missing from the totals.
        read = await positions_and_ends(reader.consumer)
        if len(read) == len(starts) and all(position >= end for _tp, position, end in read):
            read_all.set()

    # Through a Reader: it reads again what a fetch skipped (broker quirk "fetch skips a batch").
    reader = Reader(
        "ferry usage", kafka, msgspec.json.Decoder(UsageRecord), Options(poll=Poll(500, 500)),
        Hooks(handle, after_poll=after_poll),
    )  # fmt: skip
    await reader.open()
    try:
        consumer = reader.consumer
        parts = consumer.partitions_for_topic(usage_topic()) or set()
        if not parts:
            await (
                consumer._client.force_metadata_update()
            )  # a consumer without subscriptions has no metadata yet
            parts = consumer.partitions_for_topic(usage_topic()) or set()
        tps = [TopicPartition(usage_topic(), p) for p in sorted(parts)]
        if not tps:
            return []
        # Records are in time order per partition, near enough: start at the first offset at `since`; a
        # partition with none there has nothing to read.
        found = await consumer.offsets_for_times({tp: int(since * 1000) for tp in tps})
        starts.update({tp: at.offset for tp, at in found.items() if at is not None})
        if not starts:
            return []
        await reader.assign(starts)
        reader.run()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await read_all.wait()
        return out
    finally:
        await reader.stop()


def summarize(records: list[UsageRecord], by: str) -> dict[str, dict[str, int]]:
    """Totals of each column per group (`tenant`, `model` or `key`)."""
    field = {"tenant": "tenant", "model": "model", "key": "key_id"}[by]
    out: dict[str, dict[str, int]] = {}
    for r in records:
        row = out.setdefault(getattr(r, field), dict.fromkeys(COLUMNS, 0))
        for c in COLUMNS:
            row[c] += getattr(r, c)
    return dict(sorted(out.items()))


def render(totals: dict[str, dict[str, int]], by: str, as_csv: bool) -> str:
    """The summary as CSV or as an aligned table."""
    header = [by, *COLUMNS]
    rows = [[name, *(str(v[c]) for c in COLUMNS)] for name, v in totals.items()]
    if as_csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
        return buf.getvalue()
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(r))
             for r in [header, *rows]]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the usage since `--since`, grouped by `--by`."""
    s = load(UsageSettings, argv, prog="ferry usage")
    records = asyncio.run(read_usage(s.kafka, parse_since(s.since)))
    sys.stdout.write(render(summarize(records, s.by), s.by, s.csv))
    return 0
