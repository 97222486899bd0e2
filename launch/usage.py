"""`ferry usage`: sum the usage topic's records since a time, by tenant, model or key."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from bus.reader import GAP_TRIES
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


class Holes:
    """Where each partition's next record is, and how often the hole there was read again."""

    def __init__(self, starts: dict[TopicPartition, int]) -> None:
        self.next = dict(starts)
        self.tries: dict[TopicPartition, int] = {}

    def whole(self, consumer: AIOKafkaConsumer, tp: TopicPartition, records: Sequence[Any]) -> list[Any]:
        """The records up to the first hole, the consumer moved back to read it again (broker quirk "fetch
        skips a batch", bus/reader.py); past a hole only once it was read GAP_TRIES times."""
        out: list[Any] = []
        for r in records:
            if r.offset > self.next[tp] and self.tries.get(tp, 0) < GAP_TRIES:
                self.tries[tp] = self.tries.get(tp, 0) + 1
                consumer.seek(tp, self.next[tp])
                return out
            if r.offset >= self.next[tp]:
                out.append(r)
                self.next[tp] = r.offset + 1
                self.tries.pop(tp, None)
        return out


async def read_usage(kafka: str, since: float, timeout_s: float = 10.0) -> list[UsageRecord]:
    """Every record of the usage topic at or after `since`, up to the topic's end when called."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(usage_topic()) or set()
        if not parts:
            await (
                consumer._client.force_metadata_update()
            )  # a consumer without subscriptions has no metadata yet
            parts = consumer.partitions_for_topic(usage_topic()) or set()
        tps = [TopicPartition(usage_topic(), p) for p in sorted(parts)]
        if not tps:
            return []
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        # Records are in time order per partition, near enough: start at the first offset at `since`.
        found = await consumer.offsets_for_times({tp: int(since * 1000) for tp in tps})
        starts = {tp: ends[tp] if found.get(tp) is None else found[tp].offset for tp in tps}
        for tp, offset in starts.items():
            consumer.seek(tp, offset)
        holes = Holes(starts)
        decoder = msgspec.json.Decoder(UsageRecord)
        out: list[UsageRecord] = []
        deadline = time.monotonic() + timeout_s
        while any([await consumer.position(tp) < ends[tp] for tp in tps]) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for tp, records in batches.items():
                for r in holes.whole(consumer, tp, records):
                    if r.offset < ends[tp] and r.value is not None:
                        rec = decoder.decode(r.value)
                        if rec.at >= since:
                            out.append(rec)
        return out
    finally:
        await consumer.stop()


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
