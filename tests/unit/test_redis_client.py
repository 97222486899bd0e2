"""Every Redis client Ferry builds shares one driver description, so a growing pool reads no package metadata."""

from __future__ import annotations

from unittest import mock

from kvstore.connect import redis_client


def test_new_connections_do_not_look_up_the_library_version() -> None:
    client = redis_client("redis://127.0.0.1:1/0", timeout_s=3.0)
    with mock.patch("redis.utils.metadata.version", side_effect=AssertionError("metadata read")):
        conns = [client.connection_pool.make_connection() for _ in range(3)]
    assert conns[0].driver_info is conns[1].driver_info is redis_client("redis://127.0.0.1:2/0").connection_pool.make_connection().driver_info
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 3.0
