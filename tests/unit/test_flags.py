"""Settings from flags, FERRY_* variables and defaults (launch/flags.py), and back to flags."""

from __future__ import annotations

import pytest

from launch.flags import build_parser, from_namespace, load, to_argv
from schemas.settings import FrontendSettings, WorkerSettings


def test_settings_from_flags_env_and_defaults() -> None:
    env = {"FERRY_PORT": "9001", "FERRY_LOG_PROMPTS": "true", "FERRY_KAFKA": "k:1"}
    ns = build_parser(FrontendSettings).parse_args(["--kafka", "k:2"])
    s = from_namespace(FrontendSettings, ns, env)
    assert (s.port, s.log_prompts, s.kafka) == (9001, True, "k:2")  # flag beats variable
    with pytest.raises(SystemExit):
        from_namespace(FrontendSettings, build_parser(FrontendSettings).parse_args([]),
                       {"FERRY_ROUTER_POLICY": "fastest"})
    w = load(WorkerSettings, ["--worker-id", "w7", "--speedup", "3"])
    assert load(WorkerSettings, to_argv(w)) == w
