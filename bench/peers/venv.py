"""A peer's own virtual environment under Ferry's home: where it lives, its install marker, and the steps every
peer install shares (create the venv, pip into it, record what was installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = "ferry-peer.json"
PIP_FLAGS = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")


def peer_home(name: str, version: str) -> Path:
    """Where a peer is installed: under Ferry's home (FERRY_HOME, default ~/.cache/ferry)."""
    home = Path(os.environ.get("FERRY_HOME", Path.home() / ".cache" / "ferry"))
    return home / "peers" / f"{name}-{version}"


def venv_bin(venv: Path, name: str) -> Path:
    """A script (or the interpreter) of a virtual environment."""
    return venv / "bin" / name


def run(
    argv: list[str], log: Callable[[str], Any] | None = None, timeout_s: float = 1800
) -> subprocess.CompletedProcess[str]:
    """Run an install step, echoing it to `log` first."""
    if log:
        log(" ".join(argv))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def read_marker(venv: Path, version: str, probe: list[str], needs: str = "python") -> dict[str, Any] | None:
    """The marker of a finished install of `version`, if `needs` is in the venv and `probe` (argv after the
    interpreter) succeeds."""
    marker = venv / MARKER
    if not marker.is_file() or not venv_bin(venv, needs).is_file():
        return None
    try:
        info: dict[str, Any] = json.loads(marker.read_text())
    except ValueError:
        return None
    if info.get("version") != version:
        return None
    return info if run([str(venv_bin(venv, "python")), *probe], timeout_s=120).returncode == 0 else None


def create(venv: Path, log: Callable[[str], Any] | None = None) -> list[str]:
    """A fresh venv at `venv` (an unfinished one is removed first); returns its pip install command."""
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    if (r := run([base, "-m", "venv", str(venv)], log)).returncode != 0:
        raise RuntimeError(f"creating the venv failed:\n{r.stderr[-2000:]}")
    return [str(venv_bin(venv, "python")), *PIP_FLAGS]


def install(pip: list[str], packages: list[str], log: Callable[[str], Any] | None = None) -> None:
    """pip install `packages`, raising with pip's error on failure."""
    if (r := run([*pip, *packages], log)).returncode != 0:
        raise RuntimeError(f"installing {' '.join(packages)} failed:\n{r.stderr[-2000:]}")


def record(venv: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """The install record: `fields` plus the interpreter and the frozen packages, written as the marker."""
    py = str(venv_bin(venv, "python"))
    info = {
        **fields,
        "venv": str(venv),
        "python": run([py, "--version"]).stdout.strip(),
        "freeze": run([py, "-m", "pip", "freeze"]).stdout.split(),
    }
    (venv / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info
