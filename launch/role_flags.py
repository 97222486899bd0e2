"""`ferry up --prefill-flags / --decode-flags`: worker and engine flags given to one pool's workers only.

A disaggregated deployment sizes its pools apart: the decode pool's batch (`--max-num-seqs`), the prefill
pool's step budget (`--max-num-batched-tokens`), each side's role in vLLM's KV connector (`kv_producer` /
`kv_consumer` in `--kv-transfer-config`). deploy/kubernetes-disagg gives each Deployment its own arguments;
these flags do the same for `ferry up`. A pool's flags come after those every worker is given, so where
both set a flag the pool's wins (argparse, and vLLM's parser, keep the last value).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from launch.flags import build_parser, from_namespace, given, split_engine_flags, to_argv
from schemas.settings import WorkerSettings

ROLES = ("prefill", "decode")

# Settings every worker of one stack must share: `ferry up` names each child and its role, the workers
# share one broker, Redis and model, and a sequence's KV and tokens move between the pools block by block.
SHARED = frozenset(
    {
        "worker_id", "role", "engine", "kafka", "redis", "redis_prefix", "model_path", "served_model_name",
        "block_size", "max_model_len", "pool_partitions", "request_roll_s", "pool_roll_s", "kv_log",
        "kv_log_roll_s",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RoleFlags:
    """One pool's own flags, each kind passed after the stack's."""

    worker: tuple[str, ...] = ()  # `ferry worker` flags
    engine: tuple[str, ...] = ()  # vLLM's engine flags (after `--`)


def parse_role_flags(role: str, text: str, engine: str) -> RoleFlags:
    """One pool's `--<role>-flags` split into Ferry's and vLLM's; exits with the reason when they do not
    parse, name a setting every worker shares, or give vLLM flags to the simulated engine."""
    where = f"ferry up --{role}-flags"
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise SystemExit(f"{where}: {exc}") from None
    parser = build_parser(
        WorkerSettings, argparse.ArgumentParser(prog=where, usage="%(prog)s", allow_abbrev=False)
    )
    ns, vllm_flags = split_engine_flags(parser, words)
    shared = sorted(given(ns) & SHARED)
    if shared:
        names = ", ".join("--" + name.replace("_", "-") for name in shared)
        raise SystemExit(f"{where}: {names} must be the same for every worker; give it to `ferry up` itself")
    if vllm_flags and engine != "vllm":
        raise SystemExit(f"{where}: vLLM engine flags need --engine vllm: {' '.join(vllm_flags)}")
    # Ferry's own flags as the parser read them, in the form the stack passes every child its flags.
    own = to_argv(from_namespace(WorkerSettings, ns), only=given(ns))
    return RoleFlags(tuple(own), tuple(vllm_flags))
