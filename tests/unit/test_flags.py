"""Settings from flags, FERRY_* variables and defaults (launch/flags.py), and back to flags; `ferry up`'s."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from launch.flags import build_parser, from_namespace, load, to_argv
from launch.stack import PER_CHILD, _worker_argv, load_stack, stack_parser
from schemas.ops_settings import PlannerPolicySettings, StackSettings
from schemas.settings import FrontendSettings, WorkerSettings


def test_settings_from_flags_env_and_defaults() -> None:
    env = {"FERRY_PORT": "9001", "FERRY_LOG_PROMPTS": "true", "FERRY_KAFKA": "k:1"}
    ns = build_parser(FrontendSettings).parse_args(["--kafka", "k:2"])
    s = from_namespace(FrontendSettings, ns, env)
    assert (s.port, s.log_prompts, s.kafka) == (9001, True, "k:2")  # flag beats variable
    with pytest.raises(SystemExit):
        from_namespace(
            FrontendSettings,
            build_parser(FrontendSettings).parse_args([]),
            {"FERRY_ROUTER_POLICY": "fastest"},
        )
    w = load(WorkerSettings, ["--worker-id", "w7", "--speedup", "3"])
    assert load(WorkerSettings, to_argv(w)) == w


def test_ferry_up_takes_every_frontend_and_worker_flag_but_the_ids() -> None:
    own = {f.name for f in dataclasses.fields(StackSettings)}
    children = {f.name for cls in (FrontendSettings, WorkerSettings) for f in dataclasses.fields(cls)}
    own |= {f.name for f in dataclasses.fields(PlannerPolicySettings)}  # for --autoscale
    dests = {a.dest for a in stack_parser()._actions if a.dest != "help"}
    assert dests == (own | children) - set(PER_CHILD)


def test_ferry_up_passes_each_child_the_flags_given_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"FERRY_API_KEYS": "secret", "FERRY_KAFKA": "", "FERRY_BLOCK_SIZE": "32"}.items():
        monkeypatch.setenv(name, value)
    stack = load_stack(["--workers", "3", "--speedup", "20", "--router-policy", "round_robin", "--no-kv-events",
                        "--heartbeat-interval-s", "0.5", "--port", "0", "--redis", "r:1"])  # fmt: skip
    assert (stack.settings.workers, stack.settings.kafka, stack.settings.redis) == (3, "", "r:1")
    assert stack.frontend.api_keys == "secret" and stack.worker.block_size == 32  # read from the variables
    # Variables reach the children through their environment, never as flags (keys stay out of `ps`);
    # the launcher sets --port, --kafka and --redis itself.
    # (and rolls request and pool topics on the broker it starts itself)
    assert stack.frontend_flags == [
        "--router-policy",
        "round_robin",
        "--no-kv-events",
        "--heartbeat-interval-s",
        "0.5",
        "--request-roll-s",
        "60.0",
        "--pool-roll-s",
        "3600.0",
    ]
    assert stack.worker_flags == [
        "--speedup",
        "20.0",
        "--heartbeat-interval-s",
        "0.5",
        "--request-roll-s",
        "60.0",
        "--pool-roll-s",
        "3600.0",
    ]
    assert load(WorkerSettings, stack.worker_flags).speedup == 20.0


@pytest.mark.parametrize(
    ("field", "flag", "default"),
    [("request_roll_s", "--request-roll-s", 60.0), ("pool_roll_s", "--pool-roll-s", 3600.0)],
)
def test_ferry_up_rolls_topics_on_its_embedded_broker_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, field: str, flag: str, default: float
) -> None:
    env = f"FERRY_{field.upper()}"
    monkeypatch.delenv("FERRY_KAFKA", raising=False)
    monkeypatch.delenv(env, raising=False)

    def rolls(argv: list[str]) -> tuple[float, float]:
        stack = load_stack(argv)
        fe = getattr(load(FrontendSettings, stack.frontend_flags), field)
        return fe, getattr(load(WorkerSettings, stack.worker_flags), field)

    assert rolls([]) == (default, default)  # the embedded broker never trims a topic
    assert rolls([flag, "0"]) == (0.0, 0.0)  # the operator's choice stands
    assert rolls([flag, "5"]) == (5.0, 5.0)
    # A Kafka of the operator's: its retention bounds the topics.
    assert rolls(["--kafka", "k:9092"]) == (0.0, 0.0)
    monkeypatch.setenv(env, "0")  # set as a variable: the children read it themselves
    stack = load_stack([])
    assert flag not in stack.frontend_flags + stack.worker_flags


def test_ferry_up_starts_prefill_and_decode_pools_with_their_roles() -> None:
    stack = load_stack(
        ["--workers", "0", "--prefill-workers", "1", "--decode-workers", "2", "--speedup", "5"]
    )
    assert (stack.settings.workers, stack.settings.prefill_workers, stack.settings.decode_workers) == (
        0,
        1,
        2,
    )
    argv = _worker_argv(stack, "k:1", "redis://r", "prefill-0", "prefill")
    assert load(WorkerSettings, argv[argv.index("worker") + 1 :]).role == "prefill"
    argv = _worker_argv(stack, "k:1", "redis://r", "worker-0")
    assert load(WorkerSettings, argv[argv.index("worker") + 1 :]).role == "both"
    bad = (
        ["--workers", "0"],  # nothing to start
        ["--workers", "0", "--prefill-workers", "2"],  # nobody decodes
        ["--prefill-workers", "1", "--decode-workers", "1", "--engine", "vllm"],  # no KV connector
        ["--prefill-workers", "1", "--decode-workers", "1", "--role", "decode"],  # the pools name the roles
    )
    for argv in bad:
        with pytest.raises(SystemExit):
            load_stack(argv)
    # vLLM pools with a KV connector between their engines: every worker gets the engine flags.
    connector = '{"kv_connector":"ExampleConnector","kv_role":"kv_both"}'
    stack = load_stack(
        ["--engine", "vllm", "--workers", "0", "--prefill-workers", "1", "--decode-workers", "1", "--",
         "--kv-transfer-config", connector]
    )  # fmt: skip
    argv = _worker_argv(stack, "k:1", "redis://r", "decode-0", "decode")
    assert argv[-2:] == ["--kv-transfer-config", connector]


def test_ferry_up_refuses_one_nixl_side_channel_port_for_several_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nixl = ["--", "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}']
    pools = ["--engine", "vllm", "--workers", "0", "--prefill-workers", "1", "--decode-workers", "1", *nixl]
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    load_stack(pools)  # each worker picks its own port
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    with pytest.raises(SystemExit, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        load_stack(pools)
    load_stack(["--engine", "vllm", "--workers", "1", *nixl])  # one engine: no one to collide with


def test_ferry_up_has_no_per_child_id() -> None:
    with pytest.raises(SystemExit):
        load_stack(["--worker-id", "w1"])


@pytest.mark.parametrize(
    "parser", [build_parser(FrontendSettings), build_parser(WorkerSettings), stack_parser()]
)
def test_help_shows_each_flags_default_and_variable(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.dest != "help":
            assert action.help is not None and "(default: " in action.help, action.dest
            assert f"env FERRY_{action.dest.upper()})" in action.help, action.dest


def test_ferry_up_autoscales_each_pool_within_the_bounds() -> None:
    bounds = ["--autoscale", "--min-workers", "1", "--max-workers", "3"]
    stack = load_stack([*bounds, "--workers", "0", "--prefill-workers", "1", "--decode-workers", "3"])
    assert (stack.settings.autoscale, stack.settings.prefill_workers, stack.settings.decode_workers) == (
        True,
        1,
        3,
    )
    refused = {
        "--workers must then be 0, not 2": ["--prefill-workers", "1", "--decode-workers", "1"],
        "--decode-workers 4 \\(the starting count\\)": ["--workers", "0", "--prefill-workers", "1", "--decode-workers", "4"],
        "--prefill-workers 0 \\(the starting count\\)": ["--workers", "0", "--decode-workers", "1"],
        "--workers 5 \\(the starting count\\)": ["--workers", "5"],
    }  # fmt: skip
    for reason, argv in refused.items():
        with pytest.raises(SystemExit, match=reason):
            load_stack([*bounds, *argv])
