"""`ferry batch` against a running frontend: submit --wait with its progress bar, status, results, cancel, list."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from launch.cli import main as ferry
from tests.harness import harness
from tests.integration.test_batch_api import chat_line, jsonl, model_name


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `ferry ...` in a thread (it is a blocking HTTP client; the frontend runs on this loop)."""
    code = await asyncio.to_thread(ferry, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_batch_commands(
    kafka: str,
    redis_url: str,
    prefix: str,
    model_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path / "store"))
        src = tmp_path / "in.jsonl"
        lines = [chat_line(f"c{i}", model, f"Line {i}") for i in range(8)] + [
            chat_line("bad", model, "x", max_tokens=10**6)
        ]
        src.write_bytes(jsonl(lines))
        out = tmp_path / "out.jsonl"

        code, stdout, stderr = await run(capsys, "batch", "submit", str(src), "--url", url, "--wait", "-o", str(out),
                                         "--metadata", "team=qa", "--poll-s", "0.1")  # fmt: skip
        batch_id = stdout.strip()
        assert code == 0, stderr
        assert batch_id.startswith("batch_")
        assert "9/9" in stderr and "completed" in stderr  # the progress bar's last state and the summary
        answers = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(a["custom_id"] for a in answers) == [f"c{i}" for i in range(8)]

        code, stdout, _ = await run(capsys, "batch", "status", batch_id, "--url", url, "--json")
        status = json.loads(stdout)
        assert code == 0 and status["status"] == "completed" and status["metadata"] == {"team": "qa"}
        assert status["request_counts"] == {"total": 9, "completed": 8, "failed": 1}

        errors = tmp_path / "errors.jsonl"
        out2 = tmp_path / "out2.jsonl"
        code, _, _ = await run(capsys, "batch", "results", batch_id, "--url", url, "-o", str(out2),
                               "--errors", str(errors))  # fmt: skip
        assert code == 0 and out2.read_bytes() == out.read_bytes()
        assert [json.loads(x)["custom_id"] for x in errors.read_text().splitlines()] == ["bad"]

        code, _, stderr = await run(capsys, "batch", "cancel", batch_id, "--url", url)
        assert code == 1 and "cannot be cancelled" in stderr

        code, stdout, _ = await run(capsys, "batch", "list", "--url", url)
        assert code == 0 and stdout.startswith(f"{batch_id}  completed")

        code, _, stderr = await run(capsys, "batch", "status", "batch_nope", "--url", url)
        assert code == 1 and "404" in stderr
