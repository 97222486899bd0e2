"""The settings tables of docs/architecture.md, generated from the declarations in schemas/settings.py.

`python -m launch.settings_doc` prints them; `--write docs/architecture.md` rewrites them in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from launch.flags import default_text, sections
from launch.stack import PER_CHILD
from schemas.ops_settings import PlannerPolicySettings, PlannerSettings, StackSettings, UsageSettings
from schemas.settings import ENV_PREFIX, CommonSettings, FrontendSettings, WorkerSettings

UP_TITLE = "`ferry up`"


def markdown_tables() -> str:
    """The settings tables of docs/architecture.md, generated so the page cannot drift from the code."""
    common = {f.name for f in dataclasses.fields(CommonSettings)}
    ids = " and ".join(f"`--{name.replace('_', '-')}`" for name in PER_CHILD)
    up_intro = (
        f"`ferry up` takes every flag above except {ids} (it names each child itself) and passes each child "
        "the ones it takes; there `--port 0` picks a free port. With `--autoscale` it also takes the planner's "
        f"targets and limits ({', '.join(_flags(PlannerPolicySettings)[:3])}, ...: the second group of the "
        "planner's table) and runs the planner on its own workers (one per pool when it starts prefill and decode "
        "pools). Its own flags:"
    )
    tables: list[tuple[str, str, type[Any], set[str]]] = [
        ("Shared by frontends and workers", "", CommonSettings, set()),
        ("Frontend only (`ferry frontend`)", "", FrontendSettings, common),
        ("Worker only (`ferry worker`)", "", WorkerSettings, common),
        ("Planner only (`ferry planner`)", "", PlannerSettings, common),
        (UP_TITLE, up_intro, StackSettings, set()),
        ("`ferry usage`", "Also takes `--kafka`. Its own flags:", UsageSettings, common),
    ]
    out: list[str] = []
    for title, intro, cls, skip in tables:
        out += [f"### {title}", ""]
        if intro:
            out += [intro, ""]
        out += ["| flag | variable | default | meaning |", "| --- | --- | --- | --- |"]
        for f in (f for _group, fields in sections(cls) for f in fields):
            if f.name in skip:
                continue
            flag = f"`--{f.name.replace('_', '-')}`"
            out.append(
                f"| {flag} | `{ENV_PREFIX}{f.name.upper()}` | `{default_text(f)}` | {f.metadata.get('help', '')} |"
            )
        out.append("")
    return "\n".join(out)


def _flags(cls: type[Any]) -> list[str]:
    return [f"`--{f.name.replace('_', '-')}`" for f in dataclasses.fields(cls)]


def rewrite_tables(doc: str) -> str:
    """`doc` with its settings tables (first section title through the last table's last row) regenerated."""
    tables = markdown_tables().rstrip("\n")
    start = doc.index(tables.splitlines()[0])
    last_title = [line for line in tables.splitlines() if line.startswith("### ")][-1]
    lines = doc[doc.index(last_title, start) :].splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.startswith("|"))
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return doc[:start] + tables + "\n" + "".join(lines[end:])


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
