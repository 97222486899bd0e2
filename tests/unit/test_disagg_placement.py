"""Disaggregated placement (server/disagg.py): a decode worker by the kv cost, then a prefill worker or none."""

from __future__ import annotations

import msgspec

from schemas.status import WorkerStatus
from server.disagg import place, serving
from server.router import PromptMemo
from tests.unit.test_router import PROMPT, FakeIndex, _router, _w


def role(w: WorkerStatus, r: str) -> WorkerStatus:
    return msgspec.structs.replace(w, role=r)


P1, P2 = role(_w("p1"), "prefill"), role(_w("p2"), "prefill")
D1, D2 = role(_w("d1"), "decode"), role(_w("d2"), "decode")


async def test_prefill_worker_by_overlap_and_decode_worker_among_the_decoders() -> None:
    # p2 caches 8 of the prompt's 10 blocks; d2 caches 2 (an earlier turn decoded there).
    r = _router(index=FakeIndex({"p2": 8, "d2": 2}))
    placed = await place(r, "m", [P1, P2, D1, D2], PromptMemo(PROMPT, max_tokens=50))
    assert placed.mode == "remote"
    assert (placed.first.worker_id, placed.first.predicted_cached_blocks) == ("p2", 8)
    assert not placed.first.decodes and placed.first.decode_blocks == 0  # charged its prefill only
    assert placed.decode is not None and placed.decode.worker_id == "d2"
    assert placed.decode.prefill_tokens == 0 and placed.decode.decode_blocks == 10
    assert placed.kv_from is not None and (placed.kv_from.worker_id, placed.kv_from.tokens) == ("p2", 160)


async def test_conditional_local_prefill_when_the_uncached_part_is_short() -> None:
    # d1 caches 9 of 10 blocks: 16 tokens uncached there, under the threshold.
    r = _router(index=FakeIndex({"d1": 9}), disagg_min_uncached_tokens=32)
    placed = await place(r, "m", [P1, D1, D2], PromptMemo(PROMPT, max_tokens=50))
    assert (placed.mode, placed.first.worker_id, placed.decode) == ("local", "d1", None)
    assert placed.first.prefill_tokens == 16  # it prefills there: charged as such
    # The same prompt with nothing cached goes to the prefill worker.
    r = _router(index=FakeIndex({}), disagg_min_uncached_tokens=32)
    assert (await place(r, "m", [P1, D1, D2], PromptMemo(PROMPT, max_tokens=50))).mode == "remote"


async def test_busy_prefill_pool_prefills_locally() -> None:
    r = _router(index=FakeIndex({}), busy_kv_usage=0.9)
    busy = role(_w("p1", kv_usage=0.95), "prefill")
    placed = await place(r, "m", [busy, D1], PromptMemo(PROMPT, max_tokens=50))
    assert (placed.mode, placed.first.worker_id) == ("local", "d1")


async def test_aggregated_without_prefill_workers_or_decode() -> None:
    r = _router(index=FakeIndex({"p1": 10}))
    both = _w("b")
    placed = await place(r, "m", [both, D1], PromptMemo(PROMPT, max_tokens=50))
    assert placed.mode == "off" and placed.decode is None
    # One token asked for: nothing to decode, any worker serves it whole (here the one that caches it).
    placed = await place(r, "m", [P1, D1], PromptMemo(PROMPT, max_tokens=1))
    assert (placed.mode, placed.first.worker_id) == ("off", "p1")
    # Migrations and aggregated routing never pick a prefill-only worker.
    assert [w.worker_id for w in serving([P1, both, D1])] == ["b", "d1"]
