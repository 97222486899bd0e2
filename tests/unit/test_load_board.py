"""The load frontends exchange through Redis: what one publishes, the others read back."""

from __future__ import annotations

from typing import Any

from kvstore.load import LoadBoard, WorkerLoad
from schemas.names import RedisKeys


class _Client:
    """Stands in for Redis: the exchange script returns the fields given here, as the Lua script would."""

    def __init__(self, others: list[bytes]) -> None:
        self.others = others
        self.sent: list[Any] = []

    def register_script(self, _source: str) -> Any:
        async def run(keys: list[str], args: list[Any]) -> list[bytes]:
            self.sent = args
            return self.others

        return run


async def test_read_blocks_travel_with_the_load_and_old_frontends_read_as_no_rereads() -> None:
    client = _Client([b"w1", b"10:13:4:40", b"w1", b"5:7:1", b"w2", b"0:3:1"])
    board = LoadBoard(client, RedisKeys("t"))  # type: ignore[arg-type]
    out = await board.exchange("me", {"w1": WorkerLoad(16, 13, 4, 40), "idle": WorkerLoad()}, 3.0)
    assert client.sent[2:] == ["w1", "16:13:4:40"]  # a worker with nothing in flight is not published
    # A frontend from before read_blocks publishes three fields: its decode blocks stand for its reads.
    assert out == {"w1": WorkerLoad(15, 20, 5, 47), "w2": WorkerLoad(0, 3, 1, 3)}
