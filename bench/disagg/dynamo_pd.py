"""Dynamo 1.6.1 disaggregated on loopback: its frontend (`--router-mode kv`) and two mocker processes, one with
`--disaggregation-mode prefill` workers and one with `--disaggregation-mode decode` workers, the same engine
knobs as Ferry's simulated workers (bench/peers/dynamo.py installs Dynamo and holds the loopback setup).

Dynamo's frontend serves a request on a decode worker alone until it has seen a prefill worker, so the stack
counts as ready only once a probe request reports both a prefill and a decode worker (`nvext.worker_id`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers.dynamo import _stop_child, default_venv, loopback_env, venv_python
from launch.services import Child, free_port


@dataclass
class DynamoPD:
    """A running Dynamo frontend with a prefill and a decode mocker pool."""

    children: list[Child]
    host: str
    port: int
    workdir: Path

    @classmethod
    async def start(cls, *, model_path: str, model_name: str, prefill: int, decode: int, knobs: list[str],
                    decode_knobs: Sequence[str] = (), timeout_s: float = 120.0) -> DynamoPD:  # fmt: skip
        """Start the frontend and both pools; `knobs` are mocker flags given to both, `decode_knobs` to the decode
        pool after them."""
        py = str(venv_python(default_venv()))
        workdir = Path(tempfile.mkdtemp(prefix="ferry-dynamo-pd-"))
        env = loopback_env(workdir / "kv")
        port = free_port()
        common = ["--model-path", model_path, "--model-name", model_name]
        argvs = {
            "dynamo-frontend": [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                                *common, "--router-mode", "kv"],
            "dynamo-prefill": [py, "-m", "dynamo.mocker", *common, "--num-workers", str(prefill),
                               "--disaggregation-mode", "prefill", *knobs],
            "dynamo-decode": [py, "-m", "dynamo.mocker", *common, "--num-workers", str(decode),
                              "--disaggregation-mode", "decode", *knobs, *decode_knobs],
        }  # fmt: skip
        stack = cls([], "127.0.0.1", port, workdir)
        try:
            for name, argv in argvs.items():
                stack.children.append(await Child.spawn(name, argv, echo=False, env=env))
            await stack._wait_disaggregated(model_name, timeout_s)
        except BaseException:
            await stack.stop()
            raise
        return stack

    async def _wait_disaggregated(self, model: str, timeout_s: float) -> None:
        body = json.dumps({"model": model, "prompt": [1000 + i for i in range(80)], "max_tokens": 2,
                           "nvext": {"extra_fields": ["worker_id"]}}).encode()  # fmt: skip
        deadline, last = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            for child in self.children:
                if child.proc.returncode is not None:
                    raise RuntimeError(f"{child.name} exited:\n" + "\n".join(child.tail[-20:]))
            try:
                answer = await asyncio.to_thread(
                    _post, f"http://{self.host}:{self.port}/v1/completions", body
                )
                ids = (answer.get("nvext") or {}).get("worker_id") or {}
                last = str(ids)
                if ids.get("prefill_worker_id") and ids.get("decode_worker_id"):
                    return
            except OSError as exc:
                last = repr(exc)
            await asyncio.sleep(0.5)
        raise TimeoutError(f"Dynamo P/D was not ready after {timeout_s:.0f}s ({last})")

    async def stop(self) -> None:
        """Stop every process, then remove the discovery files."""
        for child in reversed(self.children):
            await _stop_child(child)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _post(url: str, body: bytes) -> dict[str, Any]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data
