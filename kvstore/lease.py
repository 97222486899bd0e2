"""A lease in Redis: one holder among many processes (SET NX PX), renewed by its holder while it lives."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

# Renew the lease if it is ours, else take it if nobody holds it; 1 if we hold it now.
# KEYS[1] = the lease, ARGV[1] = the owner, ARGV[2] = milliseconds it lasts.
_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""


def lease_script(redis: Redis) -> AsyncScript:
    """The take-or-renew script, registered on `redis`: call it with keys=[lease], args=[owner, ms]."""
    return redis.register_script(_LEASE)
