"""NVIDIA Dynamo as a peer: install it into its own virtual environment and run its frontend and mocker workers
on loopback, with no etcd and no NATS.

Install (done once, reused while the marker file says the same version):

    python -m venv ~/.cache/ferry/peers/dynamo-1.6.1
    pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    pip install <their Requires-Dist, without extras and without `aisimulate`>

`aisimulate` is left out because its PyPI package is a stub that downloads from elsewhere; the mocker is
compiled into the runtime wheel and does not need it. A requirement that no release on the package index
satisfies (ai-dynamo 1.6.1 asks for `certifi>=2026.10.19`) is installed at the newest release available and
reported; everything here talks to 127.0.0.1 only, so the CA bundle is never used.

Run (`DynamoStack.start`): one `python -m dynamo.frontend --router-mode kv` and one `python -m dynamo.mocker
--num-workers N` process, discovery through files (`DYN_DISCOVERY_BACKEND=file`), TCP request plane, ZMQ event
plane, and every host variable on 127.0.0.1.

`python -m bench.peers.dynamo install` installs (or checks) the peer; `... run --workers 8` starts it and
prints its URL until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.peers import venv as peer_venv
from launch.services import Child, free_port

VERSION = "1.6.1"
PACKAGES = (f"ai-dynamo=={VERSION}", f"ai-dynamo-runtime=={VERSION}")
SKIPPED_REQUIREMENTS = frozenset({"aisimulate"})

# Every address Dynamo binds or advertises stays on loopback.
_LOOPBACK_VARS = (
    "DYN_HTTP_HOST",
    "DYN_TCP_RPC_HOST",
    "DYN_HTTP_RPC_HOST",
    "DYN_SYSTEM_HOST",
    "DYN_EVENT_PLANE_HOST",
    "DYN_TCP_RESPONSE_STREAM_HOST",
)

# Run inside the peer's interpreter: its own requirements, markers evaluated for that interpreter.
_LIST_REQUIREMENTS = r"""
import json, sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
out = []
for dist in sys.argv[1:]:
    for raw in requires(dist) or []:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        out.append({"name": req.name, "spec": str(req.specifier), "raw": raw})
print(json.dumps(out))
"""


def default_venv() -> Path:
    """Where the peer is installed (bench.peers.venv.peer_home)."""
    return peer_venv.peer_home("dynamo", VERSION)


def venv_python(venv: Path) -> Path:
    """The interpreter of a virtual environment."""
    return peer_venv.venv_bin(venv, "python")


def installed_info(venv: Path) -> dict[str, Any] | None:
    """The marker written by a finished install, if it is for this version and the modules import."""
    return peer_venv.read_marker(venv, VERSION, ["-c", "import dynamo.frontend, dynamo.mocker, dynamo._core"])


def ensure_installed(venv: Path | None = None, log: Any = print) -> dict[str, Any]:
    """Install Dynamo into `venv` unless a finished install is there; returns the install record."""
    venv = venv or default_venv()
    info = installed_info(venv)
    if info is not None:
        return info
    started = time.monotonic()
    pip = peer_venv.create(venv, log)
    peer_venv.install(pip, ["--no-deps", *PACKAGES], log)
    py = str(venv_python(venv))
    r = peer_venv.run([py, "-c", _LIST_REQUIREMENTS, "ai-dynamo", "ai-dynamo-runtime"])
    if r.returncode != 0:
        raise RuntimeError(f"reading Dynamo's requirements failed:\n{r.stderr[-2000:]}")
    reqs = [q for q in json.loads(r.stdout) if q["name"].lower() not in SKIPPED_REQUIREMENTS]
    specs = [f"{q['name']}{q['spec']}" for q in reqs]
    relaxed: list[str] = []
    if peer_venv.run([*pip, *specs], log).returncode != 0:
        # One at a time; a pin no release satisfies falls back to the newest release and is reported.
        for q in reqs:
            spec = f"{q['name']}{q['spec']}"
            if peer_venv.run([*pip, spec], log).returncode == 0:
                continue
            peer_venv.install(pip, [q["name"]], log)
            relaxed.append(spec)
    info = peer_venv.record(
        venv,
        {
            "version": VERSION,
            "installed_no_deps": list(PACKAGES),
            "requirements": specs,
            "skipped": sorted(SKIPPED_REQUIREMENTS),
            "relaxed": relaxed,
            "install_seconds": round(time.monotonic() - started, 1),
        },
    )
    if installed_info(venv) is None:
        raise RuntimeError(f"Dynamo {VERSION} does not import after installing into {venv}")
    return info


def loopback_env(file_kv: Path) -> dict[str, str]:
    """Environment for Dynamo processes: file discovery, TCP requests, everything on 127.0.0.1."""
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(file_kv),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_LOG": os.environ.get("DYN_LOG", "warn"),
    }
    env.update(dict.fromkeys(_LOOPBACK_VARS, "127.0.0.1"))
    return env


@dataclass
class DynamoStack:
    """A running Dynamo frontend and one mocker process with N workers."""

    frontend: Child
    mocker: Child
    host: str
    port: int
    workdir: Path
    argv: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API."""
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> dict[str, int]:
        """Process ids by role, for CPU accounting."""
        return {"dynamo-frontend": self.frontend.proc.pid, "dynamo-mocker": self.mocker.proc.pid}

    @classmethod
    async def start(
        cls,
        *,
        model_path: str,
        model_name: str,
        workers: int,
        speedup: float,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
        router_args: list[str] | None = None,
        venv: Path | None = None,
        timeout_s: float = 120.0,
    ) -> DynamoStack:
        """Start the frontend and the workers and wait until the frontend sees every worker."""
        py = str(venv_python(venv or default_venv()))
        workdir = Path(tempfile.mkdtemp(prefix="ferry-dynamo-"))
        env = loopback_env(workdir / "kv")
        port = free_port()
        fe_argv = [
            py, "-m", "dynamo.frontend",
            "--http-host", "127.0.0.1", "--http-port", str(port),
            "--model-path", model_path, "--model-name", model_name,
            *(router_args if router_args is not None else ["--router-mode", "kv"]),
        ]  # fmt: skip
        mk_argv = [
            py, "-m", "dynamo.mocker",
            "--model-path", model_path, "--model-name", model_name,
            "--num-workers", str(workers),
            "--speedup-ratio", repr(speedup),
            "--block-size", str(block_size),
            "--num-gpu-blocks-override", str(num_blocks),
            "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            *(["--max-model-len", str(max_model_len)] if max_model_len else []),
        ]  # fmt: skip
        frontend = await Child.spawn("dynamo-frontend", fe_argv, echo=False, env=env)
        mocker: Child | None = None
        try:
            mocker = await Child.spawn("dynamo-mocker", mk_argv, echo=False, env=env)
            stack = cls(
                frontend, mocker, "127.0.0.1", port, workdir, {"frontend": fe_argv, "mocker": mk_argv}, env
            )
            await stack._wait_ready(model_name, workers, timeout_s)
            return stack
        except BaseException:
            for child in (mocker, frontend):
                if child is not None:
                    await _stop_child(child)
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    async def _wait_ready(self, model: str, workers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for child in (self.frontend, self.mocker):
                if child.proc.returncode is not None:
                    raise RuntimeError(
                        f"{child.name} exited with code {child.proc.returncode}:\n"
                        + "\n".join(child.tail[-20:])
                    )
            try:
                health = await asyncio.to_thread(_get_json, f"{self.url}/health")
                models = await asyncio.to_thread(_get_json, f"{self.url}/v1/models")
                ready = sum(1 for i in health.get("instances", []) if i.get("endpoint") == "generate")
                listed = any(m.get("id") == model for m in models.get("data", []))
                last = f"{ready}/{workers} workers, model listed: {listed}"
                if ready >= workers and listed:
                    return
            except OSError as exc:
                last = repr(exc)
            await asyncio.sleep(0.5)
        raise TimeoutError(
            f"Dynamo was not ready after {timeout_s:.0f}s ({last}); frontend said:\n"
            + "\n".join(self.frontend.tail[-10:])
            + "\nmocker said:\n"
            + "\n".join(self.mocker.tail[-10:])
        )

    async def stop(self) -> None:
        """SIGINT both processes (their graceful shutdown), SIGKILL what is left, remove the discovery files."""
        await _stop_child(self.mocker)
        await _stop_child(self.frontend)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


async def _stop_child(child: Child, timeout_s: float = 10.0) -> None:
    proc = child.proc
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            pass
    await child.stop(5.0)


async def _serve(args: argparse.Namespace) -> None:
    stack = await DynamoStack.start(
        model_path=args.model_path,
        model_name=args.model_name,
        workers=args.workers,
        speedup=args.speedup,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    print(f"dynamo-ready {stack.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await stack.stop()


def main(argv: list[str] | None = None) -> int:
    """`install` or `run` the peer."""
    from schemas.settings import DEFAULT_MODEL_NAME, default_model_path

    p = argparse.ArgumentParser(prog="python -m bench.peers.dynamo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="install Dynamo into its venv (or check the existing install)")
    run = sub.add_parser("run", help="start a frontend (--router-mode kv) and N mocker workers")
    run.add_argument("--workers", type=int, default=8)
    run.add_argument("--speedup", type=float, default=1.0)
    run.add_argument("--block-size", type=int, default=64)
    run.add_argument("--num-blocks", type=int, default=16384)
    run.add_argument("--model-path", default=default_model_path())
    run.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    args = p.parse_args(argv)
    info = ensure_installed()
    if args.cmd == "install":
        print(json.dumps({k: v for k, v in info.items() if k != "freeze"}, indent=2))
        return 0
    import uvloop

    uvloop.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
