"""NVIDIA aiperf as a load generator: installed into its own virtual environment, run as a subprocess, its
JSON export read back.

Install (done once, reused while the marker file says the same version), as the Dynamo peer is
(bench/peers/dynamo.py): `python -m venv ~/.cache/ferry/peers/aiperf-<version>` and `pip install
aiperf==<version>` from the package index. aiperf is given the local model directory as its tokenizer and
synthetic prompts, so it downloads nothing at run time.

Run: `aiperf profile` with a fixed request count, a concurrency and synthetic input/output lengths, against
127.0.0.1 only; the summary is read from `profile_export_aiperf.json` in the artifact directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VERSION = "0.13.0"
PACKAGES = (f"aiperf=={VERSION}",)
MARKER = "ferry-peer.json"
EXPORT_NAME = "profile_export_aiperf.json"


def default_venv() -> Path:
    """Where aiperf is installed: under Ferry's home (FERRY_HOME, default ~/.cache/ferry)."""
    home = Path(os.environ.get("FERRY_HOME", Path.home() / ".cache" / "ferry"))
    return home / "peers" / f"aiperf-{VERSION}"


def venv_bin(venv: Path, name: str) -> Path:
    """A script of a virtual environment."""
    return venv / "bin" / name


def _run(argv: list[str], log: Any = None, timeout_s: float = 1800) -> subprocess.CompletedProcess[str]:
    if log:
        log(" ".join(argv))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def installed_info(venv: Path) -> dict[str, Any] | None:
    """The marker written by a finished install, if it is for this version and aiperf starts."""
    marker = venv / MARKER
    if not marker.is_file() or not venv_bin(venv, "aiperf").is_file():
        return None
    try:
        info: dict[str, Any] = json.loads(marker.read_text())
    except ValueError:
        return None
    if info.get("version") != VERSION:
        return None
    probe = _run([str(venv_bin(venv, "python")), "-c", "import aiperf"], timeout_s=120)
    return info if probe.returncode == 0 else None


def ensure_installed(venv: Path | None = None, log: Any = print) -> dict[str, Any]:
    """Install aiperf into `venv` unless a finished install is there; returns the install record."""
    venv = venv or default_venv()
    info = installed_info(venv)
    if info is not None:
        return info
    started = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    if (r := _run([base, "-m", "venv", str(venv)], log)).returncode != 0:
        raise RuntimeError(f"creating the venv failed:\n{r.stderr[-2000:]}")
    py = str(venv_bin(venv, "python"))
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if (r := _run([*pip, *PACKAGES], log)).returncode != 0:
        raise RuntimeError(f"installing {' '.join(PACKAGES)} failed:\n{r.stderr[-2000:]}")
    info = {
        "version": VERSION,
        "venv": str(venv),
        "python": _run([py, "--version"]).stdout.strip(),
        "installed": list(PACKAGES),
        "freeze": _run([py, "-m", "pip", "freeze"]).stdout.split(),
        "install_seconds": round(time.monotonic() - started, 1),
    }
    (venv / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    if installed_info(venv) is None:
        raise RuntimeError(f"aiperf {VERSION} does not import after installing into {venv}")
    return info


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in ensure_installed().items() if k != "freeze"}, indent=2))
