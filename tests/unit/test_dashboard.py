"""The Grafana dashboard JSON and its provisioning files: generated, consistent, and in Grafana's shape.

Grafana cannot be installed here: the JSON is checked for the structure Grafana's dashboard model
requires (unique panel ids, grid positions inside 24 columns, every target a PromQL expression on the
provisioned datasource), and tests/integration/test_dashboard_queries.py runs every expression against a
real Prometheus scraping a live stack.
"""

from __future__ import annotations

import json

import yaml

from launch.dashboard import OUT, ROOT, render

GRAFANA = ROOT / "docker" / "grafana"


def test_committed_json_is_what_the_generator_writes() -> None:
    assert OUT.read_text() == render(), "run `python -m launch.dashboard --write`"


def test_panels_are_well_formed() -> None:
    d = json.loads(OUT.read_text())
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat") and p["targets"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "prometheus" and t["expr"].strip()
    names = {p["title"] for p in d["panels"]}
    for row in ("SLOs per model", "Throughput", "Errors", "Routing", "KV cache per worker", "Worker roles (prefill and decode pools)", "Kafka",
                "Migrations", "Batch", "Planner"):  # fmt: skip
        assert row in names
    assert [v["name"] for v in d["templating"]["list"]] == ["model"]


def test_provisioning_names_the_datasource_and_the_dashboards() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [d["uid"] for d in ds["datasources"]] == ["prometheus"]
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "ferry.yml").read_text())
    assert dash["providers"][0]["type"] == "file" and dash["providers"][0]["options"]["path"]
