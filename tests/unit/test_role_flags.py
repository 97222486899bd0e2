"""`ferry up --prefill-flags / --decode-flags`: each pool's own worker and engine flags (launch/role_flags.py)."""

from __future__ import annotations

import pytest

from launch.flags import load_with_engine_flags
from launch.stack import _worker_argv, load_stack
from schemas.settings import WorkerSettings

POOLS = ["--workers", "1", "--prefill-workers", "1", "--decode-workers", "2"]


def started(argv: list[str]) -> tuple[WorkerSettings, list[str]]:
    """What a worker started with `argv` reads: its settings and vLLM's engine flags."""
    return load_with_engine_flags(WorkerSettings, argv[argv.index("worker") + 1 :])


def test_each_pool_gets_its_own_flags_after_the_stack_wide_ones() -> None:
    stack = load_stack(
        [*POOLS, "--max-num-seqs", "32", "--num-blocks", "500",
         "--decode-flags=--max-num-seqs 4 --reply-linger-ms 0", "--prefill-flags", "--num-host-blocks 900 --speedup 2"]
    )  # fmt: skip
    decode, _ = started(_worker_argv(stack, "k:1", "redis://r", "decode-0", "decode"))
    prefill, _ = started(_worker_argv(stack, "k:1", "redis://r", "prefill-0", "prefill"))
    both, _ = started(_worker_argv(stack, "k:1", "redis://r", "worker-0"))
    assert (decode.role, decode.max_num_seqs, decode.reply_linger_ms, decode.num_blocks) == (
        "decode",
        4,
        0,
        500,
    )
    assert (prefill.role, prefill.max_num_seqs, prefill.num_host_blocks, prefill.speedup) == (
        "prefill",
        32,
        900,
        2,
    )
    assert (both.max_num_seqs, both.num_host_blocks, both.reply_linger_ms) == (
        32,
        0,
        WorkerSettings.reply_linger_ms,
    )


def test_a_pool_gets_its_own_kv_connector_role() -> None:
    producer = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
    consumer = [
        "--kv-transfer-config.kv_connector",
        "NixlConnector",
        "--kv-transfer-config.kv_role",
        "kv_consumer",
    ]
    stack = load_stack(
        ["--engine", "vllm", "--workers", "0", "--prefill-workers", "1", "--decode-workers", "1",
         f"--prefill-flags=--max-num-batched-tokens 4096 -- --kv-transfer-config '{producer}'",
         f"--decode-flags=-- {' '.join(consumer)}", "--", "--dtype", "bfloat16"]
    )  # fmt: skip
    prefill, prefill_engine = started(_worker_argv(stack, "k:1", "redis://r", "prefill-0", "prefill"))
    decode, decode_engine = started(_worker_argv(stack, "k:1", "redis://r", "decode-0", "decode"))
    assert prefill_engine == ["--dtype", "bfloat16", "--kv-transfer-config", producer]
    assert decode_engine == ["--dtype", "bfloat16", *consumer]
    assert (prefill.max_num_batched_tokens, decode.max_num_batched_tokens) == (4096, 8192)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        ([*POOLS, "--decode-flags=--block-size 32"], "--block-size must be the same for every worker"),
        ([*POOLS, "--prefill-flags=--role decode"], "--role must be the same"),
        ([*POOLS, "--prefill-flags=--model /m --redis r:1"], "--model-path, --redis must be the same"),
        ([*POOLS, "--decode-flags=--max-num-seqs 4 -- --dtype half"], "vLLM engine flags need --engine vllm"),
        ([*POOLS, "--decode-flags=--dtype half"], "vLLM engine flags need --engine vllm: --dtype half"),
        ([*POOLS, "--decode-flags=--max-num-seqs '4"], "No closing quotation"),
        (["--workers", "2", "--decode-flags=--max-num-seqs 4"], "--decode-flags without --decode-workers"),
        # vLLM pools need a connector on each side: one pool's flags alone are not enough.
        (["--engine", "vllm", "--workers", "0", "--prefill-workers", "1", "--decode-workers", "1",
          "--prefill-flags=-- --kv-transfer-config {}"], "need a KV connector"),
    ],
)  # fmt: skip
def test_pool_flags_that_cannot_work_are_refused(argv: list[str], reason: str) -> None:
    with pytest.raises(SystemExit, match=reason):
        load_stack(argv)


def test_pool_flags_that_do_not_parse_stop_ferry_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_stack([*POOLS, "--decode-flags=--max-num-seqs many"])
    assert (
        "ferry up --decode-flags: error: argument --max-num-seqs: invalid int value: 'many'"
        in capsys.readouterr().err
    )
