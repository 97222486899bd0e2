"""The package layout holds: each package imports only what docs/architecture.md's "Layout" allows, and no
module of the frontend or the worker grows past 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"schemas", "kvstore", "bus", "workers", "server", "planner", "launch"}

# What each package may import of ours besides itself, and third-party packages it must not touch.
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "kvstore": {"schemas"},
    "bus": {"schemas"},
    "workers": {"schemas", "kvstore", "bus"},
    "server": {"schemas", "kvstore", "bus"},
    # The autoscaler reads the registry and Kafka and acts through actuators; it never imports a process.
    "planner": {"schemas", "kvstore", "bus"},
    "launch": {"schemas", "kvstore", "bus", "workers", "server", "planner"},
}
FORBIDDEN: dict[str, set[str]] = {
    "schemas": {"aiokafka", "redis", "starlette", "uvicorn", "vllm", "torch"},
    "kvstore": {"aiokafka", "starlette", "uvicorn", "vllm", "torch"},
    "bus": {"redis", "starlette", "uvicorn", "vllm", "torch"},
    "server": {"vllm", "torch"},
    "planner": {"vllm", "torch", "starlette", "uvicorn"},
}
MAX_LINES = 500


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_the_layout_allows(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        imported = _imported(path)
        wrong = (imported & OURS) - ALLOWED[package] - {package}
        wrong |= imported & FORBIDDEN.get(package, set())
        if wrong:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not offenders


@pytest.mark.parametrize("package", ["server", "workers"])
def test_no_module_of_the_frontend_or_the_worker_is_over_500_lines(package: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long
