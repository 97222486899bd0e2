"""deploy/kubernetes/ without a cluster: every manifest against the Kubernetes schemas (kubernetes-validate's
bundled, strict ones) and the ScaledObject against KEDA's own CRD schema (tests/data/keda/, KEDA v2.20,
Apache-2.0); `kubectl kustomize` renders it when kubectl is installed; the commands parse with the real flag
parser and agree with the drain, the topics and the metric names of the code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from launch.flags import load
from schemas.names import pool_group, pool_topic
from schemas.ops_settings import PlannerSettings
from schemas.settings import FrontendSettings, WorkerSettings

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


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (it renders kustomize)")
def test_kustomize_renders() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    rendered = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in rendered}
    assert {"Deployment", "Service", "ScaledObject", "ConfigMap", "Namespace"} <= kinds
    assert all(d["metadata"].get("namespace") == "ferry" for d in rendered if d["kind"] != "Namespace")
    config_maps = {d["metadata"]["name"].rsplit("-", 1)[0] for d in rendered if d["kind"] == "ConfigMap"}
    assert {"ferry-prometheus", "ferry-grafana-provisioning"} <= config_maps
