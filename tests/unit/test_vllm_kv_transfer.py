"""What P/D attempts tell vLLM's KV connector (workers/vllm_kv_transfer.py); end to end in tests/vllm."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from schemas.kafka import GenerateRequest, KVFrom
from workers.ports import LOWEST_PORT, ephemeral_ports
from workers.vllm_kv_transfer import NIXL_PORT_ENV, kv_transfer_args, prepare_connector, side_channel_port

DESCRIPTOR = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]]}


def request(**fields: object) -> GenerateRequest:
    return GenerateRequest("r.0", "m", [1, 2, 3], 20, "replies", **fields)  # type: ignore[arg-type]


def test_a_prefill_only_attempt_asks_its_connector_to_keep_the_prompt_for_a_remote_decode() -> None:
    assert kv_transfer_args(request(prefill_only=True, release_to="d"), "NixlConnector") == {
        "kv_transfer_params": {"do_remote_decode": True}
    }


def test_a_decode_attempt_hands_its_engine_the_prefill_engines_descriptor() -> None:
    args = kv_transfer_args(request(kv_from=KVFrom("p", 3, DESCRIPTOR)), "NixlConnector")
    assert args == {"kv_transfer_params": DESCRIPTOR}


@pytest.mark.parametrize(
    ("req", "connector"),
    [
        (request(), "NixlConnector"),  # an aggregated request
        (request(kv_from=KVFrom("p", 3)), "NixlConnector"),  # the frontend's own hand-over: no descriptor
        (request(prefill_only=True, release_to="d"), ""),  # no connector at all
        (request(kv_from=KVFrom("p", 3, DESCRIPTOR)), ""),
    ],
)
def test_nothing_for_the_connector_where_there_is_nothing_to_tell(req: GenerateRequest, connector: str) -> None:
    assert kv_transfer_args(req, connector) is None


def test_each_nixl_engine_gets_a_side_channel_port_unless_the_operator_chose_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # setenv first so that the teardown restores this process's own value (or its absence): spawned
    # workers inherit the environment, and two NIXL workers given one port would collide.
    monkeypatch.setenv(NIXL_PORT_ENV, "0")
    monkeypatch.delenv(NIXL_PORT_ENV)
    side_channel_port("ExampleConnector")
    assert NIXL_PORT_ENV not in os.environ
    side_channel_port("NixlConnector")
    # Below the ephemeral range: the engine binds it long after the choice, and the worker's own outgoing
    # connections in between draw from that range.
    assert LOWEST_PORT <= int(os.environ[NIXL_PORT_ENV]) < ephemeral_ports()[0]
    monkeypatch.setenv(NIXL_PORT_ENV, "5601")
    side_channel_port("NixlConnector")
    assert os.environ[NIXL_PORT_ENV] == "5601"


@dataclass
class Config:
    """The fields of vLLM's KVTransferConfig that Ferry reads and sets."""

    kv_connector: str | None
    kv_load_failure_policy: Any = "fail"  # vLLM's default
    kv_connector_module_path: str | None = None


def test_a_failed_kv_load_is_recomputed_unless_the_operator_chose_a_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NIXL_PORT_ENV, "5601")  # (prepare_connector picks a port only where none is set)
    flags = ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}']
    config = Config("NixlConnector")
    assert prepare_connector(config, flags) == "NixlConnector"
    assert config.kv_load_failure_policy == "recompute"
    chosen = ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_load_failure_policy": "fail"}']
    config = Config("NixlConnector")
    prepare_connector(config, chosen)
    assert config.kv_load_failure_policy == "fail"
    assert prepare_connector(Config(None), []) == ""


def test_the_example_connector_runs_guarded_unless_the_operator_names_a_module() -> None:
    config = Config("ExampleConnector")
    assert prepare_connector(config, []) == "ExampleConnector"  # Ferry's own logic goes by the given name
    assert (config.kv_connector, config.kv_connector_module_path) == (
        "GuardedExampleConnector",
        "workers.vllm_example_connector",
    )
    own = Config("ExampleConnector", kv_connector_module_path="my.connectors")
    prepare_connector(own, [])
    assert (own.kv_connector, own.kv_connector_module_path) == ("ExampleConnector", "my.connectors")
