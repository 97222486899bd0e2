"""The settings tables of docs/architecture.md, generated from the declarations in schemas/settings.py.

`python -m launch.settings_doc` prints them; `--write docs/architecture.md` rewrites them in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from launch.flags import default_text, sections
from schemas.settings import ENV_PREFIX, CommonSettings, FrontendSettings, StackSettings, WorkerSettings


def markdown_tables() -> str:
    """The settings tables of docs/architecture.md, generated so the page cannot drift from the code."""
    common = {f.name for f in dataclasses.fields(CommonSettings)}
    tables: list[tuple[str, type[Any], set[str]]] = [
        ("Shared by frontends and workers", CommonSettings, set()),
        ("Frontend only (`ferry frontend`)", FrontendSettings, common),
        ("Worker only (`ferry worker`)", WorkerSettings, common),
        ("`ferry up`", StackSettings, set()),
    ]
    out: list[str] = []
    for title, cls, skip in tables:
        out += [f"### {title}", "", "| flag | variable | default | meaning |", "| --- | --- | --- | --- |"]
        for f in (f for _group, fields in sections(cls) for f in fields):
            if f.name in skip:
                continue
            default = f"`{default_text(f)}`"
            flag = f"`--{f.name.replace('_', '-')}`"
            out.append(
                f"| {flag} | `{ENV_PREFIX}{f.name.upper()}` | {default} | {f.metadata.get('help', '')} |"
            )
        out.append("")
    return "\n".join(out)


def rewrite_tables(doc: str) -> str:
    """`doc` with its settings tables (first section title through the last table row) regenerated."""
    tables = markdown_tables().rstrip("\n")
    first, last = tables.splitlines()[0], "### `ferry up`"
    start = doc.index(first)
    end = doc.index(last, start)
    lines = doc[end:].splitlines(keepends=True)
    i = 1
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith("|")):
        if not lines[i].strip() and i > 2 and lines[i - 1].startswith("|"):
            break
        i += 1
    return doc[:start] + tables + "\n" + "".join(lines[i:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:
        path = sys.argv[2]
        with open(path) as f:
            text = rewrite_tables(f.read())
        with open(path, "w") as f:
            f.write(text)
    else:
        print(markdown_tables())
