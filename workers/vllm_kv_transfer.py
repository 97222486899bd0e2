"""What Ferry's prefill and decode attempts tell vLLM's KV connector, and what the connector tells back.

A connector that pulls the prompt's KV from the prefill engine (NIXL) needs a descriptor only that engine can
write: which engine, where to reach it, which blocks. vLLM's own P/D proxy passes it by hand; in Ferry it
rides the prefill worker's `Release` to the decode worker as `KVFrom.connector` (opaque to Ferry):

- a prefill-only attempt asks its engine to keep the prompt's blocks for a remote decode
  (`{"do_remote_decode": true}`), and the engine's final output answers with the descriptor;
- the decode attempt hands the descriptor back to its own engine, whose connector pulls the blocks.

A connector that needs none (the example shared-storage one finds the KV by the prompt's tokens) answers
nothing, and a decode attempt without a descriptor (the frontend's own hand-over, after the decode worker it
chose was lost) computes the prompt itself. So does one whose pull fails (the prefill worker was lost after
its release): vLLM would fail the request (its `kv_load_failure_policy` "fail"); Ferry's default is
"recompute", unless the operator's --kv-transfer-config names a policy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from schemas.kafka import GenerateRequest
from workers.ports import free_port

log = logging.getLogger("ferry.worker")

# Each NIXL engine listens on this side channel for its peers' handshakes; vLLM's default (5600) is one port
# per host, so two workers on one host would collide.
NIXL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_CONNECTORS = frozenset({"NixlConnector"})


class ConnectorConfig(Protocol):
    """What Ferry reads and sets of vLLM's KVTransferConfig."""

    kv_connector: str | None
    kv_connector_module_path: str | None
    kv_load_failure_policy: Any


def prepare_connector(config: ConnectorConfig, engine_flags: Sequence[str]) -> str:
    """Ready the engine's KV connector for P/D attempts (a side-channel port, the failure policy, the example
    connector's guard); its name as the operator gave it."""
    if not any("kv_load_failure_policy" in flag for flag in engine_flags):
        config.kv_load_failure_policy = "recompute"
    connector = config.kv_connector or ""
    if connector == "ExampleConnector" and not config.kv_connector_module_path:
        from workers.vllm_example_connector import GuardedExampleConnector as Guarded

        config.kv_connector, config.kv_connector_module_path = Guarded.__name__, Guarded.__module__
        log.info("KV connector ExampleConnector runs as %s.%s (vllm#53495: a negative cache hit kills its engine)",
                 Guarded.__module__, Guarded.__name__)  # fmt: skip
    side_channel_port(connector)
    return connector


def kv_transfer_args(request: GenerateRequest, connector: str) -> dict[str, Any] | None:
    """SamplingParams.extra_args for `request` on an engine whose KV connector is `connector` ("" for none)."""
    if not connector:
        return None
    if request.kv_from is not None and request.kv_from.connector is not None:
        return {"kv_transfer_params": dict(request.kv_from.connector)}
    if request.prefill_only:
        return {"kv_transfer_params": {"do_remote_decode": True}}
    return None


def side_channel_port(connector: str) -> None:
    """Give a NIXL engine a side-channel port of its own, unless the operator chose one."""
    if connector in NIXL_CONNECTORS and NIXL_PORT_ENV not in os.environ:
        # Free on every interface, whichever the operator's VLLM_NIXL_SIDE_CHANNEL_HOST names, and outside the
        # ephemeral range: the engine binds it only once it has loaded, and the worker's own connections to
        # Kafka and Redis open meanwhile (a bind(0) port was once taken by one of them).
        os.environ[NIXL_PORT_ENV] = str(free_port(""))
