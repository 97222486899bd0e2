"""Routing policies and the kv cost function, over a fixed set of workers."""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from kvstore.hashing import block_hashes, chain_seed
from schemas.settings import RouterSettings
from schemas.status import WorkerStatus
from server.errors import APIError
from server.metrics import FrontendMetrics
from server.router import AllBusy, Decision, PromptMemo, Router


def _w(wid: str, waiting: int = 0, kv_usage: float = 0.0, max_num_seqs: int = 0) -> WorkerStatus:
    load = {"waiting": waiting, "kv_usage": kv_usage, "max_num_seqs": max_num_seqs}
    return WorkerStatus(wid, "m", "sim", 16, 1000, 4096, 0.0, 0.0, **load)  # type: ignore[arg-type]


class FakeIndex:
    """Overlaps by worker, as the Redis index would answer them; `fail` simulates an outage."""

    def __init__(self, held: dict[str, int], host: dict[str, int] | None = None) -> None:
        self.held = held
        self.host = host or {}  # of the held blocks, how many only on the worker's host tier
        self.fail = False
        self.calls = 0
        self.marker: str | None = "m0"  # the registry marker each lookup reads

    async def lookup(self, model: str, chain: list[int]) -> tuple[dict[str, tuple[int, int]], str | None]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("redis down")
        return {w: (min(n, len(chain)), self.host.get(w, 0)) for w, n in self.held.items() if n}, self.marker


def _router(policy: str = "kv", index: FakeIndex | None = None, seed: int = 0, **cfg: object) -> Router:
    return Router(RouterSettings(router_policy=policy, **cfg), FrontendMetrics(), index, random.Random(seed))  # type: ignore[arg-type]


PROMPT = list(range(160))  # 10 blocks of 16


async def test_round_robin_cycles() -> None:
    r = _router("round_robin")
    workers = [_w("b"), _w("a"), _w("c")]
    picks = [(await r.choose("m", workers, PromptMemo(PROMPT))).worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


async def test_random_covers_every_worker() -> None:
    r = _router("random")
    picks = Counter(
        [(await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))).worker_id for _ in range(200)]
    )
    assert set(picks) == {"a", "b"} and min(picks.values()) > 50


async def test_least_loaded_counts_local_remote_and_waiting() -> None:
    r = _router("least_loaded")
    workers = [_w("a"), _w("b", waiting=2)]
    for _ in range(2):
        r.started(await r.choose("m", workers, PromptMemo(PROMPT)))
    assert r.local["a"].sequences == 2
    r.remote = {"b": r.local["a"].__class__(0, 0, 1)}  # another frontend has 1 on b: b = 3, a = 2
    assert (await r.choose("m", workers, PromptMemo(PROMPT))).worker_id == "a"


async def test_kv_prefers_the_holder_of_a_long_prefix() -> None:
    idx = FakeIndex({"b": 8})
    r = _router(index=idx)
    d = await r.choose("m", [_w("a"), _w("b"), _w("c")], PromptMemo(PROMPT))
    assert (d.worker_id, d.predicted_cached_blocks) == ("b", 8)
    assert d.prefill_tokens == 160 - 8 * 16 and d.decode_blocks == 10


@pytest.mark.parametrize(
    ("host", "weight", "winner"),
    [(8, 0.75, "b"), (8, 1.0, "a"), (2, 0.75, "a"), (0, 0.0, "a")],
    ids=["8-on-host-count-6", "host-weighted-fully", "2-on-host-count-7.5", "all-on-device"],
)
async def test_kv_counts_host_tier_blocks_at_their_weight(host: int, weight: float, winner: str) -> None:
    # a holds 8 leading blocks, `host` of them only on its host tier; b holds 7 on its device.
    r = _router(index=FakeIndex({"a": 8, "b": 7}, host={"a": host}), host_block_weight=weight)
    d = await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))
    assert d.worker_id == winner
    expected = (8, host) if winner == "a" else (7, 0)
    assert (d.predicted_cached_blocks, d.predicted_host_blocks) == expected
    # Loading host blocks back is not prefill: the tokens to compute are the uncached ones.
    assert d.prefill_tokens == 160 - expected[0] * 16


class FakeStandby:
    """The KV log's copy of the index: answers with its own holders; the marker it last read is `marker`; not
    caught up with the log unless said."""

    def __init__(self, held: dict[str, int], marker: str | None, caught_up: bool = False) -> None:
        self.held, self.marker, self.rebuilding, self.caught_up = held, marker, False, caught_up

    def overlaps(self, model: str, chain: list[int]) -> dict[str, tuple[int, int]]:
        return {w: (n, 0) for w, n in self.held.items()}

    def marker_changed(self, marker: str | None) -> bool:
        return marker != self.marker


@pytest.mark.parametrize(
    ("lookup", "caught_up", "from_redis"),
    [("mirror", True, False), ("mirror", False, True), ("redis", True, True)],
    ids=["mirror-caught-up", "mirror-catching-up", "redis"],
)
async def test_a_caught_up_copy_answers_without_a_round_trip(lookup: str, caught_up: bool, from_redis: bool) -> None:
    # The index in Redis and the copy disagree, so the answer shows which one was asked.
    idx = FakeIndex({"a": 8})
    r = _router(index=idx, kv_lookup=lookup)
    r.standby = FakeStandby({"b": 6}, marker="m0", caught_up=caught_up)
    d = await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))
    assert idx.calls == int(from_redis)
    assert (d.worker_id, d.predicted_cached_blocks) == (("a", 8) if from_redis else ("b", 6))


@pytest.mark.parametrize("marker", ["m0", "m1", None], ids=["same", "new", "missing"])
async def test_a_lookup_reading_another_marker_is_answered_by_the_copy(marker: str | None) -> None:
    # Redis answers with an empty index; whether that is the truth depends on the marker read with it.
    idx = FakeIndex({})
    idx.marker = marker
    r = _router(index=idx)
    r.standby = FakeStandby({"b": 8}, marker="m0")
    d = await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))
    assert idx.calls == 1
    assert d.predicted_cached_blocks == (0 if marker == "m0" else 8)
    if marker != "m0":
        assert d.worker_id == "b"


@pytest.mark.parametrize("copy", [True, False], ids=["kv-log-copy", "none"])
async def test_an_unreachable_index_is_logged_with_what_routes_meanwhile(
    copy: bool, caplog: pytest.LogCaptureFixture
) -> None:
    idx = FakeIndex({})
    idx.fail = True
    r = _router(index=idx)
    if copy:
        r.standby = FakeStandby({"b": 8}, marker="m0")
    with caplog.at_level(logging.ERROR, logger="ferry.router"):
        d = await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))
    assert d.predicted_cached_blocks == (8 if copy else 0)
    expected = "routing by the KV log's copy of the index" if copy else "routing by load only"
    assert expected in caplog.text


async def test_kv_load_pushes_requests_away_from_a_busy_holder() -> None:
    r = _router(index=FakeIndex({"b": 4}))
    workers = [_w("a"), _w("b")]
    first = await r.choose("m", workers, PromptMemo(PROMPT))
    assert first.worker_id == "b"
    # Pile work onto b: each sequence adds its prefill tokens and decode blocks there.
    for _ in range(3):
        r.started(first)
    assert (await r.choose("m", workers, PromptMemo(PROMPT))).worker_id == "a"
    for _ in range(3):
        r.finished(first)
    assert "b" not in r.local
    assert (await r.choose("m", workers, PromptMemo(PROMPT))).worker_id == "b"


async def test_distinct_decode_load_counts_shared_prefix_blocks_once() -> None:
    r = _router(index=FakeIndex({"b": 9}))
    workers = [_w("a"), _w("b")]
    prompts = [PROMPT[:144] + [50_000 + i] * 16 for i in range(4)]  # 9 shared blocks + 1 own block each
    decisions = []
    for p in prompts:
        d = await r.choose("m", workers, PromptMemo(p))
        assert d.worker_id == "b"  # the holder keeps winning: the shared blocks are already held there
        r.started(d)
        r.prefilled(d)  # the prompt is computed; only decode load remains
        decisions.append(d)
    assert r.local["b"].decode_blocks == 9 + 4  # shared prefix once, plus each sequence's own block
    for d in decisions:
        r.finished(d)
    assert r.local == {} and r.active_blocks == {}


async def test_sequence_decode_load_charges_every_sequence_its_blocks() -> None:
    r = _router(index=FakeIndex({"b": 9}), decode_load="sequences")
    workers = [_w("a"), _w("b")]
    prompts = [PROMPT[:144] + [50_000 + i] * 16 for i in range(4)]
    first = await r.choose("m", workers, PromptMemo(prompts[0]))
    assert first.worker_id == "b"
    r.started(first)
    r.prefilled(first)
    assert r.local["b"].decode_blocks == 10
    # b: 1 block to prefill + 10 decoding + 10 = 21; a: 10 to prefill + 0 + 10 = 20. The engine's decode
    # step on b reads the running sequence's 10 blocks as well, shared or not.
    second = await r.choose("m", workers, PromptMemo(prompts[1]))
    assert second.worker_id == "a"
    # With weight 2 on prefill the cache wins again: b = 2 + 20 = 22 against a = 20 + 10 = 30.
    r2 = _router(index=FakeIndex({"b": 9}), overlap_weight=2.0, decode_load="sequences")
    r2.started(d := await r2.choose("m", workers, PromptMemo(prompts[0])))
    r2.prefilled(d)
    assert (await r2.choose("m", workers, PromptMemo(prompts[1]))).worker_id == "b"
    r.finished(first)
    assert r.local == {} and r.active_blocks == {}


@pytest.mark.parametrize(("reread", "winner"), [(None, "a"), (0.0, "b")], ids=["default", "distinct-only"])
async def test_decode_load_sees_a_shared_prefix_read_once_per_sequence(
    reread: float | None, winner: str
) -> None:
    # b decodes 4 sequences on one 9-block prefix: 13 distinct blocks, but each step reads 40. a decodes one
    # sequence of 14 blocks of its own. (At trace rate 14 one worker took a long conversation's turns this way
    # until its steps read 5x what the router counted, and requests there could not finish.)
    r = (
        _router(index=FakeIndex({}))
        if reread is None
        else _router(index=FakeIndex({}), decode_reread_weight=reread)
    )
    shared = [PROMPT[:144] + [50_000 + i] * 16 for i in range(4)]
    for p in shared:
        d = await r.choose("m", [_w("b")], PromptMemo(p))
        r.started(d)
        r.prefilled(d)
    r.started(d := await r.choose("m", [_w("a")], PromptMemo(list(range(9000, 9224)))))
    r.prefilled(d)
    # An unrelated prompt, 10 blocks: a = 10 + 14 + 10 = 34; b = 10 + 13 + 0.1 * (40 - 13) + 10 = 35.7
    # (33 counting distinct blocks only, which sends it to the worker whose steps are slower).
    assert (
        await r.choose("m", [_w("a"), _w("b")], PromptMemo(list(range(20_000, 20_160))))
    ).worker_id == winner
    assert (r.local["a"].decode_blocks, r.local["a"].read_blocks) == (14, 14)
    assert (r.local["b"].decode_blocks, r.local["b"].read_blocks) == (13, 40)


async def test_a_turn_of_a_shared_prefix_still_goes_to_its_holder() -> None:
    # The next sequence on b's prefix is charged the rereads of its 9 shared blocks (0.9), not their memory:
    # b = 1 to prefill + 13 + 2.7 + (10 - 9 + 0.9) = 18.6 against a = 10 + 14 + 10 = 34.
    r = _router(index=FakeIndex({}))
    for i in range(4):
        r.started(d := await r.choose("m", [_w("b")], PromptMemo(PROMPT[:144] + [50_000 + i] * 16)))
        r.prefilled(d)
    r.started(d := await r.choose("m", [_w("a")], PromptMemo(list(range(9000, 9224)))))
    r.prefilled(d)
    assert (
        await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT[:144] + [60_000] * 16))
    ).worker_id == "b"


@pytest.mark.parametrize("inflight_overlap", [True, False])
async def test_kv_counts_blocks_still_being_prefilled_as_held(inflight_overlap: bool) -> None:
    # The index knows nothing yet: the first turn is still in prefill when the second turn arrives.
    r = _router(index=FakeIndex({}), inflight_overlap=inflight_overlap)
    workers = [_w("a"), _w("b")]
    first = await r.choose("m", workers, PromptMemo(PROMPT))
    r.started(first)
    other = "b" if first.worker_id == "a" else "a"
    small = await r.choose(
        "m", [w for w in workers if w.worker_id == other], PromptMemo(list(range(5000, 5048)))
    )
    r.started(small)
    r.prefilled(small)
    second = await r.choose("m", workers, PromptMemo(PROMPT + list(range(9000, 9032))))
    if not inflight_overlap:  # index only: beside the first turn 22 + 12 = 34 against 27 elsewhere
        assert (second.worker_id, second.predicted_cached_blocks) == (other, 0)
        return
    # Elsewhere: 12 blocks to prefill + 3 + 12 decode = 27; beside the first turn: 22 - 10 + 12 = 24.
    assert (second.worker_id, second.predicted_cached_blocks) == (first.worker_id, 10)
    assert second.prefill_tokens == 192 - 160


async def test_prefill_load_drops_at_first_token() -> None:
    r = _router(index=FakeIndex({}))
    d = await r.choose("m", [_w("a")], PromptMemo(PROMPT))
    r.started(d)
    assert r.local["a"].prefill_tokens == 160
    r.prefilled(d)
    r.prefilled(d)  # idempotent
    assert r.local["a"].prefill_tokens == 0 and r.local["a"].decode_blocks == 10
    r.finished(d)
    assert r.local == {}


async def test_overlap_weight_zero_ignores_the_cache() -> None:
    r = _router(index=FakeIndex({"b": 9}), overlap_weight=0.0)
    other = [t + 10_000 for t in PROMPT]
    r.started(await r.choose("m", [_w("b")], PromptMemo(other)))  # b now carries decode load
    assert (await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))).worker_id == "a"


async def test_temperature_spreads_choices() -> None:
    idx = FakeIndex({"b": 2})
    cold = _router(index=idx)
    hot = _router(index=idx, router_temperature=5.0)
    workers = [_w("a"), _w("b"), _w("c")]
    cold_picks = Counter(
        [(await cold.choose("m", workers, PromptMemo(PROMPT))).worker_id for _ in range(100)]
    )
    hot_picks = Counter([(await hot.choose("m", workers, PromptMemo(PROMPT))).worker_id for _ in range(300)])
    assert cold_picks == Counter({"b": 100})
    assert set(hot_picks) == {"a", "b", "c"} and hot_picks.most_common(1)[0][0] == "b"


async def test_busy_workers_are_skipped_and_all_busy_raises() -> None:
    r = _router(index=FakeIndex({"a": 9}), busy_kv_usage=0.9, busy_waiting=5)
    workers = [_w("a", kv_usage=0.95), _w("b", waiting=5), _w("c")]
    assert (await r.choose("m", workers, PromptMemo(PROMPT))).worker_id == "c"
    with pytest.raises(AllBusy):
        await r.choose("m", workers[:2], PromptMemo(PROMPT))
    with pytest.raises(APIError) as exc:
        await r.choose("m", [], PromptMemo(PROMPT))
    assert exc.value.status == 503


async def test_a_request_that_overtakes_goes_to_a_busy_worker() -> None:
    r = _router(index=FakeIndex({"a": 9}), busy_kv_usage=0.9, busy_waiting=5)
    workers = [_w("a", kv_usage=0.95), _w("b", waiting=5)]
    # Its engine priority puts it ahead of what they hold waiting: it is sent (by cost) instead of waiting.
    assert (await r.choose("m", workers, PromptMemo(PROMPT, overtake=True))).worker_id in ("a", "b")
    with pytest.raises(APIError) as exc:
        await r.choose("m", [], PromptMemo(PROMPT, overtake=True))
    assert exc.value.status == 503


async def test_an_overtaking_request_goes_where_a_running_sequence_ends_soonest() -> None:
    r = _router(index=FakeIndex({"a": 9}), busy_waiting=1)
    workers = [_w("a", waiting=3), _w("b", waiting=3)]
    running = {"a": 40, "b": 3}
    for wid, left in running.items():
        d = Decision(wid, remaining=left)
        r.started(d)
        r.prefilled(d)  # running: it produced a token
    # a caches the prompt, but b frees a slot first: neither engine preempts for the waiting request.
    picks = {(await r.choose("m", workers, PromptMemo(PROMPT, overtake=True))).worker_id for _ in range(20)}
    assert picks == {"b"}
    assert (await r.choose("m", [workers[0], _w("b")], PromptMemo(PROMPT))).worker_id == "b"  # not busy


async def test_an_overtaking_request_goes_where_a_running_slot_is_free() -> None:
    r = _router(index=FakeIndex({"a": 9}), busy_waiting=1)
    workers = [_w("a", max_num_seqs=2), _w("b", max_num_seqs=2)]
    for wid in ("a", "a", "b"):
        r.started(Decision(wid))  # a's two slots are taken (as far as routers know), one of b's is free
    assert (await r.choose("m", workers, PromptMemo(PROMPT))).worker_id == "a"  # by cost: a caches it
    # Going ahead of what a holds waiting would still wait for a running sequence there: b starts it now.
    picks = {(await r.choose("m", workers, PromptMemo(PROMPT, overtake=True))).worker_id for _ in range(20)}
    assert picks == {"b"}
    ending = Decision("b", remaining=3)
    r.started(ending)
    r.prefilled(ending)  # b is full too, but its running sequence ends soonest: the request waits least there
    picks = {(await r.choose("m", workers, PromptMemo(PROMPT, overtake=True))).worker_id for _ in range(20)}
    assert picks == {"b"}


async def test_index_outage_falls_back_to_load_and_recovers() -> None:
    idx = FakeIndex({"b": 9})
    r = Router(RouterSettings(), FrontendMetrics(), idx, random.Random(0), index_recovery_s=60.0)  # type: ignore[arg-type]
    idx.fail = True
    workers = [_w("a"), _w("b")]
    r.started(await r.choose("m", workers, PromptMemo(PROMPT)))  # no overlap known: any worker
    assert not r.index_ok
    busy = next(iter(r.local))
    other = "a" if busy == "b" else "b"
    unrelated = PromptMemo([t + 20_000 for t in PROMPT])
    assert (await r.choose("m", workers, unrelated)).worker_id == other  # by load
    idx.fail = False
    r.local.clear()
    r.active_blocks.clear()
    # Lookups are used again at once; the index counts as back (log, metric) only after a quiet spell.
    assert (await r.choose("m", workers, PromptMemo(PROMPT))).worker_id == "b"
    assert not r.index_ok


async def test_index_counts_as_back_once_lookups_stop_failing() -> None:
    idx = FakeIndex({"b": 9})
    r = Router(RouterSettings(), FrontendMetrics(), idx, random.Random(0), index_recovery_s=0.0)  # type: ignore[arg-type]
    workers = [_w("a"), _w("b")]
    idx.fail = True
    await r.choose("m", workers, PromptMemo(PROMPT))
    assert not r.index_ok
    idx.fail = False
    await r.choose("m", workers, PromptMemo(PROMPT))
    assert r.index_ok


async def test_approximate_mode_learns_from_its_own_decisions() -> None:
    r = _router(kv_events=False, approx_ttl_s=60)
    workers = [_w("a"), _w("b")]
    first = await r.choose("m", workers, PromptMemo(PROMPT))
    assert first.predicted_cached_blocks == 0
    again = await r.choose("m", workers, PromptMemo(PROMPT))
    assert (again.worker_id, again.predicted_cached_blocks) == (first.worker_id, 10)
    assert r.approx is not None
    chain = block_hashes(PROMPT, 16, chain_seed("m"))
    assert r.approx.overlaps("m", chain, now=1e12) == {}  # forgotten after the TTL
    r.forget_worker(first.worker_id)
    assert r.approx.overlaps("m", chain) == {}


def test_prompt_memo_hashes_once_per_block_size() -> None:
    memo = PromptMemo(PROMPT, lora_name="x")
    assert memo.chain("m", 16) is memo.chain("m", 16)
    assert memo.chain("m", 16) == block_hashes(PROMPT, 16, chain_seed("m", "x"))
    assert memo.chain("m", 16) != block_hashes(PROMPT, 16, chain_seed("m"))


async def test_a_finished_prompt_counts_as_held_until_the_index_hears_of_it() -> None:
    # The first turn finished; its KV events have not reached the index yet when the next turn arrives.
    now = [0.0]
    r = Router(
        RouterSettings(router_policy="kv"), FrontendMetrics(), FakeIndex({}), random.Random(0),  # type: ignore[arg-type]
        recent_s=2.0, clock=lambda: now[0],
    )  # fmt: skip
    workers = [_w("a"), _w("b"), _w("c")]
    first = await r.choose("m", workers, PromptMemo(PROMPT))
    r.started(first)
    r.prefilled(first)
    r.finished(first)
    assert r.local == {}
    nxt = PromptMemo(PROMPT + list(range(9000, 9032)))
    second = await r.choose("m", workers, nxt)
    assert (second.worker_id, second.predicted_cached_blocks) == (first.worker_id, 10)
    now[0] = 2.5  # past RECENT_S: only the index counts again
    assert (await r.choose("m", workers, nxt)).predicted_cached_blocks == 0
    # A sequence that never produced a token left nothing computed behind.
    unprefilled = await r.choose("m", workers, PromptMemo(list(range(20000, 20160))))
    r.started(unprefilled)
    r.finished(unprefilled)
    again = await r.choose("m", workers, PromptMemo(list(range(20000, 20160))))
    assert again.predicted_cached_blocks == 0
    r.forget_worker(first.worker_id)
    now[0] = 0.0
    assert r.recent is not None and r.recent.overlaps("m", second.blocks, now=0.0) == {}


async def test_no_recent_credit_without_kv_events_or_when_disabled() -> None:
    assert _router(kv_events=False).recent is None
    r = Router(RouterSettings(router_policy="kv"), FrontendMetrics(), FakeIndex({}), recent_s=0)  # type: ignore[arg-type]
    assert r.recent is None


async def test_a_first_token_only_sequence_carries_no_decode_load() -> None:
    idx = FakeIndex({})
    r = _router(index=idx)
    short = await r.choose("m", [_w("a")], PromptMemo(list(range(7000, 7096)), max_tokens=1))
    r.started(short)
    assert not short.decodes and r.local["a"].decode_blocks == 0 and r.local["a"].prefill_tokens == 96
    idx.held = {"a": 10}  # `a` caches PROMPT
    # Beside it: (96 + 160) / 16 - 10 to prefill + 10 to decode = 16; elsewhere 10 + 10 = 20. Charged 6
    # decode blocks for the first-token-only sequence, `a` would cost 22 and lose its cached prefix.
    d = await r.choose("m", [_w("a"), _w("b")], PromptMemo(PROMPT))
    assert (d.worker_id, d.decodes) == ("a", True)
    r.started(d)
    assert r.local["a"].decode_blocks == 10
    r.finished(short)
    r.finished(d)
    assert r.local == {} and r.active_blocks == {} and r.decoding_blocks == {}
