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
import time
from pathlib import Path
from typing import Any

from bench.peers import venv as peer_venv

VERSION = "0.13.0"
PACKAGES = (f"aiperf=={VERSION}",)
EXPORT_NAME = "profile_export_aiperf.json"
venv_bin = peer_venv.venv_bin


def default_venv() -> Path:
    """Where aiperf is installed (bench.peers.venv.peer_home)."""
    return peer_venv.peer_home("aiperf", VERSION)


def installed_info(venv: Path) -> dict[str, Any] | None:
    """The marker written by a finished install, if it is for this version and aiperf starts."""
    return peer_venv.read_marker(venv, VERSION, ["-c", "import aiperf"], needs="aiperf")


def ensure_installed(venv: Path | None = None, log: Any = print) -> dict[str, Any]:
    """Install aiperf into `venv` unless a finished install is there; returns the install record."""
    venv = venv or default_venv()
    info = installed_info(venv)
    if info is not None:
        return info
    started = time.monotonic()
    pip = peer_venv.create(venv, log)
    peer_venv.install(pip, list(PACKAGES), log)
    info = peer_venv.record(
        venv,
        {
            "version": VERSION,
            "installed": list(PACKAGES),
            "install_seconds": round(time.monotonic() - started, 1),
        },
    )
    if installed_info(venv) is None:
        raise RuntimeError(f"aiperf {VERSION} does not import after installing into {venv}")
    return info


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in ensure_installed().items() if k != "freeze"}, indent=2))
