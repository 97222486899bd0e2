"""Topic names and Redis keys: the single place where they are spelled."""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]+")

DEFAULT_REDIS_PREFIX = "ferry:"


def slug(name: str) -> str:
    """Turn a model or worker name into a Kafka-safe topic component."""
    s = _UNSAFE.sub("-", name).strip("-.")
    return s or "unnamed"


def request_topic(worker_id: str, epoch: int | None = None) -> str:
    """Topic one worker reads its routed requests from; with `--request-roll-s`, one per epoch of the clock."""
    base = f"ferry.requests.{slug(worker_id)}"
    return base if epoch is None else f"{base}.e{epoch}"


def request_epoch(topic: str) -> int | None:
    """The epoch a rolled topic (requests, pool, batch results) belongs to (None: the unrolled topic)."""
    _, dot, tail = topic.rpartition(".e")
    return int(tail) if dot and tail.isdigit() else None


def reply_topic(frontend_id: str) -> str:
    """Topic one frontend reads its replies from."""
    return f"ferry.replies.{slug(frontend_id)}"


def admin_topic(frontend_id: str) -> str:
    """Topic one frontend reads workers' answers to its control messages (LoRA load/unload) from."""
    return f"ferry.admin.{slug(frontend_id)}"


def pool_topic(model: str, epoch: int | None = None) -> str:
    """Topic all workers of one model read undirected (batch) work from; with `--pool-roll-s`, one per epoch."""
    base = f"ferry.pool.{slug(model)}"
    return base if epoch is None else f"{base}.e{epoch}"


def pool_pattern(model: str) -> str:
    """Regex of every pool topic of one model: the unrolled one and each epoch (group members subscribe by it)."""
    return rf"^{re.escape(pool_topic(model))}(\.e[0-9]+)?$"


def pool_group(model: str) -> str:
    """Consumer group of every worker of one model on its pool topic."""
    return f"ferry-pool-{slug(model)}"


def batch_results_topic(model: str, epoch: int | None = None) -> str:
    """Topic workers send batch items' chunks to; read by the frontends' batch coordinators; with
    `--pool-roll-s`, one per epoch (workers write to the current one, whatever the item names)."""
    base = f"ferry.batch.results.{slug(model)}"
    return base if epoch is None else f"{base}.e{epoch}"


def batch_results_pattern(model: str) -> str:
    """Regex of every batch results topic of one model: the unrolled one and each epoch."""
    return rf"^{re.escape(batch_results_topic(model))}(\.e[0-9]+)?$"


def batch_results_group(model: str) -> str:
    """Consumer group of the frontends' batch coordinators of one model."""
    return f"ferry-batch-results-{slug(model)}"


def batch_submit_topic(model: str) -> str:
    """Topic other services produce Kafka-native batch items to (JSON, one request each)."""
    return f"ferry.batch.submit.{slug(model)}"


def batch_submit_group(model: str) -> str:
    """Consumer group of the frontends that take Kafka-native batch items of one model."""
    return f"ferry-batch-submit-{slug(model)}"


def kv_log_topic(model: str, epoch: int) -> str:
    """Topic of one model's KV log in one epoch of the wall clock (`--kv-log-roll-s`): workers' KV events and snapshots."""
    return f"ferry.kv.{slug(model)}.e{epoch}"


class RedisKeys:
    """Every Redis key Ferry uses, under one configurable prefix."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str = DEFAULT_REDIS_PREFIX) -> None:
        self.prefix = prefix

    def workers(self) -> str:
        """Set of worker ids that have registered (live or recently dead)."""
        return f"{self.prefix}workers"

    def worker(self, worker_id: str) -> str:
        """Status of one worker; expires when its heartbeats stop."""
        return f"{self.prefix}worker:{worker_id}"

    def registry_marker(self) -> str:
        """A random value (no TTL) set by the first read of the registry: a new value means Redis lost its data."""
        return f"{self.prefix}registry"

    def block(self, model: str, block_hash: int) -> str:
        """Set of workers holding one KV block of one model."""
        return f"{self.prefix}kv:{model}:{block_hash:016x}"

    def worker_blocks(self, worker_id: str) -> str:
        """Set of block hashes one worker holds (for one-sweep removal)."""
        return f"{self.prefix}kvw:{worker_id}"

    def kv_lease(self, model: str) -> str:
        """Which frontend's indexer writes `model`'s KV log back into an emptied index (expires)."""
        return f"{self.prefix}kvlease:{model}"

    def batch_roll_lease(self, model: str) -> str:
        """The frontend id deleting one model's read pool and batch results epochs (`--pool-roll-s`); expires."""
        return f"{self.prefix}batch-roll-lease:{model}"

    def kv_rebuilt(self, model: str) -> str:
        """The registry marker whose index the lease holder last rebuilt from the KV log."""
        return f"{self.prefix}kvrebuilt:{model}"

    def bell(self, worker_id: str) -> str:
        """Pub/sub channel that rings one worker's inbox awake (bus/doorbell.py)."""
        return f"{self.prefix}bell:{worker_id}"

    def replies_bell(self, frontend_id: str) -> str:
        """Pub/sub channel that rings one frontend's replies reader awake (workers/reply_bells.py)."""
        return f"{self.prefix}rbell:{frontend_id}"

    def kv_log_bell(self, model: str) -> str:
        """Pub/sub channel that rings frontends' KV log readers of one model (workers/kv_log.py)."""
        return f"{self.prefix}kvbell:{model}"

    def pool_bell(self, model: str) -> str:
        """Pub/sub channel that rings workers' pool consumers of one model: batch items are in (server/batch)."""
        return f"{self.prefix}poolbell:{model}"

    def results_bell(self, model: str) -> str:
        """Pub/sub channel that rings frontends' batch results readers of one model (workers/reply_bells.py)."""
        return f"{self.prefix}resbell:{model}"

    def replies_asleep(self) -> str:
        """Pub/sub channel every worker hears: a frontend's replies reader went to sleep (schemas/bells.py)."""
        return f"{self.prefix}asleep"

    def frontends(self) -> str:
        """Set of frontend ids that publish router load."""
        return f"{self.prefix}frontends"

    def frontend_members(self) -> str:
        """Set of frontend ids that have announced themselves (live or recently dead)."""
        return f"{self.prefix}frontend-ids"

    def frontend(self, frontend_id: str) -> str:
        """Announcement of one frontend (its URLs); expires when it stops refreshing it."""
        return f"{self.prefix}frontend:{frontend_id}"

    def load(self, frontend_id: str) -> str:
        """One frontend's in-flight load per worker (field = worker id); expires with the frontend."""
        return f"{self.prefix}load:{frontend_id}"

    # ---- batch API ---------------------------------------------------------------------------

    def file(self, file_id: str) -> str:
        """Metadata (MessagePack `FileObject`) of one stored file."""
        return f"{self.prefix}file:{file_id}"

    def files(self) -> str:
        """Sorted set of file ids by creation time."""
        return f"{self.prefix}files"

    def batch(self, batch_id: str) -> str:
        """Hash with one batch's status, timestamps, counts and static fields."""
        return f"{self.prefix}batch:{batch_id}"

    def batches(self) -> str:
        """Sorted set of batch ids by creation time (for listing)."""
        return f"{self.prefix}batches"

    def batches_active(self) -> str:
        """Set of batch ids not yet in a final state (what the coordinators sweep)."""
        return f"{self.prefix}batches:active"

    def batches_stopped(self) -> str:
        """Sorted set of cancelled or expired batch ids by time; workers skip and abort their items."""
        return f"{self.prefix}batches:stopped"

    def batch_items(self, batch_id: str) -> str:
        """Hash item index -> MessagePack `ItemMeta` of one batch."""
        return f"{self.prefix}batch:{batch_id}:items"

    def batch_done(self, batch_id: str) -> str:
        """Set of item indexes of one batch that have their output line (deduplication)."""
        return f"{self.prefix}batch:{batch_id}:done"

    def batch_lines(self, batch_id: str, kind: str) -> str:
        """List of output (`out`) or error (`err`) lines of one batch, until its files are written."""
        return f"{self.prefix}batch:{batch_id}:{kind}"

    def batch_lock(self, batch_id: str) -> str:
        """Which frontend is submitting or finalizing one batch (expires if it dies)."""
        return f"{self.prefix}batch:{batch_id}:lock"

    def batch_item(self, item_id: str) -> str:
        """`ItemMeta` of one Kafka-native batch item (expires)."""
        return f"{self.prefix}bitem:{item_id}"

    def batch_item_deaths(self, item_id: str) -> str:
        """Engine deaths a batch item met before it produced anything (workers/pool_consumer.py; expires)."""
        return f"{self.prefix}bitem:{item_id}:deaths"

    def batch_item_done(self, item_id: str) -> str:
        """Set once a Kafka-native item's result was sent (deduplication; expires)."""
        return f"{self.prefix}bitem:{item_id}:done"

    def stream(self, request_id: str) -> str:
        """Where a resumable stream's chunks are (a StreamRecord), with a TTL."""
        return f"{self.prefix}stream:{request_id}"

    def stream_reader(self, request_id: str) -> str:
        """Present while a client reads a resumed stream: its request must keep running."""
        return f"{self.prefix}stream:{request_id}:reader"


def usage_topic() -> str:
    """Topic every frontend publishes tenants' per-request usage to (`ferry usage` reads it)."""
    return "ferry.usage"
