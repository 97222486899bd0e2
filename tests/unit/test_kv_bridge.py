"""The vLLM -> Ferry KV-event bridge: its hashes must be the ones the router computes from tokens."""

from __future__ import annotations

import hashlib
import importlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

import schemas.kv_events as ferry
from kvstore.hashing import block_hashes, chain_seed
from workers.kv_bridge import KVBridge, VllmBlockHash

MODEL = "bridge-test"
BS = 4


# Stand-ins for vllm.distributed.kv_events, with the same class names (vLLM's msgspec tags) and fields.
@dataclass
class BlockStored:
    block_hashes: list[VllmBlockHash]
    parent_block_hash: VllmBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list[VllmBlockHash]
    medium: str | None = "GPU"
    group_idx: int | None = 0


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class KVEventBatch:
    ts: float
    events: list[object] = field(default_factory=list)


def vllm_hashes(tokens: Sequence[int], parent: bytes = b"", as_int: bool = False) -> list[VllmBlockHash]:
    """Chained sha256 block hashes like vLLM's (bytes, or truncated to 64-bit ints)."""
    out: list[VllmBlockHash] = []
    h = parent
    for i in range(len(tokens) // BS):
        h = hashlib.sha256(h + repr(tuple(tokens[i * BS : (i + 1) * BS])).encode()).digest()
        out.append(int.from_bytes(h, "big") & ((1 << 64) - 1) if as_int else h)
    return out


def store(
    tokens: Sequence[int], first_block: int, n_blocks: int, as_int: bool = False, **kw: object
) -> BlockStored:
    """The BlockStored vLLM emits when blocks [first_block, first_block + n_blocks) of `tokens` fill."""
    hashes = vllm_hashes(tokens, as_int=as_int)
    return BlockStored(
        block_hashes=hashes[first_block : first_block + n_blocks],
        parent_block_hash=hashes[first_block - 1] if first_block else None,
        token_ids=list(tokens[first_block * BS : (first_block + n_blocks) * BS]),
        block_size=BS,
        **kw,  # type: ignore[arg-type]
    )


def one(batch: ferry.KVEventBatch | None) -> ferry.KVEvent:
    assert batch is not None and len(batch.events) == 1
    return batch.events[0]


@pytest.fixture
def bridge() -> KVBridge:
    return KVBridge(MODEL, BS)


@pytest.mark.parametrize("as_int", [False, True], ids=["bytes", "int"])
def test_incremental_stores_match_the_routers_hashes(bridge: KVBridge, as_int: bool) -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(7 * BS + 3)]
    expected = block_hashes(tokens, BS, chain_seed(MODEL))
    # Prefill caches three blocks at once, then decoding fills one block per event.
    got: list[int] = []
    for first, n in [(0, 3), (3, 1), (4, 2), (6, 1)]:
        ev = one(bridge.translate(KVEventBatch(1.0, [store(tokens, first, n, as_int=as_int)])))
        assert isinstance(ev, ferry.BlockStored)
        assert ev.parent_hash == (got[-1] if got else None)
        got += ev.block_hashes
    assert got == expected
    assert len(bridge) == 7
    assert bridge.ferry_hash(vllm_hashes(tokens, as_int=as_int)[6]) == expected[6]


def test_a_shared_prefix_continues_from_the_cached_parent(bridge: KVBridge) -> None:
    shared = list(range(100, 100 + 3 * BS))
    a = [*shared, *range(500, 500 + 2 * BS)]
    b = [*shared, *range(900, 900 + 2 * BS)]
    bridge.translate(KVEventBatch(1.0, [store(a, 0, 5)]))
    # The second request hits the three shared blocks, so vLLM reports only its own two.
    ev = one(bridge.translate(KVEventBatch(2.0, [store(b, 3, 2)])))
    assert isinstance(ev, ferry.BlockStored)
    assert ev.block_hashes == block_hashes(b, BS, chain_seed(MODEL))[3:]
    assert ev.parent_hash == block_hashes(shared, BS, chain_seed(MODEL))[-1]


def test_lora_blocks_are_salted_with_the_adapter(bridge: KVBridge) -> None:
    tokens = list(range(2 * BS))
    ev = one(bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 2, lora_name="sql", lora_id=1)])))
    assert isinstance(ev, ferry.BlockStored)
    assert ev.lora_name == "sql"
    assert ev.block_hashes == block_hashes(tokens, BS, chain_seed(MODEL, "sql"))
    assert ev.block_hashes != block_hashes(tokens, BS, chain_seed(MODEL))


def test_removal_translates_and_forgets(bridge: KVBridge) -> None:
    tokens = list(range(3 * BS))
    ferry_hashes = block_hashes(tokens, BS, chain_seed(MODEL))
    vh = vllm_hashes(tokens)
    bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 3)]))
    ev = one(bridge.translate(KVEventBatch(2.0, [BlockRemoved([vh[2], vh[1]])])))
    assert ev == ferry.BlockRemoved([ferry_hashes[2], ferry_hashes[1]])
    assert len(bridge) == 1 and bridge.ferry_hash(vh[1]) is None
    # A block the bridge never knew (or already forgot) is not reported again.
    assert bridge.translate(KVEventBatch(3.0, [BlockRemoved([vh[1], b"never-stored"])])) is None


def test_a_block_cached_twice_is_removed_with_its_last_copy(bridge: KVBridge) -> None:
    tokens = list(range(BS))
    vh = vllm_hashes(tokens)[0]
    # Two requests computed the same block in one step: vLLM caches both copies.
    batch = bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 1), store(tokens, 0, 1)]))
    assert batch is not None and len(batch.events) == 2
    assert bridge.translate(KVEventBatch(2.0, [BlockRemoved([vh])])) is None
    ev = one(bridge.translate(KVEventBatch(3.0, [BlockRemoved([vh])])))
    assert ev == ferry.BlockRemoved(block_hashes(tokens, BS, chain_seed(MODEL)))


def test_all_blocks_cleared_forgets_everything(bridge: KVBridge, caplog: pytest.LogCaptureFixture) -> None:
    tokens = list(range(4 * BS))
    bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 2)]))
    assert one(bridge.translate(KVEventBatch(2.0, [AllBlocksCleared()]))) == ferry.AllBlocksCleared()
    assert len(bridge) == 0
    # The parent of the next blocks is gone: skipped and logged, never given an invented hash.
    with caplog.at_level(logging.WARNING, logger="workers.kv_bridge"):
        assert bridge.translate(KVEventBatch(3.0, [store(tokens, 2, 2)])) is None
    assert "parent block is unknown" in caplog.text
    assert bridge.skipped_blocks == 2 and len(bridge) == 0


def test_blocks_of_another_size_are_skipped(bridge: KVBridge) -> None:
    tokens = list(range(2 * BS))
    ev = store(tokens, 0, 2)
    ev.block_size = 2 * BS
    ev.block_hashes = ev.block_hashes[:1]
    assert bridge.translate(KVEventBatch(1.0, [ev])) is None
    short = store(tokens, 0, 2)
    short.token_ids = short.token_ids[:-1]
    assert bridge.translate(KVEventBatch(1.0, [short])) is None
    assert bridge.skipped_blocks == 3 and len(bridge) == 0


def test_storage_tier_and_other_groups_are_ignored(bridge: KVBridge) -> None:
    tokens = list(range(BS))
    batch = KVEventBatch(1.0, [store(tokens, 0, 1, medium="STORAGE"), store(tokens, 0, 1, group_idx=1)])
    assert bridge.translate(batch) is None
    assert bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 1, medium=None, group_idx=None)])) is not None


def test_host_tier_blocks_keep_their_medium(bridge: KVBridge) -> None:
    tokens = list(range(3 * BS))
    expected = block_hashes(tokens, BS, chain_seed(MODEL))
    vh = vllm_hashes(tokens)
    bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 3)]))
    # Offloaded copies of device blocks, one of them as vLLM's placeholder (no tokens, block size 0).
    placeholder = BlockStored([vh[2]], None, [], 0, medium="CPU")
    batch = KVEventBatch(1.0, [store(tokens, 0, 2, medium="CPU"), placeholder])
    got = bridge.translate(batch)
    assert got is not None
    assert got.events == [
        ferry.BlockStored(expected[:2], medium="CPU"),
        ferry.BlockStored(expected[2:], medium="CPU"),
    ]
    # The device copies go; the host copies stay until the host tier drops them.
    gone = one(bridge.translate(KVEventBatch(1.0, [BlockRemoved(vh)])))
    assert gone == ferry.BlockRemoved(expected)
    assert bridge.ferry_hash(vh[0]) == expected[0]
    snap = bridge.snapshot().events
    assert snap == [ferry.AllBlocksCleared(), ferry.BlockStored(expected, medium="CPU")]
    gone = one(bridge.translate(KVEventBatch(1.0, [BlockRemoved(vh[:1], medium="CPU")])))
    assert gone == ferry.BlockRemoved(expected[:1], medium="CPU")
    assert len(bridge) == 2


def test_host_tier_blocks_never_on_device_are_hashed_from_tokens(bridge: KVBridge) -> None:
    tokens = list(range(2 * BS))
    expected = block_hashes(tokens, BS, chain_seed(MODEL))
    ev = one(bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 2, medium="CPU")])))
    assert ev == ferry.BlockStored(expected, medium="CPU")
    # A device block continuing that chain finds its parent on the host tier.
    more = list(range(3 * BS))
    more[: 2 * BS] = tokens
    ev = one(bridge.translate(KVEventBatch(1.0, [store(more, 2, 1)])))
    assert ev == ferry.BlockStored(block_hashes(more, BS, chain_seed(MODEL))[2:], parent_hash=expected[1])


def test_reset_and_snapshot(bridge: KVBridge) -> None:
    tokens = list(range(2 * BS))
    bridge.translate(KVEventBatch(1.0, [store(tokens, 0, 2)]))
    snap = bridge.snapshot()
    assert snap.events == [
        ferry.AllBlocksCleared(),
        ferry.BlockStored(block_hashes(tokens, BS, chain_seed(MODEL))),
    ]
    assert bridge.reset().events == [ferry.AllBlocksCleared()]
    assert len(bridge) == 0 and bridge.snapshot().events == [ferry.AllBlocksCleared()]
    assert bridge.translate(KVEventBatch(1.0, [])) is None


def test_decodes_vllms_own_wire_format(bridge: KVBridge) -> None:
    """The real vLLM classes, through msgpack as the ZMQ publisher sends them."""
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    import msgspec

    tokens = list(range(3 * BS))
    vh = vllm_hashes(tokens)
    common = {"block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    batch = kv_events.KVEventBatch(
        ts=1.0,
        events=[
            kv_events.BlockStored(
                block_hashes=vh[:2], parent_block_hash=None, token_ids=tokens[: 2 * BS], **common
            ),
            kv_events.BlockStored(
                block_hashes=vh[2:], parent_block_hash=vh[1], token_ids=tokens[2 * BS :], **common
            ),
            kv_events.BlockRemoved(block_hashes=[vh[2]], medium="GPU"),
        ],
    )
    wire = msgspec.msgpack.Encoder().encode(batch)
    decoded = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(wire)
    out = bridge.translate(decoded)
    assert out is not None
    expected = block_hashes(tokens, BS, chain_seed(MODEL))
    assert out.events == [
        ferry.BlockStored(expected[:2]),
        ferry.BlockStored(expected[2:], parent_hash=expected[1]),
        ferry.BlockRemoved([expected[2]]),
    ]
