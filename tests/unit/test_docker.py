"""docker/ cannot be built here (no Docker engine), so its contract with the code is checked instead:
every Ferry command in compose.yaml parses with the real flag parser, every service is health-checked and
restarted, starts after what it needs is healthy, the monitoring files it mounts are the ones docker/ holds,
and the image copies what exists, runs as a user without privileges and leaves the KV cache to the flag."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.flags import load
from schemas.ops_settings import PlannerSettings
from schemas.settings import FrontendSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
FERRY = [name for name, spec in SERVICES.items() if spec.get("image") == "ferry:cpu"]

Settings = FrontendSettings | WorkerSettings | PlannerSettings


def _settings(service: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    spec = SERVICES[service]
    for name, value in spec.get("environment", {}).items():
        # Compose's `${VAR:-default}`: the default applies when the variable is unset.
        monkeypatch.setenv(name, re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value)))
    verb, *argv = spec["command"]
    cls = {"frontend": FrontendSettings, "worker": WorkerSettings, "planner": PlannerSettings}[verb]
    return load(cls, argv)  # type: ignore[no-any-return]


@pytest.mark.parametrize("service", FERRY)
def test_every_ferry_command_parses_and_uses_the_compose_services(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _settings(service, monkeypatch)
    assert (s.kafka, s.redis) == ("kafka:9092", "redis://redis:6379/0")


@pytest.mark.parametrize("service", ["frontend-a", "frontend-b"])
def test_two_frontends_listen_beyond_loopback_and_share_the_batch_volume(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _settings(service, monkeypatch)
    assert isinstance(s, FrontendSettings)
    assert (s.host, s.port, s.batch_dir) == ("0.0.0.0", 8000, "/data/files")
    assert "batch-files:/data/files" in SERVICES[service]["volumes"] and "batch-files" in COMPOSE["volumes"]
    assert "ports" not in SERVICES[service]  # reached through the load balancer only
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    assert f"server {service}:{s.port}" in conf
    assert SERVICES["lb"]["ports"] == [f"{s.port}:{s.port}"]


def test_worker_command_parses_with_vllm_cpu_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings("worker", monkeypatch)
    assert isinstance(s, WorkerSettings)
    assert s.engine == "vllm" and s.block_size % 32 == 0  # vllm-cpu's requirement
    # Replicas share one command, so the id must come from the default (random per process), not a flag.
    assert "--worker-id" not in SERVICES["worker"]["command"]
    # The worker drains on SIGTERM: compose must wait longer than its grace before killing it.
    assert float(SERVICES["worker"]["stop_grace_period"].rstrip("s")) > s.drain_grace_s


def test_the_planner_reads_both_frontends_and_serves_its_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings("planner", monkeypatch)
    assert isinstance(s, PlannerSettings)
    assert s.frontends.split(",") == ["http://frontend-a:8000", "http://frontend-b:8000"]
    assert (s.planner_host, s.actuator) == ("0.0.0.0", "none")


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_service_is_health_checked_restarted_and_waits_for_healthy_dependencies(service: str) -> None:
    spec = SERVICES[service]
    assert spec["restart"] == "unless-stopped"
    assert spec["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    for dep, cond in spec.get("depends_on", {}).items():
        assert dep in SERVICES and cond == {"condition": "service_healthy"}, (dep, cond)


def test_kafka_advertises_the_address_the_services_use() -> None:
    env = SERVICES["kafka"]["environment"]
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://kafka:9092"


def test_prometheus_and_grafana_mount_the_files_docker_holds() -> None:
    mounts = {
        m.split(":")[1]: m.split(":")[0] for s in ("prometheus", "grafana") for m in SERVICES[s]["volumes"]
    }
    assert mounts["/etc/prometheus"] == "./prometheus"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    assert mounts["/var/lib/grafana/dashboards"] == "./grafana/dashboards"
    for src in mounts.values():
        if not src.startswith("prometheus-data"):
            assert (ROOT / "docker" / src).is_dir(), src
    assert (ROOT / "docker" / "prometheus" / "prometheus.yml").is_file()


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


def test_the_image_runs_without_privileges_and_the_flag_sizes_the_kv_cache() -> None:
    (user,) = re.findall(r"^USER (\S+)", DOCKERFILE, flags=re.M)
    assert user not in ("root", "0")
    # On the CPU vLLM lets this variable override --kv-cache-gib; neither the image nor compose sets it.
    assert not re.search(r"(ENV|\\)\s+VLLM_CPU_KVCACHE_SPACE|VLLM_CPU_KVCACHE_SPACE=", DOCKERFILE)
    assert all("VLLM_CPU_KVCACHE_SPACE" not in s.get("environment", {}) for s in SERVICES.values())


def test_dockerignore_keeps_the_build_context_to_what_the_image_copies() -> None:
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*"  # everything out (the .venv above all) ...
    allowed = {ln.lstrip("!").rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set(re.findall(r"^COPY (\S+)", DOCKERFILE, flags=re.M)) | {"pyproject.toml", "README.md"}
    assert copied <= allowed  # ... but what the image copies
    assert ".venv" not in allowed
