"""deploy/kubernetes/ and its disaggregated overlay, deploy/kubernetes-disagg/, without a cluster: every manifest
against the Kubernetes schemas (kubernetes-validate's bundled, strict ones) and the ScaledObject against KEDA's
own CRD schema (tests/data/keda/, KEDA v2.20, Apache-2.0); `kubectl kustomize` renders both when kubectl is
installed; the commands parse with the real flag parser and agree with the drain, the topics and the metric
names of the code."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from launch.flags import load, load_with_engine_flags
from schemas.names import pool_group, pool_topic
from schemas.ops_settings import PlannerSettings
from schemas.settings import FrontendSettings, WorkerSettings
from workers.engine_choice import kv_connector_given

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
KEDA_CRD = ROOT / "tests" / "data" / "keda" / "keda.sh_scaledobjects.yaml"
KUSTOMIZATION: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
DOCS: list[dict[str, Any]] = [
    d for name in KUSTOMIZATION["resources"] for d in yaml.safe_load_all((K8S / name).read_text()) if d
]


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _container(deployment: str) -> dict[str, Any]:
    (c,) = _one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if d["apiVersion"] != "keda.sh/v1alpha1"],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_manifest_is_valid_for_kubernetes(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_schemas_reject_a_wrong_manifest() -> None:
    worker = _one("Deployment", "ferry-worker")
    wrong = {**worker, "spec": {**worker["spec"], "replica": 3}}  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


def test_scaled_object_is_valid_for_keda() -> None:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = version["schema"]["openAPIV3Schema"]
    so = _one("ScaledObject", "ferry-worker")
    jsonschema.validate(so, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema does reject a wrong manifest
        jsonschema.validate({**so, "spec": {**so["spec"], "minReplicaCount": "one"}}, schema)


def test_keda_scales_the_worker_on_the_planner_and_the_pool_lag() -> None:
    so = _one("ScaledObject", "ferry-worker")
    assert so["spec"]["scaleTargetRef"]["name"] == "ferry-worker"
    triggers = {t["type"]: t["metadata"] for t in so["spec"]["triggers"]}
    assert "ferry_planner_desired_workers" in triggers["prometheus"]["query"]
    model = yaml.safe_load((K8S / "config.yaml").read_text())["data"]["FERRY_SERVED_MODEL_NAME"]
    assert triggers["kafka"]["topic"] == pool_topic(model)
    assert triggers["kafka"]["consumerGroup"] == pool_group(model)


def test_worker_drains_within_its_termination_grace() -> None:
    c = _container("ferry-worker")
    s = load(WorkerSettings, c["args"][1:])
    pod = _one("Deployment", "ferry-worker")["spec"]["template"]["spec"]
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + s.drain_grace_s
    assert s.metrics_host == "0.0.0.0" and {p["containerPort"] for p in c["ports"]} == {s.metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "metrics"


def test_frontend_and_planner_commands_parse() -> None:
    fe = load(FrontendSettings, _container("ferry-frontend")["args"][1:])
    assert fe.host == "0.0.0.0"
    assert {"readinessProbe", "livenessProbe"} <= set(_container("ferry-frontend"))
    pl = load(PlannerSettings, _container("ferry-planner")["args"][1:])
    assert pl.prometheus and pl.k8s_deployment == "ferry-worker"
    role = _one("Role", "ferry-planner")
    assert role["rules"][0]["resources"] == ["deployments/scale"]


needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed (it renders kustomize)"
)


def kustomize(root: Path) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize` renders from `root`."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@needs_kubectl
def test_kustomize_renders() -> None:
    rendered = kustomize(K8S)
    kinds = {d["kind"] for d in rendered}
    assert {"Deployment", "Service", "ScaledObject", "ConfigMap", "Namespace"} <= kinds
    assert all(d["metadata"].get("namespace") == "ferry" for d in rendered if d["kind"] != "Namespace")
    config_maps = {d["metadata"]["name"].rsplit("-", 1)[0] for d in rendered if d["kind"] == "ConfigMap"}
    assert {"ferry-prometheus", "ferry-grafana-provisioning"} <= config_maps


# ---- deploy/kubernetes-disagg: the prefill and decode pools over the base --------------------------------

DISAGG = ROOT / "deploy" / "kubernetes-disagg"
DISAGG_DOCS: list[dict[str, Any]] = [
    d
    for name in yaml.safe_load((DISAGG / "kustomization.yaml").read_text())["resources"]
    if not name.startswith("..")
    for d in yaml.safe_load_all((DISAGG / name).read_text())
    if d
]


def _pool(name: str) -> dict[str, Any]:
    (doc,) = [d for d in DISAGG_DOCS if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize("doc", DISAGG_DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_disagg_manifest_is_valid_for_kubernetes(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_each_pool_runs_its_role_with_nixl_on_a_declared_side_channel(role: str, kv_role: str) -> None:
    deployment = _pool(f"ferry-{role}")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    s, engine_flags = load_with_engine_flags(WorkerSettings, c["args"][1:])
    assert (s.engine, s.role) == ("vllm", role) and kv_connector_given(engine_flags)
    config = json.loads(engine_flags[engine_flags.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role}
    env = {e["name"]: e for e in c["env"]}
    # The descriptor names the pod's own address, and a port the container declares.
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["nixl"] == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    assert ports["metrics"] == s.metrics_port and s.metrics_host == "0.0.0.0"
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pre_stop + s.drain_grace_s


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_pool_has_a_planner_that_may_scale_it(role: str) -> None:
    (c,) = _pool(f"ferry-planner-{role}")["spec"]["template"]["spec"]["containers"]
    pl = load(PlannerSettings, c["args"][1:])
    assert (pl.planner_pool, pl.actuator, pl.k8s_deployment) == (role, "kubernetes", f"ferry-{role}")
    (role_doc,) = [d for d in DISAGG_DOCS if d["kind"] == "Role"]
    assert f"ferry-{role}" in role_doc["rules"][0]["resourceNames"]


@needs_kubectl
def test_disagg_overlay_replaces_the_aggregated_pool() -> None:
    rendered = kustomize(DISAGG)
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert {("Deployment", "ferry-prefill"), ("Deployment", "ferry-decode"), ("Deployment", "ferry-frontend")} <= names
    assert not {("Deployment", "ferry-worker"), ("ScaledObject", "ferry-worker"), ("Deployment", "ferry-planner")} & names
    assert all(d["metadata"].get("namespace") == "ferry" for d in rendered if d["kind"] != "Namespace")
    (prom,) = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("ferry-prometheus")]
    assert "ferry-planner-prefill:9201" in prom["data"]["prometheus.yml"]
