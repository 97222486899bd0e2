"""Redis clients for Ferry's processes: one place that builds them, with what every client shares."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.driver_info import DriverInfo

# What each connection tells the server with CLIENT SETINFO. Built once: left to redis-py, every new pooled
# connection reads the package's version from its installed metadata, ~0.8 ms of file system work on the
# event loop each time a pool grows (a burst of requests at a frontend opens many at once).
_DRIVER = DriverInfo()


def redis_client(url: str, *, timeout_s: float = 2.0, connect_timeout_s: float = 2.0) -> aioredis.Redis:
    """An asyncio Redis client for `url` whose commands and connects time out instead of hanging."""
    return aioredis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s, driver_info=_DRIVER
    )
