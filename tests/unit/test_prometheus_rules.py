"""The shipped Prometheus configuration, recording and alert rules, checked by Prometheus's own promtool.

`make test` installs promtool first (`make prometheus`: Debian's package unpacked into the venv).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from launch.monitor import ROOT, config, prometheus_binary

PROM = ROOT / "docker" / "prometheus"


def promtool(*args: str | Path) -> str:
    """Run promtool; its output, or a failure showing it."""
    done = subprocess.run([prometheus_binary("promtool"), *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=PROM)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_shipped_config_is_valid() -> None:
    out = promtool("check", "config", PROM / "prometheus.yml")
    assert "2 rule files found" in out


def test_disaggregated_kubernetes_config_is_valid() -> None:
    out = promtool("check", "config", ROOT / "deploy" / "kubernetes-disagg" / "prometheus.yml")
    assert "SUCCESS" in out


def test_rules_are_valid() -> None:
    promtool("check", "rules", *sorted((PROM / "rules").glob("*.yml")))


def test_rules_behave_as_their_unit_tests_say() -> None:
    promtool("test", "rules", PROM / "tests" / "rules_test.yml")


def test_ferry_up_monitor_config_is_valid(tmp_path: Path) -> None:
    cfg, planners = tmp_path / "prometheus.yml", tmp_path / "planners.json"
    planners.write_text(json.dumps([{"targets": ["127.0.0.1:9200"], "labels": {"pool": "decode"}}]))
    cfg.write_text(json.dumps(config("http://127.0.0.1:8000/discovery/prometheus", planners)))
    assert "2 rule files found" in promtool("check", "config", cfg)
