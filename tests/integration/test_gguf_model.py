"""`--model FILE.gguf`: a worker and a frontend started side by side on the shipped GGUF file serve a chat."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from launch import model_prepare
from launch.model_prepare import MARKER_FILE, find_gguf, gguf_model_dir, prepare_model
from tests.harness import frontend_process, worker_process

pytestmark = pytest.mark.integration


def _link_files_of(model_dir: Path) -> Callable[[Path, Path, bool], dict[str, str]]:
    # The real conversion takes ~40 s on two cores. The session's model directory was converted from this
    # very file by the same code (`_convert`), so its files stand in for the conversion's output; everything
    # around it (the marker naming the GGUF file, the lock, the rename, resolving --model) is real.
    def convert(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
        for file in model_dir.iterdir():
            if file.is_file() and file.name != MARKER_FILE:
                (work / file.name).symlink_to(file)
        return {"transformers": "session model", "torch": "session model"}

    return convert


async def test_worker_and_frontend_serve_a_gguf_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path / "home"))  # the children inherit it
    monkeypatch.delenv("FERRY_SERVED_MODEL_NAME", raising=False)
    gguf = find_gguf()
    monkeypatch.setattr(model_prepare, "_convert", _link_files_of(model_path))
    out = prepare_model(gguf_model_dir(gguf), progress=False, gguf=gguf)
    assert out == tmp_path / "home" / "models" / "SmolLM2-135M-Instruct.Q4_1"
    marker = (out / MARKER_FILE).read_text()

    worker_id = f"w-{uuid.uuid4().hex[:6]}"
    worker, (frontend, url) = await asyncio.gather(
        worker_process(worker_id, kafka, redis_url, prefix, gguf, "--speedup", "50", "--no-pool"),
        frontend_process(kafka, redis_url, prefix, gguf),
    )
    try:
        assert any(f"--model {gguf}: serving {out}" in line for line in worker.tail), worker.tail
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
            body = {
                "model": "SmolLM2-135M-Instruct.Q4_1",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 4,
                "ignore_eos": True,
            }
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-ferry-worker"] == worker_id
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        await frontend.stop()
        await worker.stop()
    assert (out / MARKER_FILE).read_text() == marker  # neither process converted it again
