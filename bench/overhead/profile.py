"""py-spy sampling of the stack's processes and a summary of the profiles it writes."""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ---- py-spy --------------------------------------------------------------------------------------


def py_spy_binary() -> str | None:
    """py-spy next to this interpreter, else on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


async def py_spy_record(pids: dict[str, int], seconds: float, out_dir: Path, tag: str) -> list[Path]:
    """Sample every named process for `seconds` with py-spy, writing collapsed stacks (`--format raw`)."""
    exe = py_spy_binary()
    if exe is None:
        print("py-spy not found; install it with `pip install py-spy` to use --profile", file=sys.stderr)
        return []
    procs = []
    paths = []
    for name, pid in pids.items():
        if name in ("kafka", "redis"):
            continue
        path = out_dir / f"{name}-{tag}.txt"
        argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "200",
                "--nonblocking", "--format", "raw", "--output", str(path)]  # fmt: skip
        procs.append(
            await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
        )
        paths.append(path)
    await asyncio.gather(*(p.wait() for p in procs))
    return [p for p in paths if p.exists()]


def hotspots(path: Path, top: int = 12) -> dict[str, Any]:
    """Self and inclusive sample shares per frame (`function (file:line)`) of a py-spy raw profile."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        self_counts[frames[-1]] += n
        for f in set(frames):
            incl_counts[f] += n

    def share(c: Counter[str], keep: Callable[[str], bool]) -> list[tuple[str, float]]:
        return [(f, round(100.0 * k / total, 1)) for f, k in c.most_common() if keep(f)][:top]

    ours = ("server/", "workers/", "schemas/", "kvstore/")
    return {
        "samples": total,
        "self_percent": share(self_counts, lambda f: True),
        "inclusive_percent_project_code": share(incl_counts, lambda f: any(p in f for p in ours)),
    }
