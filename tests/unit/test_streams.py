"""Which chunks a client stream accepts: a pure function of their order, so a replay matches the original."""

from __future__ import annotations

from schemas.kafka import Chunk, ErrorInfo
from server.losses import engine_death
from server.router import Decision
from server.streams import ClientStream, Loss, Sequence, marker


def stream() -> ClientStream:
    s = ClientStream("chatcmpl-x")
    s.sequences["chatcmpl-x.0"] = Sequence("chatcmpl-x.0", 0, 0, Decision("w1"), 10)
    return s


def accepted(s: ClientStream, chunks: list[Chunk]) -> list[tuple[int, int, list[int]]]:
    for c in chunks:
        s.put(c)
    return [(c.seq, c.attempt, c.token_ids) for _, c in s._items]


RID = "chatcmpl-x.0"


def test_duplicates_and_unknown_requests_are_dropped() -> None:
    s = stream()
    out = accepted(s, [Chunk(RID, 0, [1]), Chunk(RID, 0, [1]), Chunk("other.0", 0, [9]), Chunk(RID, 1, [2])])
    assert out == [(0, 0, [1]), (1, 0, [2])]
    assert s.sequences[RID].token_ids == [1, 2]


def test_after_a_marker_only_the_new_attempt_counts() -> None:
    s = stream()
    chunks = [
        Chunk(RID, 0, [1]),
        Chunk(RID, 1, [2]),
        marker(RID, 1, "w2"),
        Chunk(RID, 2, [3]),  # late chunk of the old worker: dropped
        Chunk(RID, 2, [3], attempt=1),
        Chunk(RID, 3, [4], finish_reason="length", attempt=1),
        Chunk(RID, 4, [5], attempt=1),  # after the end: dropped
    ]
    out = accepted(s, chunks)
    assert out == [(0, 0, [1]), (1, 0, [2]), (2, 1, [3]), (3, 1, [4])]
    seq = s.sequences[RID]
    assert seq.finished and seq.attempt == 1 and seq.token_ids == [1, 2, 3, 4]
    assert seq.switched.is_set()


def test_replaying_the_same_topic_order_accepts_the_same_chunks() -> None:
    chunks = [Chunk(RID, 0, [1]), marker(RID, 1, "w2"), Chunk(RID, 1, [7]), Chunk(RID, 1, [2], attempt=1)]
    assert accepted(stream(), chunks) == accepted(stream(), list(chunks))


def test_an_ending_of_the_frontend_continues_the_numbering() -> None:
    s = stream()
    s.put(Chunk(RID, 0, [1]))
    s.fail(RID, ErrorInfo("worker_died", "gone", retriable=True))
    _, last = s._items[-1]
    assert (last.seq, last.finish_reason, last.error is not None) == (1, "error", True)
    assert s.finished and s.ending(RID, ErrorInfo("x", "y")) is None


def test_a_missing_chunk_breaks_the_attempt_once_until_a_marker_moves_it() -> None:
    lost: list[str] = []
    s = stream()
    s.on_lost = lambda seq, why: lost.append(f"{seq.request_id} {why.name}")
    chunks = [
        Chunk(RID, 0, [1]),
        Chunk(RID, 2, [3]),  # chunk 1 never reached the topic
        Chunk(RID, 3, [4]),
        Chunk(RID, 1, [2]),  # chunk 1 sent again, too late: the sequence is already moving
        marker(RID, 1, "w2"),
        Chunk(RID, 1, [2], attempt=1),
        Chunk(RID, 2, [3], finish_reason="length", attempt=1),
    ]
    out = accepted(s, chunks)
    assert lost == [f"{RID} CHUNK_LOST"]
    assert out == [(0, 0, [1]), (1, 1, [2]), (2, 1, [3])]
    assert s.sequences[RID].token_ids == [1, 2, 3] and s.finished


def test_a_broken_attempt_still_takes_the_frontends_error_ending() -> None:
    s = stream()
    s.put(Chunk(RID, 0, [1]))
    s.put(Chunk(RID, 2, [3]))
    s.fail(RID, ErrorInfo("worker_died", "the move failed", retriable=True))
    _, last = s._items[-1]
    assert (last.seq, last.finish_reason) == (1, "error") and s.finished


def test_a_replay_drops_what_the_live_stream_dropped_after_a_gap() -> None:
    chunks = [Chunk(RID, 0, [1]), Chunk(RID, 2, [3]), marker(RID, 1, "w2"), Chunk(RID, 1, [2], attempt=1)]
    live = stream()
    live.on_lost = lambda seq, why: None
    assert accepted(live, list(chunks)) == accepted(stream(), list(chunks)) == [(0, 0, [1]), (1, 1, [2])]


def test_a_joined_chunk_counts_as_the_chunks_it_carries() -> None:
    lost: list[str] = []
    s = stream()
    s.on_lost = lambda seq, why: lost.append(why.name)
    chunks = [
        Chunk(RID, 0, [1, 2, 3], span=3),
        Chunk(RID, 2, [3]),  # one of those again (a replayed record): dropped
        Chunk(RID, 3, [4, 5], span=2),
        Chunk(RID, 5, [6], finish_reason="length"),
    ]
    assert accepted(s, chunks) == [(0, 0, [1, 2, 3]), (3, 0, [4, 5]), (5, 0, [6])]
    assert s.sequences[RID].token_ids == [1, 2, 3, 4, 5, 6] and s.finished and not lost
    # The chunk after a joined one is at its end, not at its seq + 1.
    s = stream()
    s.on_lost = lambda seq, why: lost.append(why.name)
    accepted(s, [Chunk(RID, 0, [1, 2], span=2), Chunk(RID, 3, [4])])
    assert lost == ["CHUNK_LOST"]


def test_a_workers_word_that_it_cannot_finish_an_attempt_moves_the_sequence_and_a_replay_skips_it() -> None:
    dead = ErrorInfo("engine_dead", "step loop crashed", retriable=True)
    chunks = [
        Chunk(RID, 0, [1]),
        Chunk(RID, 1, finish_reason="error", error=dead, worker_id="w1"),
        Chunk(RID, 1, [9]),  # nothing more of the attempt counts
        marker(RID, 1, "w2"),
        Chunk(RID, 1, [2], attempt=1),
        Chunk(RID, 2, finish_reason="error", error=ErrorInfo("worker_stopped", "x", True), worker_id="w2", attempt=1),
        marker(RID, 2, "w3"),
        Chunk(RID, 2, [3], finish_reason="length", attempt=2),
    ]
    live, losses = stream(), []
    live.on_lost = lambda seq, why: losses.append((why, seq.lost_on, seq.attempt_from))
    out = accepted(live, chunks)
    assert out == [(0, 0, [1]), (1, 1, [2]), (2, 2, [3])]
    assert losses == [(Loss.ENGINE_DIED, "w1", 0), (Loss.WORKER_STOPPED, "w2", 1)]
    assert live.sequences[RID].finished and live.sequences[RID].token_ids == [1, 2, 3]
    assert accepted(stream(), chunks) == out  # a replay (no mover) accepts the same chunks


def test_a_sequence_is_not_moved_again_after_two_engine_deaths_in_attempts_that_produced_nothing() -> None:
    seq = stream().sequences[RID]
    seq.lost_on = "w1"
    assert engine_death(seq) is None and seq.engine_deaths == ["w1"]
    # Generating on its next worker when that engine died: a bystander there, not counted.
    seq.token_ids, seq.lost_on = [1, 2], "w2"
    assert engine_death(seq) is None and seq.engine_deaths == ["w1"]
    seq.attempt_from, seq.lost_on = 2, "w3"
    refusal = engine_death(seq)
    assert refusal is not None and "w1, w3" in refusal and seq.engine_deaths == ["w1", "w3"]


def test_a_last_word_after_a_gap_moves_the_sequence_as_a_lost_chunk() -> None:
    """The chunk before it never arrived: its tokens are unknown here, so the engine's death is not counted
    against the sequence (it may have been generating); the gap moves it."""
    s, losses = stream(), []
    s.on_lost = lambda seq, why: losses.append(why)
    dead = ErrorInfo("engine_dead", "step loop crashed", retriable=True)
    out = accepted(s, [Chunk(RID, 0, [1]), Chunk(RID, 2, finish_reason="error", error=dead, worker_id="w1")])
    assert out == [(0, 0, [1])] and losses == [Loss.CHUNK_LOST]
    assert not s.sequences[RID].finished and s.sequences[RID].lost_attempt == -1
