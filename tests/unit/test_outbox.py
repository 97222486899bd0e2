"""What a worker's outbox makes of a round of queued chunks: one record per topic's consecutive chunks."""

from __future__ import annotations

from schemas.kafka import Chunk, Chunks, chunks_of, reply_decoder, request_encoder
from workers.outbox import MAX_CHUNKS_PER_RECORD, Outgoing, Reply, records


def reply(topic: str, rid: str, seq: int) -> Reply:
    return Reply(topic, Chunk(rid, seq, token_ids=[seq], text=f"t{seq}"))


def decoded(out: Outgoing) -> list[tuple[str, int]]:
    return [(c.request_id, c.seq) for c in chunks_of(reply_decoder.decode(out.value))]


def test_a_topics_chunks_share_one_record_in_order() -> None:
    items = [reply("fa", "r1", 0), reply("fb", "r2", 0), reply("fa", "r3", 0), reply("fa", "r1", 1)]
    out = records(list(items))
    assert [o.topic for o in out] == ["fa", "fb"]
    assert decoded(out[0]) == [("r1", 0), ("r3", 0), ("r1", 1)]
    assert isinstance(reply_decoder.decode(out[0].value), Chunks) and out[0].key is None
    # A lone chunk stays a plain Chunk record keyed by its request, as a reader of old records expects.
    assert isinstance(reply_decoder.decode(out[1].value), Chunk) and out[1].key == b"r2"


def test_a_ready_record_for_a_topic_goes_after_what_was_queued_before_it() -> None:
    resend = Outgoing("fa", b"r1", request_encoder.encode(Chunk("r1", 0)), tries=1)
    out = records([reply("fa", "r1", 1), resend, reply("fa", "r1", 2), reply("fb", "r9", 0)])
    assert [(o.topic, decoded(o)) for o in out] == [
        ("fa", [("r1", 1)]),
        ("fa", [("r1", 0)]),
        ("fa", [("r1", 2)]),
        ("fb", [("r9", 0)]),
    ]


def test_records_are_capped() -> None:
    n = MAX_CHUNKS_PER_RECORD * 2 + 1
    out = records([reply("fa", f"r{i}", 0) for i in range(n)])
    assert [len(decoded(o)) for o in out] == [MAX_CHUNKS_PER_RECORD, MAX_CHUNKS_PER_RECORD, 1]
    assert [rid for o in out for rid, _ in decoded(o)] == [f"r{i}" for i in range(n)]
