"""Topic names and Redis keys: the single place where they are spelled."""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]+")

DEFAULT_REDIS_PREFIX = "ferry:"


def slug(name: str) -> str:
    """Turn a model or worker name into a Kafka-safe topic component."""
    s = _UNSAFE.sub("-", name).strip("-.")
    return s or "unnamed"


def request_topic(worker_id: str) -> str:
    """Topic one worker reads its routed requests from."""
    return f"ferry.requests.{slug(worker_id)}"


def reply_topic(frontend_id: str) -> str:
    """Topic one frontend reads its replies from."""
    return f"ferry.replies.{slug(frontend_id)}"


def pool_topic(model: str) -> str:
    """Topic all workers of one model read undirected (batch) work from."""
    return f"ferry.pool.{slug(model)}"


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

    def block(self, model: str, block_hash: int) -> str:
        """Set of workers holding one KV block of one model."""
        return f"{self.prefix}kv:{model}:{block_hash:016x}"

    def worker_blocks(self, worker_id: str) -> str:
        """Set of block hashes one worker holds (for one-sweep removal)."""
        return f"{self.prefix}kvw:{worker_id}"

    def frontends(self) -> str:
        """Set of frontend ids that publish router load."""
        return f"{self.prefix}frontends"

    def load(self, frontend_id: str) -> str:
        """One frontend's in-flight load per worker (field = worker id); expires with the frontend."""
        return f"{self.prefix}load:{frontend_id}"
