"""vLLM's own engine flags (every AsyncEngineArgs flag), read by vLLM's parser, minus those Ferry owns.

vLLM's parser reads them, so every flag, its type and its JSON forms (`--speculative-config '{...}'`) mean
what they mean to `vllm serve`. Only what the user wrote counts: each flag's default is suppressed, so a
field absent from the result is one vLLM or Ferry chooses. Ferry owns a few fields; `check_owned` refuses
them with the Ferry flag that sets them instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser


class EngineFlagError(ValueError):
    """An engine flag vLLM does not know, a bad value, or one that Ferry owns."""


# Fields a Ferry flag of its own sets (the router, the KV index and the frontend depend on them).
FERRY_FLAGS = {
    "model": "--model-path",
    "served_model_name": "--served-model-name",
    "block_size": "--block-size",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "enable_lora": "--max-loras",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
}
# Fields Ferry fixes: routing needs prefix caching and KV events to its own reader; its own stats
# recorder replaces vLLM's loggers. Set to the value Ferry uses, they are accepted.
FIXED: dict[str, tuple[Any, str]] = {
    "enable_prefix_caching": (True, "KV-aware routing needs vLLM's prefix cache"),
    "kv_events_config": (None, "Ferry configures vLLM's KV events for its own reader"),
    "disable_log_stats": (True, "Ferry records vLLM's stats itself"),
}


class _Parser(FlexibleArgumentParser):
    """vLLM's parser that raises instead of printing its 250-flag usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise EngineFlagError(f"vLLM engine flags: {message}")


_parser: argparse.ArgumentParser | None = None


def _engine_parser() -> argparse.ArgumentParser:
    global _parser
    if _parser is None:
        parser = AsyncEngineArgs.add_cli_args(_Parser(prog="ferry worker", add_help=False))
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        _parser = parser
    return _parser


def parse_engine_flags(flags: Sequence[str]) -> dict[str, Any]:
    """The AsyncEngineArgs fields `flags` set, by vLLM's own parser; raises EngineFlagError."""
    if not flags:
        return {}
    ns = _engine_parser().parse_args(list(flags))
    given = vars(ns)
    check_owned(given)
    return given


def check_owned(given: dict[str, Any]) -> None:
    """Refuse fields that Ferry sets itself, naming what to use instead."""
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        if name in FERRY_FLAGS:
            raise EngineFlagError(f"{flag} is Ferry's: set it with `ferry worker {FERRY_FLAGS[name]}`")
        if name in FIXED and value != FIXED[name][0]:
            raise EngineFlagError(f"{flag} cannot be changed: {FIXED[name][1]}")
