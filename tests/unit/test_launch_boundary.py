"""launch/ may import every package; none of server/, workers/, kvstore/ or schemas/ imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["schemas", "kvstore", "workers", "server"])
def test_no_product_package_imports_launch(package: str) -> None:
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if "launch" in _imported(p)]
    assert not offenders
