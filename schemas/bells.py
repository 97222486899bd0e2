"""What doorbells say over Redis pub/sub beyond a bare ring: a replies reader going to sleep (bus/doorbell.py)."""

from __future__ import annotations

import msgspec


class RepliesAsleep(msgspec.Struct, frozen=True):
    """A frontend's replies reader stops fetching: ring `channel` once a record at or after a topic's offset is in.

    Published to every worker (`RedisKeys.replies_asleep`); a worker that has already had such a record
    acknowledged rings at once, any other when its next one is (workers/reply_bells.py).
    """

    channel: str
    # Replies topic -> the offset of the next record the reader would read there.
    positions: dict[str, int]


asleep_encoder = msgspec.msgpack.Encoder()
asleep_decoder = msgspec.msgpack.Decoder(RepliesAsleep)
