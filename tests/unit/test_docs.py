"""docs/architecture.md must name every setting a process accepts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from schemas.settings import FrontendSettings, StackSettings, WorkerSettings

DOC = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("cls", [FrontendSettings, WorkerSettings, StackSettings])
def test_every_flag_and_variable_is_documented(cls: type) -> None:
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f"`--{f.name.replace('_', '-')}`" not in DOC or f"`FERRY_{f.name.upper()}`" not in DOC
    ]
    assert missing == []
