"""`ferry up --monitor`: a real Prometheus scraping the stack through the frontend's service discovery.

The binary is Debian's `prometheus` package unpacked without root by `make prometheus` (into the venv,
`<venv>/prometheus/usr/bin/`); `$FERRY_HOME/prometheus/usr/bin/` and PATH are looked at too. The
configuration is docker/prometheus/prometheus.yml's, pointed at this stack's frontend, with the shipped
recording and alert rules.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from launch.services import Child, free_port
from schemas.settings import default_home

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "docker" / "prometheus" / "rules"
# Beside the configuration: the planners' scrape targets (file_sd), written once they run.
PLANNERS_FILE = "planners.json"


def prometheus_binary(name: str = "prometheus") -> str:
    """Path of `prometheus` or `promtool`; FileNotFoundError naming the make target that installs it."""
    for base in (Path(sys.prefix) / "prometheus", default_home() / "prometheus"):
        path = base / "usr" / "bin" / name
        if path.is_file():
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found: `make prometheus` unpacks Debian's package into the venv")


def config(discovery_url: str, planners_file: Path, scrape_s: float = 2.0) -> dict[str, Any]:
    """The Prometheus configuration for a stack whose frontend answers `discovery_url`, and whose planners
    (`ferry up --autoscale`) are listed in `planners_file` once they run (JSON is YAML)."""
    interval = f"{int(scrape_s * 1000)}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in sorted(RULES.glob("*.yml"))],
        "scrape_configs": [
            {
                "job_name": "ferry",
                "http_sd_configs": [{"url": discovery_url, "refresh_interval": interval}],
                "relabel_configs": [{"source_labels": ["ferry_id"], "target_label": "instance"}],
            },
            # The planners are not in the registry; Prometheus re-reads this file when it changes.
            {"job_name": "ferry-planner", "file_sd_configs": [{"files": [str(planners_file)]}]},
        ],
    }


class Monitor:
    """A Prometheus child and the directory that holds its configuration and data."""

    def __init__(self, child: Child, url: str, workdir: Path) -> None:
        self.child = child
        self.url = url
        self._workdir = workdir
        self.planners_file = workdir / PLANNERS_FILE

    def scrape_planners(self, metrics_urls: dict[str, str]) -> None:
        """Scrape each planner's /metrics (pool -> URL), its samples labelled with its `pool`."""
        groups = []
        for pool, url in metrics_urls.items():
            parts = urlsplit(url)
            labels = {"pool": pool, "__metrics_path__": parts.path or "/metrics"}
            groups.append({"targets": [parts.netloc], "labels": labels})
        tmp = self.planners_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.planners_file)  # whole, so Prometheus never reads half a file

    async def stop(self) -> None:
        """Stop Prometheus and remove its data."""
        try:
            await self.child.stop()
        finally:
            shutil.rmtree(self._workdir, ignore_errors=True)


async def start_monitor(discovery_url: str, scrape_s: float = 2.0, timeout_s: float = 60.0) -> Monitor:
    """Start Prometheus on a free loopback port; returns once it is ready."""
    binary = prometheus_binary()
    workdir = Path(tempfile.mkdtemp(prefix="ferry-prometheus-"))
    cfg = workdir / "prometheus.yml"
    planners = workdir / PLANNERS_FILE
    planners.write_text("[]")  # no planner until `ferry up --autoscale` has started its own
    cfg.write_text(json.dumps(config(discovery_url, planners, scrape_s), indent=2))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]  # fmt: skip
    child = await Child.spawn("prometheus", argv, echo=False)
    monitor = Monitor(child, url, workdir)
    try:
        await _ready(monitor, timeout_s)
    except BaseException:
        await monitor.stop()
        raise
    return monitor


async def _ready(monitor: Monitor, timeout_s: float) -> None:
    async with httpx.AsyncClient(timeout=2) as c, asyncio.timeout(timeout_s):
        while True:
            if monitor.child.proc.returncode is not None:
                raise RuntimeError("prometheus exited:\n" + "\n".join(monitor.child.tail))
            try:
                if (await c.get(f"{monitor.url}/-/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)  # nothing to await on a process that does not listen yet
