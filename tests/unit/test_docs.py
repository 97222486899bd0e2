"""docs/architecture.md must show the settings and the module layout exactly as the code has them."""

from __future__ import annotations

from pathlib import Path

from launch.layout_doc import markdown
from launch.settings_doc import markdown_tables

DOC = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()


def test_settings_tables_match_the_code() -> None:
    # Regenerate with: .venv/bin/python -m launch.settings_doc --write docs/architecture.md
    assert markdown_tables().strip() in DOC


def test_layout_tables_match_the_modules() -> None:
    # Regenerate with: .venv/bin/python -m launch.layout_doc --write docs/architecture.md
    assert markdown().strip() in DOC
