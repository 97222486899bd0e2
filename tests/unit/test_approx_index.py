"""The approximate index forgets blocks once their TTL has passed, not only at its size cap (issue 23)."""

from server.approx_index import ApproxIndex


def test_expired_blocks_are_dropped_as_new_ones_arrive() -> None:
    idx = ApproxIndex(ttl_s=2.0, max_blocks=1_000_000)
    for i in range(1000):  # 1000 prompts seen once, one second apart
        idx.record("m", "w0", [i * 10 + b for b in range(10)], now=float(i))
    # Only the prompts of the last ttl (2 s) can still count as cached; the rest must be gone.
    assert len(idx) <= 30
    assert idx.overlaps("m", [999 * 10 + b for b in range(10)], now=999.5) == {"w0": 10}
    assert idx.overlaps("m", [0, 1, 2], now=999.5) == {}


def test_a_rewritten_block_stays_while_fresh() -> None:
    idx = ApproxIndex(ttl_s=5.0)
    idx.record("m", "w0", [1, 2, 3], now=0.0)
    idx.record("m", "w1", [1], now=4.0)  # block 1 written again: it moves behind 2 and 3
    idx.record("m", "w0", [9], now=6.0)  # 2 and 3 expired at 5; 1 lives until 9
    assert len(idx) == 2
    assert idx.overlaps("m", [1], now=6.0) == {"w1": 1}


def test_forgotten_worker_leaves_no_empty_entries_behind_for_long() -> None:
    idx = ApproxIndex(ttl_s=100.0)
    idx.record("m", "w0", [1, 2], now=0.0)
    idx.forget_worker("w0")
    idx.record("m", "w1", [3], now=1.0)
    assert len(idx) == 1
