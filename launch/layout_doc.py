"""The "Layout" tables of docs/architecture.md, generated from each module's one-line job statement.

`python -m launch.layout_doc` prints them; `--write docs/architecture.md` rewrites them in place (between
the markers `<!-- layout:begin -->` and `<!-- layout:end -->`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each package, what it is for, and what of ours it may import (tests/unit/test_layout.py enforces it).
PACKAGES: list[tuple[str, str, str]] = [
    ("schemas", "the contracts: every message that crosses a process, topic and key names, setting declarations",
     "nothing of ours"),
    ("kvstore", "everything kept in Redis: registry, KV block index, shared load, batch and resume records, "
     "block hashing", "`schemas`"),
    ("bus", "everything Kafka: producing, the one consumer-loop owner every reader uses, topic admin, "
     "log-reset detection", "`schemas`"),
    ("workers", "the worker process: inbox, serving, outbox, heartbeat, engines (`sim`, `vllm`), KV events, "
     "batch work", "`schemas`, `kvstore`, `bus`"),
    ("server", "the frontend: HTTP routes, preprocessing, routing, reply demultiplexing, migration, SSE, "
     "the batch API", "`schemas`, `kvstore`, `bus`"),
    ("planner", "the autoscaler: latency, load and Kafka-lag inputs, the SLO policy, actuators (local "
     "processes, Kubernetes, a gauge for KEDA)", "`schemas`, `kvstore`, `bus`"),
    ("launch", "the `ferry` CLI, flag and environment loading, `ferry up`'s local stack, `model prepare`",
     "everything; nothing imports it"),
]
BEGIN, END = "<!-- layout:begin -->", "<!-- layout:end -->"


def _job(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def markdown() -> str:
    """The package table, then one table of modules and their jobs per package."""
    out = ["| package | job | may import |", "| --- | --- | --- |"]
    out += [f"| `{name}/` | {job} | {imports} |" for name, job, imports in PACKAGES]
    for name, _job_text, _imports in PACKAGES:
        out += ["", f"`{name}/`:", "", "| module | job |", "| --- | --- |"]
        for path in sorted((ROOT / name).rglob("*.py")):
            if path.name == "__init__.py" and path.parent != ROOT / name:
                continue
            rel = path.relative_to(ROOT / name).as_posix()
            out.append(f"| `{rel}` | {_job(path)} |")
    return "\n".join(out) + "\n"


def rewrite(doc: str) -> str:
    """`doc` with the text between the layout markers regenerated."""
    start = doc.index(BEGIN) + len(BEGIN)
    end = doc.index(END)
    return doc[:start] + "\n" + markdown() + doc[end:]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        target = Path(sys.argv[2])
        target.write_text(rewrite(target.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown(), end="")
